"""One qualification arm: run each stage's adapter job through the engine, audit the files on the
host, write evidence per stage, stop at the first failed gate."""

from __future__ import annotations

import contextlib
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
    call_gates,
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
    PolicyCall,
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

from ._container_engine import ContainerService
from ._errors import EngineError
from ._pins import check_pins
from ._engine import RunOutcome, ServiceHandle, StackEnvironment, last_error_lines
from ._engines import Engine
from ._policy import vocab_size
from ._stacks import StackManifest, all_stacks, get_stack, normalise

STAGES = ("probe", "service", "rollout", "update", "resume", "train", "evaluate")
TRAINING_JOBS = ("update", "train")  # adapter jobs that train (the resume stage runs "train" jobs)
# SFT trains on demonstrations, not sampled episodes: there is no rollout to audit.
RECIPE_STAGES = {"grpo": STAGES, "sft": tuple(s for s in STAGES if s != "rollout")}


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class Arm:
    """One stack on one plan. For an environment stack, `env` is its trainer's environment and
    `service_env` the stack's own, which serves rollouts to the trainer while the arm runs. `gpu_env` is the
    stack's GPU environment on GPU plans (stack.toml [gpu]): its training jobs run there instead."""

    manifest: StackManifest
    engine: Engine
    env: StackEnvironment
    plan: Plan
    run_dir: Path
    on_event: Callable[[str, str], None] = lambda stage, message: None
    environment: EnvironmentInfo | None = None
    started: float = field(default_factory=time.monotonic)
    first_update_s: float | None = None
    service_env: StackEnvironment | None = None
    service: ServiceHandle | ContainerService | None = None
    interrupted: dict[str, Path] = field(default_factory=dict)  # stage -> its set-aside interrupted attempt
    gpu_env: StackEnvironment | None = None

    def trains_on_gpu(self, job: str) -> bool:
        """Whether an adapter job of this stage name runs in the stack's GPU environment."""
        return self.gpu_env is not None and job in TRAINING_JOBS

    @property
    def run_id(self) -> str:
        return self.run_dir.name

    def rollout_service_url(self) -> str:
        """The environment stack's rollout service, started on first use and kept for the arm."""
        assert self.service_env is not None
        if self.service is None or not self.service.alive():
            request = StageRequest(run_id=self.run_id, stack=self.manifest.name, stage="serve", plan=self.plan,
                                   out_dir=str((self.run_dir / "service").resolve()),
                                   policy_dir=str(self.policy_dir))
            self.service = self.engine.start_service(self.service_env, request)
        return self.service.url

    @property
    def policy_dir(self) -> Path:
        assert self.plan.policy.path
        return Path(self.plan.policy.path)

    def stage_dir(self, stage: str) -> Path:
        return self.run_dir / "stages" / stage

    def close(self) -> None:
        if self.service is not None:
            self.service.stop()
            self.service = None


def prepare_arm(manifest: StackManifest, engine: Engine, plan: Plan, run_dir: Path) -> Arm:
    """Environments for one arm: the stack's own, plus its trainer's for an environment stack, plus its GPU
    environment on a GPU plan when it has one."""
    gpu_env = engine.prepare(manifest.for_gpu()) if plan.budget.gpus and manifest.gpu else None
    if manifest.is_environment:
        trainer = get_stack(manifest.trainer or "")
        return Arm(manifest=manifest, engine=engine, env=engine.prepare(trainer), plan=plan, run_dir=run_dir,
                   service_env=engine.prepare(manifest), gpu_env=gpu_env)
    return Arm(manifest=manifest, engine=engine, env=engine.prepare(manifest), plan=plan, run_dir=run_dir,
               gpu_env=gpu_env)


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
                allow_kill: bool = False, in_stack_env: bool = False,
                on_gpu: bool = False) -> tuple[RunOutcome, StageResult | None]:
    """Runs one adapter job. Environment-stack arms run trainer jobs against their rollout service;
    `in_stack_env` runs the job in the environment stack's own environment instead. Training jobs of an arm
    with a GPU environment, and jobs with `on_gpu`, run in that environment (the stack trains itself)."""
    options = dict(options or {})
    env = arm.env
    on_gpu = on_gpu or arm.trains_on_gpu(stage)
    if on_gpu:
        assert arm.gpu_env is not None
        env, in_stack_env = arm.gpu_env, True
    elif arm.service_env is not None:
        if in_stack_env:
            env = arm.service_env
        else:
            options["rollout_service"] = arm.rollout_service_url()
    request = StageRequest(run_id=arm.run_id, stack=arm.manifest.name, stage=stage, plan=arm.plan,
                           out_dir=str(out_dir.resolve()), policy_dir=str(arm.policy_dir), steps=steps,
                           resume_from=str(resume_from.resolve()) if resume_from else None, options=options)
    peer = arm.service if arm.service_env is not None and not in_stack_env else None
    outcome = arm.engine.run(env, request, timeout_s=arm.plan.budget.wall_clock_s, kill_when=kill_when, peer=peer)
    if not outcome.ok and not in_stack_env:
        # A trainer that died mid-batch leaves the rollout service working for a dead policy server
        # (some upstreams retry a refused connection forever): the next job gets a fresh service.
        arm.close()
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


