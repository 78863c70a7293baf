"""Host audits shared by the rollout and training stages: the trace audit (trained tokens are the sampled
tokens, masks, logprobs, revisions), an environment arm's policy-server calls, a rollout ledger a stack
reports for a sampler that keeps no call log, and generation throughput."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from qualification.gates import call_gates
from qualification.tasks import get_family
from runner_contracts import GateResult, PolicyCall, RolloutLedger, StageResult, Trajectory

from .._policy import vocab_size
from .arm import Arm, read_any


def audit_trace(arm: Arm, out: Path, *, signal: bool, revisions: dict[int, str] | None) -> tuple[list[GateResult], dict]:
    from qualification.gates import TraceAudit  # its workers, scratch database and panel: ~20 ms to import

    audit = TraceAudit(vocab_size=vocab_size(arm.policy_dir), group_size=arm.plan.budget.generations_per_prompt,
                       tolerance=arm.plan.gates.logprob_tolerance)
    audit.add_files(out / "trajectories.jsonl", out / "training.jsonl")
    gates = audit.gates()
    if signal:
        gates += audit.degeneracy_gates(arm.plan.gates.min_groups_with_variance,
                                        expects_tools=bool(get_family(arm.plan.task.family).tools))
    gates.append(audit.revision_gate(arm.plan.policy.sha256 or "", revisions or {}))
    groups, varied = audit.groups_with_variance()
    metrics = {
        "episodes": audit.counts["episodes"], "policy_tokens": audit.counts["policy_tokens"],
        "trained_tokens": audit.counts["trained_tokens"], "max_logprob_gap": audit.max_logprob_gap,
        "episodes_with_tool_calls": audit.counts["episodes_with_tool_calls"],
        "groups_with_variance": varied,
        "groups": groups,
        "reward_per_step": audit.reward_per_step(),
        "mismatch": audit.mismatch.summary(),
    }
    return gates, metrics


def environment_arm_audit(arm: Arm, out: Path, result: StageResult | None) -> tuple[list[GateResult], dict]:
    """Policy-server calls against the trajectories: attribution, tokens, continuity, retries and failures,
    all from the two files. A stack that trains from its own token capture (a gateway) is held to the same
    check: its rows' tokens must be the server's."""
    if arm.service_env is None:
        return [], {}
    trajectories = read_any(out, "trajectories.jsonl", Trajectory)
    gates, metrics = call_gates(read_any(out, "calls.jsonl", PolicyCall), trajectories)
    stack_rows = sum(batch.get("rows_from_stack_capture", 0) for batch in reported(result, "batches", metrics) or [])
    if stack_rows:
        metrics["rows_from_stack_capture"] = stack_rows
    batching = reported(result, "policy_batching", metrics)  # batched or one call at a time, and why
    if batching:
        metrics["policy_batching"] = batching
    return gates, metrics


def reported(result: StageResult | None, key: str, metrics: dict[str, Any]) -> Any:
    """A figure only the adapter knows (its result's metrics[key]); listed under the stage's
    metrics["reported_by_adapter"], so evidence and report say whose word it is."""
    value = result.metrics.get(key) if result is not None else None
    if value is not None:
        metrics.setdefault("reported_by_adapter", [])
        if key not in metrics["reported_by_adapter"]:
            metrics["reported_by_adapter"].append(key)
    return value


def sampling_audit(arm: Arm, job: str, out: Path, result: StageResult | None) -> tuple[list[GateResult], dict]:
    """What a job's trajectories are checked against: the rollout ledger when the stack reports one (its
    sampler keeps no call log), else an environment arm's policy-server log. A job in the stack's GPU
    environment samples with the stack's own servers, so without a ledger nothing records what it sampled."""
    if result is not None and result.rollout_ledger is not None:
        return ledger_audit(out, result.rollout_ledger)
    if arm.trains_on_gpu(job):
        return [GateResult(name="calls:rollouts-accounted", passed=False, measured=None, threshold="a rollout ledger",
                           detail="the job trained with the stack's own sampler and reported no rollout ledger")], {}
    return environment_arm_audit(arm, out, result)


def ledger_audit(out: Path, ledger: RolloutLedger) -> tuple[list[GateResult], dict]:
    """Every rollout the stack's runner claimed has a trajectory (the stack's capture of what was sampled),
    a failed one marked error, and the runner did not stop early."""
    trajectories = read_any(out, "trajectories.jsonl", Trajectory)
    failed = sum(1 for t in trajectories if t.outcome == "error")
    accounted = (len(trajectories) == ledger.claimed == ledger.succeeded + ledger.failed
                 and failed == ledger.failed and not ledger.worker_error)
    gate = GateResult(
        name="calls:rollouts-accounted", passed=accounted, measured=len(trajectories), threshold=ledger.claimed,
        detail=f"{ledger.claimed} rollouts run by the stack's rollout runner ({ledger.failed} failed: "
               f"{'; '.join(ledger.failures[:2]) or 'none'}); {len(trajectories)} trajectories from the "
               f"trainer's completed rollouts, {failed} marked error"
               + (f"; runner stopped: {ledger.worker_error}" if ledger.worker_error else ""))
    return [gate], {"failed_episodes": failed, "rollouts": msgspec.to_builtins(ledger)}


def throughput(arm: Arm, result: StageResult | None, metrics: dict[str, Any]) -> dict[str, float]:
    """Episodes and policy tokens per second of generation: the rollout service's batches for environment
    arms (environment + policy server), TRL's generate-and-score for the trl arm. The seconds are the
    trainer's timing (reported)."""
    if result is None:
        return {}
    if arm.service_env is not None:
        parts = reported(result, "batches", metrics) or []
        seconds = sum(batch.get("rollout_s", 0.0) for batch in parts)
        episodes = sum(batch.get("episodes", 0) for batch in parts)
    else:
        parts = reported(result, "steps", metrics) or []
        seconds = sum(step.get("generate_s", 0.0) for step in parts)
        episodes = len(parts) * arm.plan.budget.prompts_per_step * arm.plan.budget.generations_per_prompt
    if not seconds:
        return {}
    return {"rollouts_per_s": round(episodes / seconds, 3),
            "policy_tokens_per_s": round(metrics.get("policy_tokens", 0) / seconds, 1)}
