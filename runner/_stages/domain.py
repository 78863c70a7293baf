"""A domain stack's stages (kind "domain": MACE, LeRobot): the same stage names as a language-model arm's, on
the domain contract (runner_contracts.domain). The data is made once per arm by the stack's `data` job into
<arm>/data and every stage checks it against the hashes it was frozen with; training stages audit the steps
and checkpoints; the resume stage kills a run once checkpoint k is complete; evaluate recomputes every native
metric from the per-item predictions and compares base and trained with bootstrap intervals."""

from __future__ import annotations

from pathlib import Path

from qualification.gates import checkpoint_revisions, latest_complete_checkpoint
from qualification.gates.domain import case_gates, compare_models, data_gates, metric_gates, replay_gates, step_gates
from runner_contracts import (
    DATA_MANIFEST,
    METRICS_FILE,
    PREDICTIONS_FILE,
    STEPS_FILE,
    DataSplit,
    DomainPlan,
    DomainPrediction,
    DomainStep,
    ErrorInfo,
    GateResult,
    NativeMetric,
    read_jsonl,
    sha256_file,
)

from .arm import Arm, StageOutput, read_any, run_adapter
from .probe import stage_probe
from .resume import last_complete_checkpoint
from .training import as_requeue, training_output


def _plan(arm: Arm) -> DomainPlan:
    assert isinstance(arm.plan, DomainPlan)
    return arm.plan


def data_dir(arm: Arm) -> Path:
    """The arm's data, made once for all its stages and seeds."""
    return (arm.arm_dir or arm.run_dir) / "data"


def _data(arm: Arm, stage: str) -> tuple[list[GateResult], dict[str, str], list[DataSplit]]:
    folder = data_dir(arm)
    if not (folder / DATA_MANIFEST).is_file():
        arm.on_event(stage, "making the data")
        run_adapter(arm, "data", folder)
    manifest = read_jsonl(folder / DATA_MANIFEST, DataSplit)
    gates, hashes = data_gates(stage, manifest, folder)
    return gates, hashes, manifest


def _options(arm: Arm, **more: str) -> dict[str, str]:
    return {"data_dir": str(data_dir(arm).resolve()), **more}


def stage_service(arm: Arm) -> StageOutput:
    """The data job twice (same bytes), then the stack's native scorers on its known cases."""
    gates, hashes, manifest = _data(arm, "service")
    again = arm.stage_dir("service") / "data-again"
    run_adapter(arm, "data", again)
    second = {(s.split, s.sha256) for s in read_jsonl(again / DATA_MANIFEST, DataSplit)}
    first = {(s.split, s.sha256) for s in manifest}
    gates.append(GateResult(name="service:data-reproducible", passed=first == second, measured=sorted(second),
                            threshold=sorted(first), detail="the data job run again writes byte-identical splits"))
    out = arm.stage_dir("service")
    run_adapter(arm, "service", out, options=_options(arm))
    metrics = read_jsonl(out / METRICS_FILE, NativeMetric)
    tolerance = _plan(arm).gates.metric_tolerance
    recomputed, _ = metric_gates("service", metrics, read_jsonl(out / PREDICTIONS_FILE, DomainPrediction), hashes,
                                 tolerance)
    gates += recomputed + case_gates(metrics, tolerance)
    cases: dict[str, dict] = {}
    for m in metrics:
        cases.setdefault(m.model, {})[m.name] = {"value": m.value, "expected": m.expected}
    return StageOutput(gates=gates, metrics={
        "data": {s.split: {"items": s.items, "sha256": s.sha256, "generator": s.generator, "synthetic": s.synthetic,
                           "detail": s.detail} for s in manifest},
        "cases": cases})


def _training(arm: Arm, stage: str, steps: int) -> StageOutput:
    gates, _, _ = _data(arm, stage)
    out = arm.stage_dir(stage)
    run_adapter(arm, stage, out, steps=steps, options=_options(arm))
    revisions, incomplete = checkpoint_revisions(out / "checkpoints")
    initial = out / "initial" / "model.safetensors"
    rows = read_jsonl(out / STEPS_FILE, DomainStep)
    gates += step_gates(stage, rows, steps, sha256_file(initial) if initial.is_file() else None, revisions, incomplete)
    seconds = sum(r.seconds for r in rows)
    metrics = {"loss": [r.loss for r in rows], "steps": steps, "seconds_per_step": [r.seconds for r in rows],
               "items_per_s": round(sum(r.items for r in rows) / seconds, 2) if seconds else None}
    if stage == "train" and len(rows) > 1:
        gates.append(GateResult(name="train:loss-decreased", passed=rows[-1].loss < rows[0].loss,
                                measured=round(rows[-1].loss, 6), threshold=f"< {rows[0].loss:.6g}",
                                detail="training loss at the last step against the first", reported_by="adapter"))
    if stage in arm.interrupted:
        requeue, metrics["requeue"] = _resumed_after_interruption(arm, stage, out, steps, revisions)
        gates += requeue
    return training_output(arm, stage, out, gates, metrics, revisions)


def _resumed_after_interruption(arm: Arm, stage: str, out: Path, steps: int,
                                revisions: dict[int, str]) -> tuple[list[GateResult], dict]:
    """A training stage interrupted earlier (a requeued job): its attempt's last complete checkpoint is resumed
    to the end and must replay this uninterrupted run, as in the resume stage."""
    attempt = arm.interrupted[stage]
    checkpoint, _ = last_complete_checkpoint(attempt)
    if checkpoint is None:
        return [], {"attempt": attempt.name, "resumed_from": None}
    resumed = out / "requeue-resumed"
    run_adapter(arm, stage, resumed, steps=steps, resume_from=checkpoint, options=_options(arm))
    gates = replay_gates(read_jsonl(out / STEPS_FILE, DomainStep), read_any(attempt, STEPS_FILE, DomainStep),
                         read_any(resumed, STEPS_FILE, DomainStep), int(checkpoint.name.split("-")[1]),
                         revisions.get(steps), checkpoint_revisions(resumed / "checkpoints")[0].get(steps))
    return as_requeue(gates), {"attempt": attempt.name, "resumed_from": checkpoint.name}