def _probe(arm: Arm, manifest: StackManifest, env: StackEnvironment, out: Path, *, in_stack_env: bool,
           prefix: str = "probe", on_gpu: bool = False) -> tuple[EnvironmentInfo, StageResult, list[GateResult]]:
    _, result = run_adapter(arm, "probe", out, in_stack_env=in_stack_env, on_gpu=on_gpu)
    assert result is not None and result.environment is not None
    reported = result.environment
    installed = {normalise(name): version for name, version in reported.packages.items()}
    environment = msgspec.structs.replace(
        reported, engine=arm.engine.name, image=env.image, image_digest=env.image_digest,
        lock_sha256=env.lock_sha256, packages=installed,
        deviations=list(manifest.deviations),
        upstream=reported.upstream and msgspec.structs.replace(
            reported.upstream, git_revision=manifest.upstream.git_revision))
    missing_caps = sorted(set(manifest.capabilities) - set(result.capabilities) - {"build-policy"})
    upstream_version = installed.get(normalise(manifest.upstream.name))
    foreign = {normalise(m.upstream.name) for m in all_stacks().values()
               if m.name != manifest.name and not normalise(m.upstream.name).startswith("runner-")}
    if manifest.is_environment and "torch" not in manifest.locked_packages():
        foreign.add("torch")  # an environment stack that does not pin torch must not have one
    leaked = sorted(name for name in installed if name in foreign)
    gates = [
        msgspec.structs.replace(lock_gate(installed, manifest.locked_packages()), name=f"{prefix}:lock-match"),
        GateResult(name=f"{prefix}:python", passed=reported.python.startswith(manifest.python + "."),
                   measured=reported.python, threshold=manifest.python),
        GateResult(name=f"{prefix}:upstream", passed=upstream_version == manifest.upstream.version,
                   measured=upstream_version, threshold=manifest.upstream.version,
                   detail=f"{manifest.upstream.name} as pinned in stack.toml"),
        GateResult(name=f"{prefix}:capabilities", passed=not missing_caps, measured=result.capabilities,
                   threshold=list(manifest.capabilities),
                   detail=f"missing: {missing_caps}" if missing_caps else "adapter reports every declared capability"),
        _pins_gate(manifest, env, prefix),
        GateResult(name=f"{prefix}:no-foreign-packages", passed=not leaked, measured=leaked, threshold=[],
                   detail=(f"found {', '.join(leaked)}" if leaked else
                           f"no other stack's upstream{' and no torch' if manifest.is_environment else ''} installed")),
    ]
    return environment, result, gates


def _pins_gate(manifest: StackManifest, env: StackEnvironment, prefix: str) -> GateResult:
    """The environment was built from the stack's current lock, and the pin record agrees with it."""
    drift = check_pins(manifest)
    if env.lock_sha256 != manifest.lock_sha256:
        drift.insert(0, f"{env.image or env.path} was built from lock {env.lock_sha256[:12]}, the stack's lock is "
                        f"{manifest.lock_sha256[:12]}")
    return GateResult(name=f"{prefix}:pins", passed=not drift, measured=len(drift), threshold=0,
                      detail="; ".join(drift) if drift else
                      f"built from the pinned lock {manifest.lock_sha256[:12]}"
                      + (f"; image {env.image} ({env.image_digest})" if env.image else ""))


