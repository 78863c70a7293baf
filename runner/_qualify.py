"""One qualification arm: run each stage's adapter job through the engine, audit the files on the
host, write evidence per stage, stop at the first failed gate."""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from qualification.gates import (
    TraceAudit,
    checkpoint_revisions,
    evaluate_gates,
    sft_gates,
    latest_complete_checkpoint,
    lock_gate,
    resume_gates,
    service_gates,
    update_gates,
)
from qualification.tasks import exact_overlap, get_family, ngram_overlap, split_hash
from runner_contracts import (
    PARTIAL_SUFFIX,
    Artifact,
    Checkpoint,
    Demonstration,
    EnvironmentInfo,
    ErrorInfo,
    EvalRecord,
    Evidence,
    GateResult,
    Plan,
    RecordError,
    ServiceCase,
    StageRequest,
    StageResult,
    TrainingRow,
    Trajectory,
    iter_jsonl,
    read_jsonl,
    read_record,
    sha256_file,
    write_record,
)

from ._engine import LocalEngine, RunOutcome, StackEnvironment, last_error_lines
from ._policy import vocab_size
from ._stacks import StackManifest, normalise

STAGES = ("probe", "service", "rollout", "update", "resume", "train", "evaluate")
# SFT trains on demonstrations, not sampled episodes: there is no rollout to audit.
RECIPE_STAGES = {"grpo": STAGES, "sft": tuple(s for s in STAGES if s != "rollout")}


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class Arm:
    manifest: StackManifest
    engine: LocalEngine
    env: StackEnvironment
    plan: Plan
    run_dir: Path
    on_event: Callable[[str, str], None] = lambda stage, message: None
    environment: EnvironmentInfo | None = None
    started: float = field(default_factory=time.monotonic)
    first_update_s: float | None = None

    @property
    def run_id(self) -> str:
        return self.run_dir.name

    @property
    def policy_dir(self) -> Path:
        assert self.plan.policy.path
        return Path(self.plan.policy.path)

    def stage_dir(self, stage: str) -> Path:
        return self.run_dir / "stages" / stage


@dataclass
class StageOutput:
    metrics: dict[str, Any] = field(default_factory=dict)
    gates: list[GateResult] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    error: ErrorInfo | None = None


def default_run_dir(stack: str, plan: Plan, base: Path = Path("runs")) -> Path:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return base / f"{stamp}-{stack}-{re.sub(r'[^A-Za-z0-9_.-]', '_', plan.name)}"


# --- running adapters --------------------------------------------------------------------------------


class AdapterFailed(Exception):
    def __init__(self, info: ErrorInfo):
        super().__init__(info.message)
        self.info = info


def run_adapter(arm: Arm, stage: str, out_dir: Path, *, steps: int | None = None, resume_from: Path | None = None,
                options: dict[str, Any] | None = None, kill_when: Callable[[], bool] | None = None,
                allow_kill: bool = False) -> tuple[RunOutcome, StageResult | None]:
    request = StageRequest(run_id=arm.run_id, stack=arm.manifest.name, stage=stage, plan=arm.plan,
                           out_dir=str(out_dir.resolve()), policy_dir=str(arm.policy_dir), steps=steps,
                           resume_from=str(resume_from.resolve()) if resume_from else None, options=options or {})
    outcome = arm.engine.run(arm.env, request, timeout_s=arm.plan.budget.wall_clock_s, kill_when=kill_when)
    result = None
    if (out_dir / "result.json").is_file():
        try:
            result = read_record(out_dir / "result.json", StageResult)
        except RecordError as error:
            raise AdapterFailed(ErrorInfo(kind="bad-result", message=str(error))) from None
    if outcome.killed and allow_kill:
        return outcome, result
    if outcome.timed_out:
        raise AdapterFailed(ErrorInfo(kind="timeout", message=f"{stage} exceeded the plan's wall_clock_s "
                                      f"({arm.plan.budget.wall_clock_s:g} s); process group killed"))
    if not outcome.ok:
        message = (result.error.message if result and result.error else "") or last_error_lines(outcome.stderr)
        kind = result.error.kind if result and result.error else "adapter-exit"
        raise AdapterFailed(ErrorInfo(kind=kind, message=f"adapter exited {outcome.exit_code}: {message}"
                                      f" (logs: {outcome.stderr})"))
    return outcome, result


# --- stages ------------------------------------------------------------------------------------------