def stage_update(arm: Arm) -> StageOutput:
    return _training(arm, "update", _plan(arm).gates.update_steps)


def stage_train(arm: Arm) -> StageOutput:
    return _training(arm, "train", _plan(arm).budget.steps)


def stage_resume(arm: Arm) -> StageOutput:
    """SIGKILL a training run once checkpoint k is complete, resume it from there, compare with an
    uninterrupted run: same data order, same losses, same final weights."""
    spec = _plan(arm).gates
    steps, kill_step = spec.resume_steps, min(spec.resume_kill_after_step, spec.resume_steps - 1)
    gates, _, _ = _data(arm, "resume")
    base = arm.stage_dir("resume")
    plain, interrupted, resumed = base / "uninterrupted", base / "interrupted", base / "resumed"
    arm.on_event("resume", f"uninterrupted run of {steps} steps")
    run_adapter(arm, "train", plain, steps=steps, options=_options(arm))
    marker = interrupted / "checkpoints" / f"checkpoint-{kill_step}" / "COMPLETE"
    arm.on_event("resume", f"run killed with SIGKILL after step {kill_step}")
    outcome, _ = run_adapter(arm, "train", interrupted, steps=steps, options=_options(arm), kill_when=marker.is_file,
                             allow_kill=True)
    if not outcome.killed:
        return StageOutput(error=ErrorInfo(kind="not-killed", message=f"the run finished before checkpoint {kill_step} "
                                           "was complete; nothing was interrupted"))
    checkpoint, incomplete = last_complete_checkpoint(interrupted)
    if checkpoint is None:
        return StageOutput(error=ErrorInfo(kind="no-checkpoint", message="no complete checkpoint after the kill"))
    arm.on_event("resume", f"resuming from {checkpoint.name}")
    run_adapter(arm, "train", resumed, steps=steps, resume_from=checkpoint, options=_options(arm))
    gates += replay_gates(read_jsonl(plain / STEPS_FILE, DomainStep), read_any(interrupted, STEPS_FILE, DomainStep),
                          read_any(resumed, STEPS_FILE, DomainStep), int(checkpoint.name.split("-")[1]),
                          checkpoint_revisions(plain / "checkpoints")[0].get(steps),
                          checkpoint_revisions(resumed / "checkpoints")[0].get(steps))
    return StageOutput(gates=gates, metrics={"steps": steps, "killed_after_step": kill_step,
                                             "resumed_from": checkpoint.name, "ignored_incomplete_checkpoints": incomplete,
                                             "kill_to_exit_s": round(outcome.seconds, 3)})


def stage_evaluate(arm: Arm) -> StageOutput:
    """The base (the initial weights) and the trained checkpoint scored natively on the held-out split."""
    plan = _plan(arm)
    train = arm.stage_dir("train")
    trained = latest_complete_checkpoint(train / "checkpoints")
    if trained is None or not (train / "initial" / "model.safetensors").is_file():
        return StageOutput(error=ErrorInfo(kind="missing-input", message="evaluate needs the train stage's initial "
                                           "weights and final checkpoint in this run directory; run train first"))
    gates, hashes, _ = _data(arm, "evaluate")
    out = arm.stage_dir("evaluate")
    run_adapter(arm, "evaluate", out, options=_options(arm, base_checkpoint=str((train / "initial").resolve()),
                                                       trained_checkpoint=str(trained.resolve())))
    metrics = read_jsonl(out / METRICS_FILE, NativeMetric)
    recomputed, grouped = metric_gates("evaluate", metrics, read_jsonl(out / PREDICTIONS_FILE, DomainPrediction),
                                       hashes, plan.gates.metric_tolerance)
    gates += recomputed
    native = {}
    for metric in metrics:
        if metric.model != "trained":
            continue
        base_items, trained_items = grouped.get(("base", metric.split), []), grouped.get(("trained", metric.split), [])
        native[metric.name] = {"split": metric.split, **compare_models(metric.name, metric.direction, base_items,
                                                                       trained_items, metric, plan.gates.confidence,
                                                                       seed=arm.trial_seed or 0)}
    headline = native.get(plan.headline)
    gates.append(GateResult(
        name=f"evaluate:{plan.headline}", passed=headline is not None and headline["verdict"] != "regressed",
        measured=headline["verdict"] if headline else None, threshold="not regressed",
        detail=(f"base {headline['base']['value']:.4g} -> trained {headline['trained']['value']:.4g} "
                f"({headline['direction']} is better); {headline['test']}" if headline and None not in (
                    headline["base"]["value"], headline["trained"]["value"]) else
                f"the plan's headline metric {plan.headline!r} is not among the stack's metrics {sorted(native)}"
                if headline is None else "undefined on this split")))
    return StageOutput(gates=gates, metrics={"trained_checkpoint": trained.name, "headline": plan.headline,
                                             "native": native})


DOMAIN_STAGE_FUNCTIONS = {"probe": stage_probe, "service": stage_service, "update": stage_update,
                          "resume": stage_resume, "train": stage_train, "evaluate": stage_evaluate}
