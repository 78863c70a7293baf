"""The update and train stages: a training job of N steps, its trace audited, its checkpoints hashed; a
stage interrupted earlier (a requeued job, a killed runner) resumes from its last complete checkpoint and
its boundary is audited like the resume stage's."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec

from qualification.gates import checkpoint_revisions, sft_gates, update_gates
from runner_contracts import Checkpoint, Demonstration, GateResult, TrainingRow, read_jsonl

from .arm import Arm, StageOutput, run_adapter
from .audits import audit_trace, reported, sampling_audit, throughput
from .resume import last_complete_checkpoint, replay_gates


def _training_stage(arm: Arm, stage: str, steps: int, *, signal: bool) -> StageOutput:
    out = arm.stage_dir(stage)
    baseline = arm.plan.recipe == "distill" and stage == "train"  # and the matched SFT baseline beside it
    _, result = run_adapter(arm, stage, out, steps=steps, options={"matched_baseline": True} if baseline else None)
    revisions, incomplete = checkpoint_revisions(out / "checkpoints")
    if arm.plan.recipe in ("sft", "distill"):
        gates, metrics = sft_gates(read_jsonl(out / "demonstrations.jsonl", Demonstration),
                                   read_jsonl(out / "training.jsonl", TrainingRow), steps)
        if baseline:  # audited the same way
            baseline_gates, metrics["baseline"] = sft_gates(
                read_jsonl(out / "baseline" / "demonstrations.jsonl", Demonstration),
                read_jsonl(out / "baseline" / "training.jsonl", TrainingRow), steps)
            gates += [msgspec.structs.replace(g, name="baseline-" + g.name) for g in baseline_gates]
    else:
        gates, metrics = audit_trace(arm, out, signal=signal, revisions=revisions)
        call_checks, call_metrics = sampling_audit(arm, stage, out, result)
        gates += call_checks
        metrics.update(call_metrics)
        metrics.update(throughput(arm, result, metrics))
    metrics["trainer"] = ((reported(result, "trainer", metrics) if arm.trains_on_gpu(stage) else None)
                          or f"{arm.env.manifest.name}-{'gpu' if arm.plan.budget.gpus else 'cpu'}")
    losses = [float(x) for x in (reported(result, "loss", metrics) or []) if x is not None]
    gates += update_gates(losses, steps, arm.plan.policy.sha256 or "", revisions, incomplete)
    metrics.update(loss=losses, steps=steps)
    if stage in arm.interrupted:
        requeue_gates, metrics["requeue"] = _resumed_after_interruption(arm, stage, out, steps, revisions)
        gates += requeue_gates
    return training_output(arm, stage, out, gates, metrics, revisions)


def training_output(arm: Arm, stage: str, out: Path, gates: list[GateResult], metrics: dict,
                    revisions: dict[int, str]) -> StageOutput:
    """A training stage's output: its complete checkpoints, and for an update whose gates all passed, the time
    to the arm's first reproducible update."""
    if stage == "update" and all(g.passed for g in gates):
        arm.first_update_s = time.monotonic() - arm.started
        metrics["time_to_first_reproducible_update_s"] = round(arm.first_update_s, 2)
    checkpoints = [Checkpoint(step=step, path=str((out / "checkpoints" / f"checkpoint-{step}").relative_to(arm.run_dir)),
                              sha256=digest) for step, digest in sorted(revisions.items())]
    return StageOutput(metrics=metrics, gates=gates, checkpoints=checkpoints)


def as_requeue(gates: list[GateResult]) -> list[GateResult]:
    """Resume gates renamed for a requeued stage's boundary (resume:x -> requeue:x)."""
    return [msgspec.structs.replace(g, name=g.name.replace("resume:", "requeue:", 1)) for g in gates]


def _resumed_after_interruption(arm: Arm, stage: str, out: Path, steps: int,
                                revisions: dict[int, str]) -> tuple[list[GateResult], dict]:
    """A training stage that was interrupted (a requeued job, a killed runner) and ran again: its last
    complete checkpoint is resumed to the end, and the boundary is audited exactly like the resume stage's
    SIGKILL: interrupted + resumed must replay this uninterrupted run (episodes, rows, final weights).
    `revisions` are this run's complete checkpoints."""
    attempt = arm.interrupted[stage]
    checkpoint, incomplete = last_complete_checkpoint(attempt)
    if checkpoint is None:
        return [], {"attempt": attempt.name, "resumed_from": None,
                    "detail": "the interrupted attempt left no complete checkpoint; the stage ran from the start"}
    resumed = out / "requeue-resumed"
    arm.on_event(stage, f"resuming the interrupted attempt from {checkpoint.name}")
    run_adapter(arm, stage, resumed, steps=steps, resume_from=checkpoint)
    gates, _ = replay_gates(out, attempt, resumed, checkpoint, steps, revisions.get(steps), incomplete,
                            sft=arm.plan.recipe in ("sft", "distill"))
    return as_requeue(gates), {"attempt": attempt.name, "resumed_from": checkpoint.name}


def stage_update(arm: Arm) -> StageOutput:
    return _training_stage(arm, "update", arm.plan.gates.update_steps, signal=True)


def stage_train(arm: Arm) -> StageOutput:
    return _training_stage(arm, "train", arm.plan.budget.steps, signal=False)