def stage_probe(arm: Arm) -> StageOutput:
    out = arm.stage_dir("probe")
    if arm.service_env is None:
        arm.environment, result, gates = _probe(arm, arm.manifest, arm.env, out, in_stack_env=False)
        output = StageOutput(metrics={"python": arm.environment.python, "capabilities": result.capabilities,
                                      **result.metrics}, gates=gates)
    else:
        arm.environment, result, gates = _probe(arm, arm.manifest, arm.service_env, out, in_stack_env=True)
        trainer_env, trainer_result, trainer_gates = _probe(arm, arm.env.manifest, arm.env, out / "trainer",
                                                            in_stack_env=False, prefix="trainer")
        output = StageOutput(gates=gates + trainer_gates, metrics={
            "python": arm.environment.python, "capabilities": result.capabilities, **result.metrics,
            "trainer": _probed(arm.env.manifest.name, trainer_env, trainer_result)})
    if arm.gpu_env is not None:
        gpu_env, gpu_result, gpu_gates = _probe(arm, arm.gpu_env.manifest, arm.gpu_env, out / "gpu",
                                                in_stack_env=True, prefix="gpu", on_gpu=True)
        output.gates += gpu_gates
        output.metrics["gpu_environment"] = _probed(arm.manifest.name, gpu_env, gpu_result)
    return output


def _probed(stack: str, environment: EnvironmentInfo, result: StageResult) -> dict[str, Any]:
    return {"stack": stack, "python": environment.python, "upstream": msgspec.to_builtins(environment.upstream),
            "lock_sha256": environment.lock_sha256, **result.metrics}


def stage_service(arm: Arm) -> StageOutput:
    out = arm.stage_dir("service")
    _, result = run_adapter(arm, "service", out, in_stack_env=arm.service_env is not None)
    cases = read_jsonl(out / "service.jsonl", ServiceCase)
    splits, split_gates = split_evidence(arm.plan)
    gates = service_gates(cases) + split_gates
    metrics: dict[str, Any] = {"cases": len(cases), "splits": splits}
    if arm.service_env is not None and result is not None:
        failed, unattributed = result.metrics.get("failed_episodes", []), result.metrics.get("unattributed_calls", 0)
        gates.append(GateResult(
            name="service:scripted-episodes", passed=not failed and unattributed == 0,
            measured=len(failed) + unattributed, threshold=0,
            detail=("; ".join(failed[:3]) or f"{unattributed} unattributed policy calls") if failed or unattributed
            else f"{len(cases)} scripted episodes ran natively, every policy call attributed "
                 f"({result.metrics.get('episode_id_channel')})"))
        metrics.update({k: result.metrics.get(k) for k in ("policy_calls", "channels", "episode_id_channel", "seconds")})
    return StageOutput(metrics=metrics, gates=gates)


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


def _environment_arm_audit(arm: Arm, out: Path, result: StageResult | None) -> tuple[list[GateResult], dict]:
    """Policy-server calls against the trajectories, and the bridge's batch figures."""
    if arm.service_env is None:
        return [], {}
    trajectories = _read_any(out, "trajectories.jsonl", Trajectory)
    gates, metrics = call_gates(_read_any(out, "calls.jsonl", PolicyCall), trajectories)
    batches = (result.metrics.get("batches") if result else None) or []
    for key in ("continuity_breaks", "untrained_calls", "failed_episodes", "retried_episodes",
                "environment_restarts", "faults_injected", "episodes_without_calls", "rows_from_stack_capture",
                "stack_capture_mismatches"):
        metrics[key] = sum(batch.get(key, 0) for batch in batches)
    if metrics["rows_from_stack_capture"]:
        gates.append(GateResult(
            name="calls:stack-capture-equals-server", passed=metrics["stack_capture_mismatches"] == 0,
            measured=metrics["stack_capture_mismatches"], threshold=0,
            detail=f"{metrics['rows_from_stack_capture']} episodes trained from the stack's own token capture; "
                   "each capture's prompt and sampled ids equal the policy server's log"))
    return gates, metrics


