"""The rollout stage: one batch of episodes, audited like a training batch; for an environment arm a
second batch in which the environment server is SIGKILLed halfway through (recovery)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runner_contracts import GateResult, Trajectory

from .arm import Arm, StageOutput, read_any, run_adapter
from .audits import audit_trace, sampling_audit, throughput


def stage_rollout(arm: Arm) -> StageOutput:
    out = arm.stage_dir("rollout")
    _, result = run_adapter(arm, "rollout", out)
    gates, metrics = audit_trace(arm, out, signal=True, revisions={})
    call_checks, call_metrics = sampling_audit(arm, "rollout", out, result)
    gates += call_checks
    metrics.update(call_metrics)
    metrics.update(throughput(arm, result, metrics))
    if arm.service_env is not None:
        recovery_gates, metrics["recovery"] = _injected_crash(arm, out / "injected-crash")
        gates += recovery_gates
    else:
        metrics["recovery"] = {"applicable": False, "detail": "environment runs in the trainer's process"}
    return StageOutput(metrics=metrics, gates=gates)


def _injected_crash(arm: Arm, out: Path) -> tuple[list[GateResult], dict[str, Any]]:
    """A second rollout batch in which the environment server is SIGKILLed halfway through: every episode
    must come back, retried after a restart or marked failed; none may be lost."""
    requested = arm.plan.budget.prompts_per_step * arm.plan.budget.generations_per_prompt
    arm.on_event("rollout", "injected environment crash")
    _, result = run_adapter(arm, "rollout", out, options={"fault": {"kill_environment_after_started": requested // 2}})
    trajectories = read_any(out, "trajectories.jsonl", Trajectory)
    batches = (result.metrics.get("batches") if result else None) or []
    figures = {key: sum(batch.get(key, 0) for batch in batches)
               for key in ("faults_injected", "environment_restarts", "retried_episodes", "failed_episodes")}
    returned = {t.episode_id for t in trajectories}
    figures.update(requested=requested, returned=len(returned), lost=requested - len(returned))
    gates = [
        GateResult(name="recovery:fault-injected", passed=figures["faults_injected"] == 1,
                   measured=figures["faults_injected"], threshold=1,
                   detail=f"environment server killed after {requested // 2} of {requested} episodes started; "
                          f"{figures['environment_restarts']} restart(s)"),
        GateResult(name="recovery:no-episode-lost", passed=figures["lost"] == 0, measured=figures["lost"], threshold=0,
                   detail=f"{figures['retried_episodes']} retried, {figures['failed_episodes']} marked failed, "
                          f"{figures['lost']} lost of {requested}"),
    ]
    return gates, figures
