"""The lightning-verl arm's GPU evidence: what verl's trainer collected, trained on and saved, turned into the
contract's files, then audited by the host exactly as for every arm.

verl's trainer needs CUDA GPUs and vLLM, which this machine does not have, so its outputs are stood in for
(named FAKE below): completed rollouts shaped as Agent Lightning 1.0.2's CompletedRollout.model_dump(), a
trained batch laid out as its RolloutAdapter lays out a DataProto (prompts left-padded, responses
right-padded, tool tokens masked out of the response mask), and a checkpoint folder laid out as verl
0.9.1's FSDP checkpoint manager writes it. The conversions and the host audit are the real code.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from qualification.gates.stages import checkpoint_revisions, latest_complete_checkpoint
from qualification.gates.trace import TraceAudit
from runner_contracts import sha256_file

ROOT = Path(__file__).resolve().parents[1]
MODULE_PATH = ROOT / "stacks/lightning-verl/adapter/src/runner_stack_lightning_verl/verl_evidence.py"
PAD = 0


@pytest.fixture(scope="module")
def evidence():
    spec = importlib.util.spec_from_file_location("verl_evidence", MODULE_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["verl_evidence"] = module
    spec.loader.exec_module(module)
    return module


def fake_completed_rollout(rollout_id: str, data_id: str, calls: list[tuple[list[int], list[int], list[float]]],
                           reward: float, state: str = "succeeded") -> dict:
    """FAKE: a CompletedRollout as AglRolloutManager returns it after the store worker ran the harness."""
    return {
        "rollout_id": rollout_id, "data_id": data_id, "step": 1, "sample_idx_in_step": 0, "enqueue_time": 1.0,
        "input": {"task_id": f"task-{data_id}", "family": "calc-tool", "item": "{}"},
        "final_reward": reward if state == "succeeded" else None,
        "triplets": [{"prompt": {"token_ids": p}, "response": {"token_ids": r, "log_probs": lp}, "reward": None,
                      "metadata": {}} for p, r, lp in calls],
        "events": [{"event_type": "reward", "data": {
            "value": reward, "outcome": "success" if reward > 0.5 else "failure", "finish_reason": "stop",
            "turns": len(calls), "components": {"answer": reward}}}] if state == "succeeded" else [],
        "rollout_state": state, "error_message": None if state == "succeeded" else "team harness killed by signal 9",
    }


# A two-call episode: the second prompt continues the first call's prompt + sampled ids with tool ids 9, 9.
TWO_CALLS = [([5, 6, 7], [11, 12], [-0.1, -0.2]), ([5, 6, 7, 11, 12, 9, 9], [13, 2], [-0.3, -0.4])]
ONE_CALL = [([5, 6, 8], [14, 2], [-0.5, -0.6])]


def fake_trained_batch(rows: list[tuple[str, list[int], list[int], list[int], list[float], float]],
                       prompt_width: int = 5, response_width: int = 8) -> dict:
    """FAKE: the DataProto fields verl's actor update consumed, as its RolloutAdapter pads them.
    rows: (rollout id, prompt ids, response ids, response mask, old logprobs of the response, advantage)."""
    batch = {"input_ids": [], "attention_mask": [], "response_mask": [], "advantages": [], "old_log_probs": [],
             "rollout_id_list": []}
    for rollout_id, prompt, response, mask, old, advantage in rows:
        left = prompt_width - len(prompt)
        right = response_width - len(response)
        batch["input_ids"].append([PAD] * left + prompt + response + [PAD] * right)
        batch["attention_mask"].append([0] * left + [1] * (len(prompt) + len(response)) + [0] * right)
        batch["response_mask"].append(mask + [0] * right)
        batch["advantages"].append([advantage * m for m in mask] + [0.0] * right)
        batch["old_log_probs"].append(old + [0.0] * right)
        batch["rollout_id_list"].append(rollout_id)
    return batch


def audit(trajectories, rows) -> dict[str, bool]:
    trace = TraceAudit(vocab_size=100, group_size=2, tolerance=1e-3)
    trace.add(lambda: trajectories, rows)
    return {gate.name: gate.passed for gate in trace.gates()}


def test_trained_rows_equal_the_gateway_captured_tokens(evidence):
    rollouts = [fake_completed_rollout("r1", "d1", TWO_CALLS, 1.0), fake_completed_rollout("r2", "d1", ONE_CALL, 0.0)]
    trajectories = evidence.trajectories_of(rollouts, run_id="run", stack="lightning-verl", stage="update", step=1,
                                            revision="rev0")
    first = trajectories[0]
    assert [(s.source, s.token_ids) for s in first.segments] == [
        ("prompt", [5, 6, 7]), ("policy", [11, 12]), ("env", [9, 9]), ("policy", [13, 2])]
    assert first.segments[3].logprobs == [-0.3, -0.4] and first.segments[2].logprobs is None
    assert (first.episode_id, first.group_id, first.sample_index) == ("update/s1/r1", "update/s1/d1", 0)
    assert (trajectories[1].group_id, trajectories[1].sample_index) == ("update/s1/d1", 1)
    assert (first.outcome, first.turns, first.reward_components) == ("success", 2, {"answer": 1.0})
    batch = fake_trained_batch([
        ("r1", [5, 6, 7], [11, 12, 9, 9, 13, 2], [1, 1, 0, 0, 1, 1], [-0.1, -0.2, 0.0, 0.0, -0.3, -0.4], 0.7),
        ("r2", [5, 6, 8], [14, 2], [1, 1], [-0.5, -0.6], -0.7)])
    rows = evidence.training_rows_of(batch, stage="update", step=1)
    assert rows[0].input_ids == [5, 6, 7, 11, 12, 9, 9, 13, 2]
    assert rows[0].loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1]
    assert rows[0].old_logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3, -0.4]
    assert (rows[0].advantage, rows[1].advantage, rows[1].episode_ids) == (0.7, -0.7, ["update/s1/r2"])
    gates = audit(trajectories, rows)
    assert gates["trace:trained-equals-sampled"] and gates["trace:mask-provenance"], gates
    assert gates["trace:logprob-agreement"] and gates["trace:every-episode-trained"], gates


def test_a_tool_token_in_verls_response_mask_fails_the_audit(evidence):
    rollouts = [fake_completed_rollout("r1", "d1", TWO_CALLS, 1.0), fake_completed_rollout("r2", "d1", ONE_CALL, 0.0)]
    trajectories = evidence.trajectories_of(rollouts, run_id="run", stack="lightning-verl", stage="update", step=1,
                                            revision="rev0")
    batch = fake_trained_batch([
        ("r1", [5, 6, 7], [11, 12, 9, 9, 13, 2], [1, 1, 1, 0, 1, 1], [-0.1, -0.2, -1.0, 0.0, -0.3, -0.4], 0.7),
        ("r2", [5, 6, 8], [14, 2], [1, 1], [-0.5, -0.6], -0.7)])
    gates = audit(trajectories, evidence.training_rows_of(batch, stage="update", step=1))
    assert not gates["trace:mask-provenance"] and not gates["trace:trained-equals-sampled"], gates


def test_a_failed_rollout_is_kept_and_marked(evidence):
    rollouts = [fake_completed_rollout("r3", "d2", [], 0.0, state="failed")]
    (trajectory,) = evidence.trajectories_of(rollouts, run_id="run", stack="lightning-verl", stage="train", step=2,
                                             revision="rev1")
    assert trajectory.outcome == "error" and trajectory.segments == []
    assert trajectory.error.message == "team harness killed by signal 9"
    assert trajectory.policy_revision == "rev1" and trajectory.episode_id == "train/s2/r3"


def fake_verl_save(root: Path, step: int, weights: bytes) -> Path:
    """FAKE: global_step_<step>/ as verl 0.9.1's FSDP checkpoint manager writes it with hf_model saved."""
    folder = root / f"global_step_{step}"
    hf = folder / "actor" / "huggingface"
    hf.mkdir(parents=True)
    (hf / "model.safetensors").write_bytes(weights)
    (hf / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    (folder / "actor" / "model_world_size_1_rank_0.pt").write_bytes(b"fsdp shard")
    (folder / "actor" / "optim_world_size_1_rank_0.pt").write_bytes(b"optimizer")
    (folder / "data.pt").write_bytes(b"dataloader state")
    return folder


def test_verl_checkpoints_are_published_as_contract_checkpoints(evidence, tmp_path):
    files = evidence.EvidenceFiles(tmp_path / "stage", run_id="run", stack="lightning-verl", stage="train",
                                   initial_revision="rev0")
    for step in (1, 2):
        files.checkpoint(step, fake_verl_save(tmp_path / "verl", step, f"weights after {step}".encode()))
    files.close()
    revisions, incomplete = checkpoint_revisions(tmp_path / "stage" / "checkpoints")
    assert incomplete == [] and sorted(revisions) == [1, 2]
    latest = latest_complete_checkpoint(tmp_path / "stage" / "checkpoints")
    assert latest.name == "checkpoint-2" and revisions[2] == sha256_file(latest / "model.safetensors")
    assert (latest / "config.json").is_file()
    assert evidence.verl_folder_of(latest) == latest / "global_step_2"  # what a resumed run hands verl
    assert (latest / "global_step_2" / "actor" / "optim_world_size_1_rank_0.pt").read_bytes() == b"optimizer"
    assert files.revisions[2] == revisions[2]  # step 3's episodes will name these weights


def test_a_verl_save_without_hf_weights_is_refused_by_name(evidence, tmp_path):
    folder = fake_verl_save(tmp_path / "verl", 1, b"w")
    (folder / "actor" / "huggingface" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="save_contents must include hf_model"):
        evidence.publish_checkpoint(folder, tmp_path / "checkpoints", 1)
    assert not (tmp_path / "checkpoints" / "checkpoint-1" / "COMPLETE").exists()


def test_the_host_accounts_every_rollout_in_the_stacks_ledger(evidence, tmp_path):
    """The store worker's rollout ledger (a typed record in result.json) is checked against the trajectories."""
    from runner_contracts import JsonlWriter, RolloutLedger

    from runner._stages.audits import ledger_audit

    rollouts = [fake_completed_rollout("r1", "d1", TWO_CALLS, 1.0), fake_completed_rollout("r2", "d1", [], 0.0, "failed")]
    with JsonlWriter(tmp_path / "trajectories.jsonl") as writer:
        for record in evidence.trajectories_of(rollouts, run_id="run", stack="lightning-verl", stage="train", step=1,
                                               revision="rev0"):
            writer.write(record)

    def gate(**counts):
        return ledger_audit(tmp_path, RolloutLedger(**counts))[0][0]

    assert gate(claimed=2, succeeded=1, failed=1).passed
    short = gate(claimed=3, succeeded=2, failed=1)  # a rollout the worker ran is missing from the evidence
    assert not short.passed and (short.measured, short.threshold) == (2, 3)
    assert not gate(claimed=2, succeeded=2, failed=0).passed  # a failure the worker did not report
    assert not gate(claimed=2, succeeded=1, failed=1, worker_error="RuntimeError('store gone')").passed