def _gpu_training_audit(arm: Arm, out: Path, result: StageResult | None) -> tuple[list[GateResult], dict]:
    """verl's job: its vLLM servers keep no call log, so the gateway's capture (the trajectories) is the record
    of what was sampled; every rollout the store worker ran must be there, a failed one marked."""
    rollouts = (result.metrics.get("rollouts") if result else None) or {}
    trajectories = _read_any(out, "trajectories.jsonl", Trajectory)
    failed = sum(1 for t in trajectories if t.outcome == "error")
    claimed = rollouts.get("claimed", 0)
    accounted = (len(trajectories) == claimed == rollouts.get("succeeded", 0) + rollouts.get("failed", 0)
                 and failed == rollouts.get("failed", 0) and not rollouts.get("worker_error"))
    gate = GateResult(
        name="calls:store-rollouts-accounted", passed=accounted, measured=len(trajectories), threshold=claimed,
        detail=f"{claimed} rollouts run by the store worker ({rollouts.get('failed', 0)} failed: "
               f"{'; '.join(rollouts.get('failures', [])[:2]) or 'none'}); {len(trajectories)} trajectories from the "
               f"trainer's completed rollouts, {failed} marked error"
               + (f"; worker stopped: {rollouts['worker_error']}" if rollouts.get("worker_error") else ""))
    return [gate], {"failed_episodes": failed, "rollouts": rollouts}


def _throughput(arm: Arm, result: StageResult | None, metrics: dict[str, Any]) -> dict[str, float]:
    """Episodes and policy tokens per second of generation: the rollout service's batches for environment
    arms (environment + policy server), TRL's generate-and-score for the trl arm."""
    if result is None:
        return {}
    if arm.service_env is not None:
        parts = result.metrics.get("batches") or []
        seconds = sum(batch.get("rollout_s", 0.0) for batch in parts)
        episodes = sum(batch.get("episodes", 0) for batch in parts)
    else:
        parts = result.metrics.get("steps") or []
        seconds = sum(step.get("generate_s", 0.0) for step in parts)
        episodes = len(parts) * arm.plan.budget.prompts_per_step * arm.plan.budget.generations_per_prompt
    if not seconds:
        return {}
    return {"rollouts_per_s": round(episodes / seconds, 3),
            "policy_tokens_per_s": round(metrics.get("policy_tokens", 0) / seconds, 1)}


def stage_rollout(arm: Arm) -> StageOutput:
    out = arm.stage_dir("rollout")
    _, result = run_adapter(arm, "rollout", out)
    gates, metrics = audit_trace(arm, out, signal=True, revisions={})
    call_checks, call_metrics = _environment_arm_audit(arm, out, result)
    gates += call_checks
    metrics.update(call_metrics)
    metrics.update(_throughput(arm, result, metrics))
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
    trajectories = _read_any(out, "trajectories.jsonl", Trajectory)
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


def _training_stage(arm: Arm, stage: str, steps: int, *, signal: bool) -> StageOutput:
    out = arm.stage_dir(stage)
    _, result = run_adapter(arm, stage, out, steps=steps)
    revisions, incomplete = checkpoint_revisions(out / "checkpoints")
    if arm.plan.recipe == "sft":
        gates, metrics = sft_gates(read_jsonl(out / "demonstrations.jsonl", Demonstration),
                                   read_jsonl(out / "training.jsonl", TrainingRow), steps)
    else:
        gates, metrics = audit_trace(arm, out, signal=signal, revisions=revisions)
        audit = _gpu_training_audit if arm.trains_on_gpu(stage) else _environment_arm_audit
        call_checks, call_metrics = audit(arm, out, result)
        gates += call_checks
        metrics.update(call_metrics)
        metrics.update(_throughput(arm, result, metrics))
    metrics["trainer"] = ("verl" if arm.trains_on_gpu(stage) else
                          f"{arm.env.manifest.name}-{'gpu' if arm.plan.budget.gpus else 'cpu'}")
    losses = [float(x) for x in (result.metrics.get("loss", []) if result else []) if x is not None]
    gates += update_gates(losses, steps, arm.plan.policy.sha256 or "", revisions, incomplete)
    metrics.update(loss=losses, steps=steps)
    checkpoints = [Checkpoint(step=step, path=str((out / "checkpoints" / f"checkpoint-{step}").relative_to(arm.run_dir)),
                              sha256=digest) for step, digest in sorted(revisions.items())]
    if stage in arm.interrupted:
        requeue_gates, metrics["requeue"] = _resumed_after_interruption(arm, stage, out, steps, revisions)
        gates += requeue_gates
    if stage == "update" and all(g.passed for g in gates):
        arm.first_update_s = time.monotonic() - arm.started
        metrics["time_to_first_reproducible_update_s"] = round(arm.first_update_s, 2)
    return StageOutput(metrics=metrics, gates=gates, checkpoints=checkpoints)


