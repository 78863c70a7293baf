"""`runner compare` end to end: the trl arm and every environment stack on the calc-tool CPU plan, each in
its own real environment (pinned upstream packages), environment stacks driven by the same TRL trainer
through the policy server; the lightning-verl arm trains from its gateway's own token capture. One run
covers both `runner compare --stacks trl,nemo-gym,openenv,verifiers` and `--stacks trl,lightning-verl`.
Slow: builds the environments on first use (cached by lock hash)."""

from __future__ import annotations

import json

import pytest
from conftest import COMPARED_ARMS as ARMS
from conftest import PLANTED_SECRETS, leftover_processes, wait_until
from runner_contracts import Evidence, read_record

GATEWAY_CAPTURE = "stack capture (gateway), audited against the policy server"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def comparison(local_comparison):
    return local_comparison


def test_every_arm_passes_every_gate(comparison):
    run_dir, data, result = comparison
    failed = {arm["stack"]: arm["failed_gates"] for arm in data["arms"] if not arm["passed"]}
    assert not failed and result.returncode == 0, failed
    assert [arm["stack"] for arm in data["arms"]] == ARMS
    assert (run_dir / "comparison.md").is_file() and (run_dir / "report.html").is_file()


def test_arms_share_one_plan_and_one_policy(comparison):
    run_dir, data, _ = comparison
    plan_ids = {json.loads((run_dir / "arms" / arm / "plan.json").read_text())["plan_id"] for arm in ARMS}
    assert plan_ids == {data["plan_id"]}
    for arm in ARMS:
        evidence = read_record(run_dir / "arms" / arm / "stages" / "train" / "evidence.json", Evidence)
        assert evidence.plan_id == data["plan_id"]
        source = evidence.provenance  # what produced it: the checkout, the command, the families, the template
        assert source.command[1:3] == ["compare", "--stacks"] and source.python and source.host_packages["runner"]
        assert source.task_families["calc-tool"].endswith("scorer v1") and len(source.chat_template_sha256) == 64
        assert (source.git_commit is None) == (source.git_dirty is None)


def test_environment_arms_capture_every_call_and_lose_no_episode(comparison):
    _, data, _ = comparison
    for arm in data["arms"]:
        fidelity, crash = arm["trace_fidelity"], arm["recovery"]["injected_environment_crash"]
        assert fidelity["trained_equals_sampled"] is True
        if arm["stack"] == "trl":
            assert fidelity["token_source"] == "trainer's own sampled ids" and crash["applicable"] is False
            continue
        assert fidelity["token_source"] in ("policy server capture", GATEWAY_CAPTURE) and fidelity["policy_calls"] > 0
        assert fidelity["unattributed_calls"] == 0
        assert crash["killed_pids"] and crash["lost"] == 0 and crash["returned"] == crash["requested"]
        assert crash["environment_pids_after"] and not set(crash["environment_pids_after"]) & set(crash["killed_pids"])
        # The policy server held the later episodes' calls until the host had killed the environment, so the
        # crash landed mid-batch (batched sampling can finish a batch before a poll sees it half done).
        assert crash["call_hold"]["released"] == "by the host" and crash["call_hold"]["held_calls"] > 0
        assert crash["retried_episodes"] + crash["failed_episodes"] > 0
        assert arm["isolation"]["foreign_packages_absent"] is True
    lightning = next(arm for arm in data["arms"] if arm["stack"] == "lightning-verl")
    assert lightning["trace_fidelity"]["token_source"] == GATEWAY_CAPTURE


def test_comparison_carries_the_figures(comparison):
    run_dir, data, _ = comparison
    assert "| policy server sampling (train stage) | – | batched, " in (run_dir / "comparison.md").read_text()
    for arm in data["arms"]:
        assert arm["time_to_first_reproducible_update_s"] > 0
        assert arm["throughput"]["rollouts_per_s"] > 0 and arm["throughput"]["policy_tokens_per_s"] > 0
        batching = arm["throughput"]["policy_batching"]  # the trl arm samples in its own generate loop
        assert batching is None if arm["stack"] == "trl" else batching["mode"] == "batched", (arm["stack"], batching)
        assert set(arm["evaluation"]) == {"heldout", "retention"}
        assert arm["recovery"]["resume_passed"] is True
        # Measured by each stack's probe, inside the local engine's bubblewrap sandbox (an environment
        # arm's trainer and rollout service in one network namespace): nothing reachable beyond the run.
        # `make test` installs bubblewrap.
        reach = arm["isolation"]["reach"]
        assert arm["isolation"]["sandbox"].startswith("bubblewrap") and reach["inputs"], arm["isolation"]
        assert (reach["outbound_tcp"], reach["write_outside_run_dir"], reach["write_inputs"]) == (False,) * 3
        # fp32 on CPU, the same weights sampling and training: the mismatch panel must read agreement.
        mismatch = arm["trace_fidelity"]["mismatch"]
        assert mismatch["stage"] == "train" and abs(mismatch["median_token_mult_prob_error"] - 1) < 1e-3
        assert 0 < arm["evaluation"]["heldout"]["detectable_difference"] <= 1
    heldout = data["arm_tests"]["heldout"]  # every pair of the six arms on the same held-out items
    assert len(heldout["pairs"]) == 15 and {p["n"] for p in heldout["pairs"]} == {24}
    twins = [p for p in heldout["pairs"] if "trl" not in (p["first"], p["second"])]
    assert {p["verdict"] for p in twins} == {"indistinguishable"}  # the same weights solve the same items


def test_environment_arms_that_see_the_same_conversations_train_the_same_weights(comparison):
    """The comparison holds everything but the environment stack fixed: the policy server seeds each call
    from (plan seed, episode, call index) and renders every stack's conversation the same way, so stacks
    that implement a task equivalently reach byte-identical weights (here all five environment stacks,
    the team harness behind Agent Lightning's gateway included)."""
    _, data, _ = comparison
    weights = {arm["stack"]: arm["final_weights_sha256"] for arm in data["arms"] if arm["stack"] != "trl"}
    assert len(set(weights.values())) == 1 and None not in weights.values(), weights


def test_no_process_outlives_the_comparison(comparison):
    """Every process any stage of any arm started (servers an upstream starts in a session of its own
    included) ended with its stage."""
    run_dir, _, _ = comparison
    wait_until(lambda: not leftover_processes(run_dir), f"no process left in {run_dir}: "
               f"{leftover_processes(run_dir)}", 10)


def test_no_planted_secret_reaches_a_file_the_run_wrote(comparison):
    """Every file of the comparison (evidence, reports, requests, logs, trajectories, checkpoints) is read."""
    run_dir, _, _ = comparison
    planted = [value.encode() for value in PLANTED_SECRETS.values()] + [b"planted-url-password"]
    files = [path for path in run_dir.rglob("*") if path.is_file()]
    assert len(files) > 100
    leaks = []
    for path in files:
        data = path.read_bytes()
        leaks += [f"{path}: {secret.decode()}" for secret in planted if secret in data]
    assert not leaks, leaks