def stage_probe(arm: Arm) -> StageOutput:
    _, result = run_adapter(arm, "probe", arm.stage_dir("probe"))
    assert result is not None and result.environment is not None
    reported = result.environment
    installed = {normalise(name): version for name, version in reported.packages.items()}
    arm.environment = msgspec.structs.replace(
        reported, engine=arm.engine.name, lock_sha256=arm.env.lock_sha256, packages=installed,
        upstream=reported.upstream and msgspec.structs.replace(
            reported.upstream, git_revision=arm.manifest.upstream.git_revision))
    missing_caps = sorted(set(arm.manifest.capabilities) - set(result.capabilities) - {"build-policy"})
    upstream_version = installed.get(normalise(arm.manifest.upstream.name))
    return StageOutput(
        metrics={"python": reported.python, "capabilities": result.capabilities, **result.metrics},
        gates=[
            lock_gate(installed, arm.manifest.locked_packages()),
            GateResult(name="probe:python", passed=reported.python.startswith(arm.manifest.python + "."),
                       measured=reported.python, threshold=arm.manifest.python),
            GateResult(name="probe:upstream", passed=upstream_version == arm.manifest.upstream.version,
                       measured=upstream_version, threshold=arm.manifest.upstream.version,
                       detail=f"{arm.manifest.upstream.name} as pinned in stack.toml"),
            GateResult(name="probe:capabilities", passed=not missing_caps, measured=result.capabilities,
                       threshold=list(arm.manifest.capabilities),
                       detail=f"missing: {missing_caps}" if missing_caps else "adapter reports every declared capability"),
        ],
    )


def stage_service(arm: Arm) -> StageOutput:
    out = arm.stage_dir("service")
    run_adapter(arm, "service", out)
    cases = read_jsonl(out / "service.jsonl", ServiceCase)
    splits, split_gates = split_evidence(arm.plan)
    return StageOutput(metrics={"cases": len(cases), "splits": splits}, gates=service_gates(cases) + split_gates)


def split_evidence(plan: Plan) -> tuple[dict[str, Any], list[GateResult]]:
    """Content hashes of the frozen splits, and the train/held-out overlap check."""
    items, splits = {}, {}
    for label in ("train", "heldout", "retention"):
        spec = getattr(plan.task, label)
        family = get_family(spec.family or plan.task.family)
        items[label] = family.generate(spec.split, spec.n, spec.seed)
        splits[label] = {"family": family.name, "split": spec.split, "n": spec.n, "seed": spec.seed,
                         "sha256": split_hash(items[label]), "synthetic": family.synthetic,
                         "scorer_version": family.scorer_version}
    exact = exact_overlap(items["train"], items["heldout"])
    ngram = ngram_overlap(items["train"], items["heldout"])
    splits["overlap"] = {"exact_questions": exact, "heldout_share_with_8gram_in_train": round(ngram, 4)}
    scorer = get_family(plan.task.family)
    return splits, [
        GateResult(name="tasks:heldout-disjoint", passed=exact == 0, measured=exact, threshold=0,
                   detail=f"held-out questions that appear verbatim in train; {ngram:.0%} share a word "
                          "8-gram with train (templated tasks share phrasing by design)"),
        GateResult(name="tasks:scorer-pinned",
                   passed=(plan.reward.scorer, plan.reward.version) == (scorer.name, scorer.scorer_version),
                   measured=f"{scorer.name} v{scorer.scorer_version}",
                   threshold=f"{plan.reward.scorer} v{plan.reward.version}",
                   detail="the plan's reward scorer and version are the task family's reference scorer"),
    ]


def audit_trace(arm: Arm, out: Path, *, signal: bool, revisions: dict[int, str] | None) -> tuple[list[GateResult], dict]:
    audit = TraceAudit(vocab_size=vocab_size(arm.policy_dir), group_size=arm.plan.budget.generations_per_prompt,
                       tolerance=arm.plan.gates.logprob_tolerance)
    audit.add_trajectories(record for _, record in iter_jsonl(out / "trajectories.jsonl", Trajectory))
    audit.add_rows(record for _, record in iter_jsonl(out / "training.jsonl", TrainingRow))
    gates = audit.gates()
    if signal:
        gates += audit.degeneracy_gates(arm.plan.gates.min_groups_with_variance)
    gates.append(audit.revision_gate(arm.plan.policy.sha256 or "", revisions or {}))
    metrics = {
        "episodes": audit.counts["episodes"], "policy_tokens": audit.counts["policy_tokens"],
        "trained_tokens": audit.counts["trained_tokens"], "max_logprob_gap": audit.max_logprob_gap,
        "episodes_with_tool_calls": audit.counts["episodes_with_tool_calls"],
        "groups_with_variance": sum(1 for r in audit.group_rewards.values() if len(set(r)) > 1),
        "groups": len(audit.group_rewards),
        "reward_per_step": audit.reward_per_step(),
    }
    return gates, metrics