def _resumed_after_interruption(arm: Arm, stage: str, out: Path, steps: int,
                                revisions: dict[int, str]) -> tuple[list[GateResult], dict]:
    """A training stage that was interrupted (a requeued job, a killed runner) and ran again: its last
    complete checkpoint is resumed to the end, and the boundary is audited exactly like the resume stage's
    SIGKILL: interrupted + resumed must replay this uninterrupted run (episodes, rows, final weights).
    `revisions` are this run's complete checkpoints."""
    attempt = arm.interrupted[stage]
    checkpoint, incomplete = _last_complete_checkpoint(attempt)
    if checkpoint is None:
        return [], {"attempt": attempt.name, "resumed_from": None,
                    "detail": "the interrupted attempt left no complete checkpoint; the stage ran from the start"}
    resumed = out / "requeue-resumed"
    arm.on_event(stage, f"resuming the interrupted attempt from {checkpoint.name}")
    run_adapter(arm, stage, resumed, steps=steps, resume_from=checkpoint)
    gates, _ = _replay_gates(out, attempt, resumed, checkpoint, steps, revisions.get(steps), incomplete,
                             sft=arm.plan.recipe == "sft")
    gates = [msgspec.structs.replace(g, name=g.name.replace("resume:", "requeue:", 1)) for g in gates]
    return gates, {"attempt": attempt.name, "resumed_from": checkpoint.name}


def _last_complete_checkpoint(run: Path) -> tuple[Path | None, list[str]]:
    """A training run's last complete checkpoint (None if none) and its incomplete ones."""
    complete, incomplete = checkpoint_revisions(run / "checkpoints")
    return (run / "checkpoints" / f"checkpoint-{max(complete)}" if complete else None), incomplete


