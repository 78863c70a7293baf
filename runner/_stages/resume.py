"""The resume stage: a training run SIGKILLed once checkpoint k is complete and resumed from it must
replay an uninterrupted run (episodes, rows, final weights)."""

from __future__ import annotations

from pathlib import Path

from qualification.gates import checkpoint_revisions, resume_gates
from runner_contracts import ErrorInfo, GateResult, TrainingRow, Trajectory

from .arm import Arm, StageOutput, read_any, run_adapter
from .audits import audit_trace


def last_complete_checkpoint(run: Path) -> tuple[Path | None, list[str]]:
    """A training run's last complete checkpoint (None if none) and its incomplete ones."""
    complete, incomplete = checkpoint_revisions(run / "checkpoints")
    return (run / "checkpoints" / f"checkpoint-{max(complete)}" if complete else None), incomplete


def replay_gates(plain: Path, interrupted: Path, resumed: Path, checkpoint: Path, steps: int,
                 final_plain: str | None, incomplete: list[str], *, sft: bool) -> tuple[list[GateResult], int]:
    """Resume gates of interrupted (up to `checkpoint`) + resumed against the uninterrupted run, and how many
    records the interrupted run left."""
    runs = (("plain", plain), ("interrupted", interrupted), ("resumed", resumed))
    trajectories = {name: [] if sft else read_any(folder, "trajectories.jsonl", Trajectory) for name, folder in runs}
    rows = {name: read_any(folder, "training.jsonl", TrainingRow) for name, folder in runs}
    final_resumed = checkpoint_revisions(resumed / "checkpoints")[0].get(steps)
    gates = resume_gates(trajectories["plain"], trajectories["interrupted"], trajectories["resumed"],
                         rows["plain"], rows["interrupted"], rows["resumed"],
                         int(checkpoint.name.split("-")[1]), final_plain, final_resumed, incomplete)
    return gates, len(trajectories["interrupted"]) + len(rows["interrupted"])



def stage_resume(arm: Arm) -> StageOutput:
    """SIGKILL the trainer once checkpoint k is complete, resume from it, compare with an uninterrupted run."""
    gates_spec = arm.plan.gates
    steps, kill_step = gates_spec.resume_steps, min(gates_spec.resume_kill_after_step, gates_spec.resume_steps - 1)
    base = arm.stage_dir("resume")
    plain, interrupted, resumed = base / "uninterrupted", base / "interrupted", base / "resumed"
    arm.on_event("resume", f"uninterrupted run of {steps} steps")
    run_adapter(arm, "train", plain, steps=steps)
    marker = interrupted / "checkpoints" / f"checkpoint-{kill_step}" / "COMPLETE"
    arm.on_event("resume", f"run killed with SIGKILL after step {kill_step}")
    outcome, _ = run_adapter(arm, "train", interrupted, steps=steps, kill_when=marker.is_file, allow_kill=True)
    if not outcome.killed:
        return StageOutput(error=ErrorInfo(kind="not-killed", message=f"the run finished before checkpoint "
                                           f"{kill_step} was complete; nothing was interrupted"))
    checkpoint, incomplete = last_complete_checkpoint(interrupted)
    if checkpoint is None:
        return StageOutput(error=ErrorInfo(kind="no-checkpoint", message="no complete checkpoint after the kill"))
    arm.on_event("resume", f"resuming from {checkpoint.name}")
    run_adapter(arm, "train", resumed, steps=steps, resume_from=checkpoint)
    sft = arm.plan.recipe in ("sft", "distill")
    plain_revisions = checkpoint_revisions(plain / "checkpoints")[0]
    gates, interrupted_records = replay_gates(plain, interrupted, resumed, checkpoint, steps,
                                              plain_revisions.get(steps), incomplete, sft=sft)
    if not sft:
        trace_gates, _ = audit_trace(arm, plain, signal=False, revisions=plain_revisions)
        gates += [g for g in trace_gates if g.name == "trace:trained-equals-sampled"]
    return StageOutput(metrics={"steps": steps, "killed_after_step": kill_step, "resumed_from": checkpoint.name,
                                "interrupted_records": interrupted_records,
                                "ignored_incomplete_checkpoints": incomplete,
                                "kill_to_exit_s": round(outcome.seconds, 3)}, gates=gates)