def stage_rollout(arm: Arm) -> StageOutput:
    out = arm.stage_dir("rollout")
    run_adapter(arm, "rollout", out)
    gates, metrics = audit_trace(arm, out, signal=True, revisions={})
    return StageOutput(metrics=metrics, gates=gates)


def _training_stage(arm: Arm, stage: str, steps: int, *, signal: bool) -> StageOutput:
    out = arm.stage_dir(stage)
    _, result = run_adapter(arm, stage, out, steps=steps)
    revisions, incomplete = checkpoint_revisions(out / "checkpoints")
    if arm.plan.recipe == "sft":
        gates, metrics = sft_gates(read_jsonl(out / "demonstrations.jsonl", Demonstration),
                                   read_jsonl(out / "training.jsonl", TrainingRow), steps)
    else:
        gates, metrics = audit_trace(arm, out, signal=signal, revisions=revisions)
    losses = [float(x) for x in (result.metrics.get("loss", []) if result else [])]
    gates += update_gates(losses, steps, arm.plan.policy.sha256 or "", revisions, incomplete)
    metrics.update(loss=losses, steps=steps)
    checkpoints = [Checkpoint(step=step, path=str((out / "checkpoints" / f"checkpoint-{step}").relative_to(arm.run_dir)),
                              sha256=digest) for step, digest in sorted(revisions.items())]
    if stage == "update" and all(g.passed for g in gates):
        arm.first_update_s = time.monotonic() - arm.started
        metrics["time_to_first_reproducible_update_s"] = round(arm.first_update_s, 2)
    return StageOutput(metrics=metrics, gates=gates, checkpoints=checkpoints)


def stage_update(arm: Arm) -> StageOutput:
    return _training_stage(arm, "update", arm.plan.gates.update_steps, signal=True)


def stage_train(arm: Arm) -> StageOutput:
    return _training_stage(arm, "train", arm.plan.budget.steps, signal=False)


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
    checkpoint = latest_complete_checkpoint(interrupted / "checkpoints")
    _, incomplete = checkpoint_revisions(interrupted / "checkpoints")
    if checkpoint is None:
        return StageOutput(error=ErrorInfo(kind="no-checkpoint", message="no complete checkpoint after the kill"))
    resumed_from = int(checkpoint.name.split("-")[1])
    arm.on_event("resume", f"resuming from {checkpoint.name}")
    run_adapter(arm, "train", resumed, steps=steps, resume_from=checkpoint)
    sft = arm.plan.recipe == "sft"
    trajectories = {name: [] if sft else _read_any(folder, "trajectories.jsonl", Trajectory)
                    for name, folder in (("plain", plain), ("interrupted", interrupted), ("resumed", resumed))}
    rows = {name: _read_any(folder, "training.jsonl", TrainingRow)
            for name, folder in (("plain", plain), ("interrupted", interrupted), ("resumed", resumed))}
    plain_revisions = checkpoint_revisions(plain / "checkpoints")[0]
    final_plain = plain_revisions.get(steps)
    final_resumed = checkpoint_revisions(resumed / "checkpoints")[0].get(steps)
    gates = resume_gates(trajectories["plain"], trajectories["interrupted"], trajectories["resumed"],
                         rows["plain"], rows["interrupted"], rows["resumed"],
                         resumed_from, final_plain, final_resumed, incomplete)
    if not sft:
        trace_gates, _ = audit_trace(arm, plain, signal=False, revisions=plain_revisions)
        gates += [g for g in trace_gates if g.name == "trace:trained-equals-sampled"]
    return StageOutput(metrics={"steps": steps, "killed_after_step": kill_step, "resumed_from": checkpoint.name,
                                "interrupted_records": len(trajectories["interrupted"]) + len(rows["interrupted"]),
                                "ignored_incomplete_checkpoints": incomplete,
                                "kill_to_exit_s": round(outcome.seconds, 3)}, gates=gates)


