"""Release conditions (plan.release): a release or hold verdict per arm, naming each condition not met."""

import msgspec
import pytest
from runner_contracts import Evidence, GateResult, ReleaseSpec, freeze_plan, plan_id
from test_contracts import PLAN

from runner._report import release_verdict
from runner.api import load_plan

HELDOUT = {"n": 48, "base_k": 19, "trained_k": 30, "base": "19/48", "trained": "30/48", "difference": 11 / 48,
           "p_value": 0.019}
RETENTION = {"n": 48, "base_k": 40, "trained_k": 39, "base": "40/48", "trained": "39/48", "difference": -1 / 48,
             "p_value": 1.0}


def plan_with(**release):
    plan = freeze_plan(load_plan(PLAN))
    return msgspec.structs.replace(plan, release=ReleaseSpec(**release) if release else None)


def data(passed=True, mismatch=1.001):
    return {"passed": passed, "failed_gates": [] if passed else ["rollout:signal:reward-variance"],
            "stages": {"probe": "passed"}, "evaluation": {"heldout": HELDOUT, "retention": RETENTION},
            "mismatch": {"median_token_mult_prob_error": mismatch}}


def retention_gate(passed: bool) -> list[Evidence]:
    return [Evidence(run_id="r", stack="trl", stage="evaluate", plan_id="x", status="passed", started_at="t",
                     finished_at="t", gates=[GateResult(name="evaluate:retention", passed=passed)])]


def test_no_release_block_no_verdict_and_the_plan_id_is_unchanged():
    plan = plan_with()
    assert release_verdict(plan, data(), []) is None
    assert plan_id(plan) == plan_id(freeze_plan(load_plan(PLAN)))
    assert plan_id(plan_with(heldout_alpha=0.05)) != plan_id(plan)  # conditions are part of the plan


def test_every_condition_met_is_release():
    plan = plan_with(heldout_alpha=0.05, retention="non-inferior", max_token_mult_prob_error=1.1)
    assert release_verdict(plan, data(), retention_gate(True)) == {"verdict": "release", "failed": []}


@pytest.mark.parametrize(("release", "arm", "gates", "failed"), [
    ({"heldout_alpha": 0.01}, data(), [], "held-out improved at alpha 0.01: 19/48 -> 30/48, p=0.019"),
    ({"retention": "zero-drop"}, data(), [], "retention zero-drop: 40 -> 39 of 48"),
    ({"retention": "non-inferior"}, data(), retention_gate(False), "retention non-inferior within 0.15"),
    ({"max_token_mult_prob_error": 1.05}, data(mismatch=1.2), [], "token_mult_prob_error median <= 1.05: 1.2000"),
    ({"heldout_alpha": 0.05}, data(passed=False), [], "every gate passed: rollout:signal:reward-variance"),
])
def test_each_condition_not_met_holds_and_is_named(release, arm, gates, failed):
    verdict = release_verdict(plan_with(**release), arm, gates)
    assert verdict["verdict"] == "hold" and any(line.startswith(failed) for line in verdict["failed"]), verdict
