"""The trust boundary: what the host checks comes from files and its own actions, never an adapter's word.

A stand-in stack that lies (tests/stacks/liar, a test double named as such, built on the kit's reference
backend) runs the service and rollout stages through the host's own stage code: its rollout service under
the local engine, the real trl trainer and policy server against it. Each lie fails the gate it lies to;
the gates it does not lie to still pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import CALC_PLAN
from runner_contracts import StageResult, read_record

from runner._stages import prepare_arm, run_stage
from runner._stages.rollout import FAULT_FILE
from runner.api import LocalEngine, load_manifest, load_plan, resolve_policy

pytestmark = pytest.mark.slow  # trains with the trl stack

LIAR = Path(__file__).resolve().parent / "stacks" / "liar" / "stack.toml"


def test_a_lying_stack_fails_every_gate_it_lies_to(tmp_path):
    engine = LocalEngine()
    plan = resolve_policy(load_plan(CALC_PLAN), engine)
    arm = prepare_arm(load_manifest(LIAR), engine, plan, tmp_path / "liar")
    try:
        service, rollout = run_stage(arm, "service"), run_stage(arm, "rollout")
    finally:
        arm.close()
    gates = {gate.name: gate for evidence in (service, rollout) for gate in evidence.gates}

    # It hid a failed scripted episode: the host expects every scripted case of the plan by itself.
    hidden = gates["service:scripted-episodes"]
    assert not hidden.passed and "missing" in hidden.detail, hidden
    assert gates["service:reward-equals-reference"].passed  # the cases it kept are scored honestly

    # It trained on captures whose ids the policy server never sampled.
    captured = gates["calls:policy-tokens-captured"]
    assert not captured.passed and "differ from the server's sampled ids" in captured.detail, captured
    assert gates["calls:attributed"].passed

    # It named a decoy process and pid 1 as its environment: the host killed only the decoy, which was its
    # own, refused pid 1, and no episode saw a crash, so the environment's recovery was never shown.
    fault = json.loads((arm.stage_dir("rollout") / "injected-crash" / FAULT_FILE).read_text())
    assert 1 in fault["environment_pids"] and 1 not in fault["killed"] and fault["killed"]
    assert not gates["recovery:fault-injected"].passed, gates["recovery:fault-injected"]
    assert not gates["recovery:environment-restarted"].passed, gates["recovery:environment-restarted"]
    assert gates["recovery:no-episode-lost"].passed

    # The one figure only the adapter knows is marked as its word.
    result = read_record(arm.stage_dir("rollout") / "result.json", StageResult)
    assert "batches" in result.metrics and "batches" in rollout.metrics["reported_by_adapter"]