def _read_any(folder: Path, name: str, record_type):
    """Records of a finished file, or of its .partial twin left by a killed writer (whole lines only)."""
    if (folder / name).is_file():
        return read_jsonl(folder / name, record_type)
    partial = folder / (name + PARTIAL_SUFFIX)
    return read_jsonl(partial, record_type, allow_truncated_tail=True) if partial.is_file() else []


def stage_evaluate(arm: Arm) -> StageOutput:
    trained = latest_complete_checkpoint(arm.stage_dir("train") / "checkpoints")
    if trained is None:
        return StageOutput(error=ErrorInfo(kind="missing-input", message="evaluate needs the train stage's final "
                                           "checkpoint in this run directory; run the train stage first"))
    out = arm.stage_dir("evaluate")
    _, result = run_adapter(arm, "evaluate", out, options={"trained_policy": str(trained.resolve())})
    gates, summary = evaluate_gates(read_jsonl(out / "eval.jsonl", EvalRecord), arm.plan.gates.retention_margin,
                                    arm.plan.gates.confidence)
    return StageOutput(metrics={"trained_policy": trained.name, "decoding": "greedy", **summary}, gates=gates)


STAGE_FUNCTIONS: dict[str, Callable[[Arm], StageOutput]] = {
    "probe": stage_probe, "service": stage_service, "rollout": stage_rollout, "update": stage_update,
    "resume": stage_resume, "train": stage_train, "evaluate": stage_evaluate,
}


# --- evidence ----------------------------------------------------------------------------------------


def artifacts(arm: Arm, folder: Path) -> list[Artifact]:
    found = []
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or "checkpoints" in path.parts or path.name.startswith("."):
            continue
        partial = path.name.endswith(PARTIAL_SUFFIX)
        records = None
        if path.name.endswith(".jsonl") or (partial and ".jsonl" in path.name):
            with open(path, "rb") as handle:
                records = sum(1 for line in handle if line.endswith(b"\n"))
        found.append(Artifact(path=str(path.relative_to(arm.run_dir)), sha256=sha256_file(path),
                              bytes=path.stat().st_size, records=records, partial=partial))
    return found


def run_stage(arm: Arm, stage: str) -> Evidence:
    started = now()
    folder = arm.stage_dir(stage)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        output = STAGE_FUNCTIONS[stage](arm)
    except AdapterFailed as failure:
        output = StageOutput(error=failure.info)
    except RecordError as error:
        output = StageOutput(error=ErrorInfo(kind="contract-violation", message=str(error)))
    except FileNotFoundError as error:
        output = StageOutput(error=ErrorInfo(kind="missing-output", message=f"adapter did not write {error.filename}"))
    if output.error is not None:
        status = "error"
    else:
        status = "passed" if output.gates and all(g.passed for g in output.gates) else "failed"
    evidence = Evidence(
        run_id=arm.run_id, stack=arm.manifest.name, stage=stage, plan_id=arm.plan.plan_id or "", status=status,
        started_at=started, finished_at=now(), environment=arm.environment, metrics=output.metrics,
        artifacts=artifacts(arm, folder), checkpoints=output.checkpoints, gates=output.gates, error=output.error)
    write_record(folder / "evidence.json", evidence)
    return evidence


def run_arm(arm: Arm, stages: list[str], on_stage: Callable[[str, str], None] | None = None) -> list[Evidence]:
    """Runs the stages in order; a stage that does not pass stops the arm (later stages: skipped)."""
    write_record(arm.run_dir / "plan.json", arm.plan)
    results: list[Evidence] = []
    stopped = False
    for stage in stages:
        if stopped:
            evidence = Evidence(run_id=arm.run_id, stack=arm.manifest.name, stage=stage, plan_id=arm.plan.plan_id or "",
                                status="skipped", started_at=now(), finished_at=now(),
                                error=ErrorInfo(kind="skipped", message="an earlier stage did not pass"))
            write_record(arm.stage_dir(stage) / "evidence.json", evidence)
        else:
            if on_stage:
                on_stage(stage, "start")
            if stage != "probe" and arm.environment is None:
                arm.environment = _environment_from_earlier_probe(arm)
            evidence = run_stage(arm, stage)
            stopped = evidence.status != "passed"
            if on_stage:
                on_stage(stage, evidence.status)
        results.append(evidence)
    return results


def _environment_from_earlier_probe(arm: Arm) -> EnvironmentInfo | None:
    path = arm.stage_dir("probe") / "evidence.json"
    return read_record(path, Evidence).environment if path.is_file() else None