def _replay_gates(plain: Path, interrupted: Path, resumed: Path, checkpoint: Path, steps: int,
                  final_plain: str | None, incomplete: list[str], *, sft: bool) -> tuple[list[GateResult], int]:
    """Resume gates of interrupted (up to `checkpoint`) + resumed against the uninterrupted run, and how many
    records the interrupted run left."""
    runs = (("plain", plain), ("interrupted", interrupted), ("resumed", resumed))
    trajectories = {name: [] if sft else _read_any(folder, "trajectories.jsonl", Trajectory) for name, folder in runs}
    rows = {name: _read_any(folder, "training.jsonl", TrainingRow) for name, folder in runs}
    final_resumed = checkpoint_revisions(resumed / "checkpoints")[0].get(steps)
    gates = resume_gates(trajectories["plain"], trajectories["interrupted"], trajectories["resumed"],
                         rows["plain"], rows["interrupted"], rows["resumed"],
                         int(checkpoint.name.split("-")[1]), final_plain, final_resumed, incomplete)
    return gates, len(trajectories["interrupted"]) + len(rows["interrupted"])


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
    checkpoint, incomplete = _last_complete_checkpoint(interrupted)
    if checkpoint is None:
        return StageOutput(error=ErrorInfo(kind="no-checkpoint", message="no complete checkpoint after the kill"))
    arm.on_event("resume", f"resuming from {checkpoint.name}")
    run_adapter(arm, "train", resumed, steps=steps, resume_from=checkpoint)
    sft = arm.plan.recipe == "sft"
    plain_revisions = checkpoint_revisions(plain / "checkpoints")[0]
    gates, interrupted_records = _replay_gates(plain, interrupted, resumed, checkpoint, steps,
                                               plain_revisions.get(steps), incomplete, sft=sft)
    if not sft:
        trace_gates, _ = audit_trace(arm, plain, signal=False, revisions=plain_revisions)
        gates += [g for g in trace_gates if g.name == "trace:trained-equals-sampled"]
    return StageOutput(metrics={"steps": steps, "killed_after_step": kill_step, "resumed_from": checkpoint.name,
                                "interrupted_records": interrupted_records,
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
    except EngineError as error:
        output = StageOutput(error=ErrorInfo(kind="engine", message=str(error)))
    except FileNotFoundError as error:
        output = StageOutput(error=ErrorInfo(kind="missing-output", message=f"adapter did not write {error.filename}"))
    except BaseException:
        # SIGTERM (a Slurm signal before the time limit, a preemption), Ctrl-C: the stage's files stay,
        # marked as interrupted; `runner qualify --resume` sets them aside and runs the stage again.
        _mark_interrupted(arm, stage, folder, "the runner was stopped during this stage", started=started,
                          environment=arm.environment)
        raise
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


def run_arm(arm: Arm, stages: list[str], on_stage: Callable[[str, str], None] | None = None, *,
            resume: bool = False) -> list[Evidence]:
    """Runs the stages in order; a stage that does not pass stops the arm (later stages: skipped).
    With `resume`, stages that already passed in this run directory are kept, and a stage left behind
    by an interrupted run is set aside (marked) and run again."""
    write_record(arm.run_dir / "plan.json", arm.plan)
    try:
        return _run_stages(arm, stages, on_stage, resume)
    finally:
        arm.close()


def _earlier_evidence(arm: Arm, stage: str) -> Evidence | None:
    """The stage's evidence already in the run directory (None if missing or unreadable)."""
    with contextlib.suppress(RecordError, FileNotFoundError):
        return read_record(arm.stage_dir(stage) / "evidence.json", Evidence)
    return None


def _set_aside(arm: Arm, stage: str) -> Path:
    """Moves an interrupted stage's folder to <stage>.attempt-<n> and marks it: nothing it wrote is lost."""
    folder = arm.stage_dir(stage)
    number = 1 + sum(1 for _ in folder.parent.glob(f"{stage}.attempt-*"))
    target = folder.with_name(f"{stage}.attempt-{number}")
    folder.rename(target)
    if not (target / "evidence.json").is_file():
        _mark_interrupted(arm, stage, target, f"the run stopped during this stage; set aside by a resumed run as "
                                              f"{target.name}")
    return target


def _mark_interrupted(arm: Arm, stage: str, folder: Path, message: str, *, started: str | None = None,
                      environment: EnvironmentInfo | None = None) -> None:
    """Evidence for a stage the run stopped in: status error, kind interrupted, the files it left."""
    write_record(folder / "evidence.json", Evidence(
        run_id=arm.run_id, stack=arm.manifest.name, stage=stage, plan_id=arm.plan.plan_id or "", status="error",
        started_at=started or now(), finished_at=now(), environment=environment, artifacts=artifacts(arm, folder),
        error=ErrorInfo(kind="interrupted", message=message)))


def _run_stages(arm: Arm, stages: list[str], on_stage: Callable[[str, str], None] | None,
                resume: bool) -> list[Evidence]:
    results: list[Evidence] = []
    stopped = False
    for stage in stages:
        if resume and not stopped:
            earlier = _earlier_evidence(arm, stage)
            if earlier is not None and earlier.status == "passed" and earlier.plan_id == arm.plan.plan_id:
                if stage == "probe":
                    arm.environment = earlier.environment  # later stages record it; no second read
                results.append(earlier)
                if on_stage:
                    on_stage(stage, "passed")
                continue
            if arm.stage_dir(stage).exists() and (earlier is None or earlier.status != "skipped"):
                arm.interrupted[stage] = _set_aside(arm, stage)
        if stopped:
            evidence = Evidence(run_id=arm.run_id, stack=arm.manifest.name, stage=stage, plan_id=arm.plan.plan_id or "",
                                status="skipped", started_at=now(), finished_at=now(),
                                error=ErrorInfo(kind="skipped", message="an earlier stage did not pass"))
            write_record(arm.stage_dir(stage) / "evidence.json", evidence)
        else:
            if on_stage:
                on_stage(stage, "start")
            if stage != "probe" and arm.environment is None:
                probe = _earlier_evidence(arm, "probe")
                arm.environment = probe.environment if probe else None
            evidence = run_stage(arm, stage)
            stopped = evidence.status != "passed"
            if on_stage:
                on_stage(stage, evidence.status)
        results.append(evidence)
    return results
