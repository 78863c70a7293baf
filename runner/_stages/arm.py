"""The arm: one stack on one frozen plan, its environments, and how a stage runs one adapter job."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from runner_contracts import (
    PARTIAL_SUFFIX,
    TEACHER_FILE,
    AnyPlan,
    Checkpoint,
    DomainPlan,
    EnvironmentInfo,
    ErrorInfo,
    GateResult,
    Plan,
    Provenance,
    RecordError,
    StageRequest,
    StageResult,
    read_jsonl,
    read_record,
)

from .._engines import Engine, Service
from .._engines.jobs import RunOutcome, StackEnvironment, last_error_lines
from .._errors import UserError
from .._secrets import redact_file
from .._stacks import StackManifest, get_stack

TRAINING_JOBS = ("update", "train")  # adapter jobs that train (the resume stage runs "train" jobs)
TRIAL_STAGES = ("train", "evaluate")  # run once per plan seed


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
    plan: AnyPlan
    run_dir: Path
    on_event: Callable[[str, str], None] = lambda stage, message: None
    environment: EnvironmentInfo | None = None
    started: float = field(default_factory=time.monotonic)
    first_update_s: float | None = None
    service_env: StackEnvironment | None = None
    service: Service | None = None
    interrupted: dict[str, Path] = field(default_factory=dict)  # stage -> its set-aside interrupted attempt
    gpu_env: StackEnvironment | None = None
    provenance: Future[Provenance] | None = None  # made once per arm, written into each stage's evidence
    trial_seed: int | None = None  # the plan seed this arm's train and evaluate stages sample with
    arm_dir: Path | None = None  # a trial's arm folder, where the stages run once per arm are
    current_stage: str | None = None  # set by run_stage
    stage_deadline: float | None = None  # time.monotonic() by which the current stage's jobs must end
    stage_jobs_s: float = 0.0  # wall seconds of the current stage's adapter jobs so far

    def start_stage(self, stage: str) -> None:
        """The stage's clock: all of its jobs together get the plan's budget.wall_clock_s."""
        self.current_stage = stage
        self.stage_deadline = time.monotonic() + self.plan.budget.wall_clock_s
        self.stage_jobs_s = 0.0

    def run_job(self, env: StackEnvironment, request: StageRequest, **options: Any) -> RunOutcome:
        """engine.run, its wall seconds counted in the stage's evidence (metrics.adapter_jobs_s)."""
        outcome = self.engine.run(env, request, **options)
        self.stage_jobs_s += outcome.seconds
        return outcome

    def time_left(self) -> float:
        """Seconds the current stage's jobs have left together (the plan's wall_clock_s outside a stage)."""
        return (self.stage_deadline - time.monotonic()) if self.stage_deadline is not None else self.plan.budget.wall_clock_s

    def request_plan(self) -> AnyPlan:
        """The plan a job is given: in the train and evaluate stages, sampling (a domain plan: the model's
        initial weights and data order) with the trial's seed; the other stages qualify the machinery with
        the plan's own seed."""
        if isinstance(self.plan, DomainPlan):
            if self.current_stage not in TRIAL_STAGES or self.trial_seed in (None, self.plan.model.seed):
                return self.plan
            return msgspec.structs.replace(self.plan, model=msgspec.structs.replace(self.plan.model,
                                                                                    seed=self.trial_seed))
        if self.current_stage not in TRIAL_STAGES or self.trial_seed in (None, self.plan.sampling.seed):
            return self.plan
        return msgspec.structs.replace(self.plan, sampling=msgspec.structs.replace(self.plan.sampling,
                                                                                   seed=self.trial_seed))

    def trial(self, seed: int) -> Arm:
        """This arm's trial for another plan seed: same environments and rollout service, its own folder."""
        return dataclasses.replace(self, run_dir=trial_dir(self.run_dir, seed), trial_seed=seed, interrupted={},
                                   arm_dir=self.run_dir)

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
                                   policy_dir=str(self.policy_dir) if self.policy_dir else None)
            self.service = self.engine.start_service(self.service_env, request)
        return self.service.url

    @property
    def policy_dir(self) -> Path | None:
        """The plan's policy checkpoint; None for a domain plan (its model is the stack's own)."""
        return Path(self.plan.policy.path) if isinstance(self.plan, Plan) and self.plan.policy.path else None

    def stage_dir(self, stage: str) -> Path:
        return self.run_dir / "stages" / stage

    def close(self) -> None:
        if self.service is not None:
            self.service.stop()
            self.service = None


def trial_dir(run_dir: Path, seed: int) -> Path:
    """Where the trial of a plan seed after the first keeps its train and evaluate stages."""
    return run_dir / "seeds" / f"seed-{seed}"


def prepare_arm(manifest: StackManifest, engine: Engine, plan: AnyPlan, run_dir: Path) -> Arm:
    """Environments for one arm: the stack's own, plus its trainer's for an environment stack, plus its GPU
    environment on a GPU plan when it has one. The arm itself runs the trial of the plan's first seed."""
    gpu_env = engine.prepare(manifest.for_gpu()) if plan.budget.gpus and manifest.gpu else None
    seed = plan.seeds[0] if plan.seeds else None
    if manifest.is_environment:
        trainer = get_stack(manifest.trainer or "")
        return Arm(manifest=manifest, engine=engine, env=engine.prepare(trainer), plan=plan, run_dir=run_dir,
                   service_env=engine.prepare(manifest), gpu_env=gpu_env, trial_seed=seed)
    return Arm(manifest=manifest, engine=engine, env=engine.prepare(manifest), plan=plan, run_dir=run_dir,
               gpu_env=gpu_env, trial_seed=seed)


@dataclass
class StageOutput:
    """What a stage function returns; the evidence module turns it into evidence.json."""

    metrics: dict[str, Any] = field(default_factory=dict)
    gates: list[GateResult] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    error: ErrorInfo | None = None


def default_run_dir(stack: str, plan: AnyPlan, base: Path = Path("runs")) -> Path:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return base / f"{stamp}-{stack}-{re.sub(r'[^A-Za-z0-9_.-]', '_', plan.name)}"


def check_run_dir(target: Path, plan: AnyPlan) -> None:
    """Refuses a run directory that already holds another plan's arm."""
    if target.exists() and (target / "plan.json").is_file():
        existing = read_record(target / "plan.json", AnyPlan)
        if existing.plan_id != plan.plan_id:
            raise UserError(f"run directory {target}: holds plan {(existing.plan_id or '')[:12]}, not "
                            f"{(plan.plan_id or '')[:12]}; arms with different plans are never mixed")


class AdapterFailed(Exception):
    def __init__(self, info: ErrorInfo):
        super().__init__(info.message)
        self.info = info


def run_adapter(arm: Arm, stage: str, out_dir: Path, *, steps: int | None = None, resume_from: Path | None = None,
                options: dict[str, Any] | None = None, kill_when: Callable[[], bool] | None = None,
                allow_kill: bool = False, in_stack_env: bool = False,
                on_gpu: bool = False) -> tuple[RunOutcome, StageResult | None]:
    """Runs one adapter job. Environment-stack arms run trainer jobs (but the probe) against their rollout service;
    `in_stack_env` runs the job in the environment stack's own environment instead. Training jobs of an arm
    with a GPU environment, and jobs with `on_gpu`, run in that environment (the stack trains itself)."""
    options = dict(options or {})
    if isinstance(arm.plan, Plan) and arm.plan.recipe == "distill" and stage in ("update", "train"):  # the student learns the kept samples
        options["demonstrations"] = str(((arm.arm_dir or arm.run_dir) / "stages" / "distill" / TEACHER_FILE).resolve())
    env = arm.env
    on_gpu = on_gpu or arm.trains_on_gpu(stage)
    # Trainer jobs (but the probe) use the arm's rollout service; so does the service stage's job, which runs
    # its scripted episodes there rather than start the stack's environment a second time.
    uses_service = (not on_gpu and arm.service_env is not None and stage != "probe"
                    and (not in_stack_env or stage == "service"))
    if on_gpu:
        assert arm.gpu_env is not None
        env, in_stack_env = arm.gpu_env, True
    elif arm.service_env is not None and in_stack_env:
        env = arm.service_env
    if uses_service:
        options["rollout_service"] = arm.rollout_service_url()
    request = StageRequest(run_id=arm.run_id, stack=arm.manifest.name, stage=stage, plan=arm.request_plan(),
                           out_dir=str(out_dir.resolve()), policy_dir=str(arm.policy_dir) if arm.policy_dir else None,
                           steps=steps,
                           resume_from=str(resume_from.resolve()) if resume_from else None, options=options)
    peer = arm.service if uses_service else None
    left = arm.time_left()
    if left <= 0:
        raise AdapterFailed(ErrorInfo(kind="timeout", message=f"{arm.current_stage or stage} used up the plan's "
                                      f"wall_clock_s ({arm.plan.budget.wall_clock_s:g} s per stage) before its "
                                      f"{stage} job"))
    outcome = arm.run_job(env, request, timeout_s=left, kill_when=kill_when, peer=peer)
    for log in (outcome.stdout, outcome.stderr):
        redact_file(log)
    if not outcome.ok and uses_service:
        # A job that died mid-batch leaves the rollout service working for a dead policy server
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
        raise AdapterFailed(ErrorInfo(kind="timeout", message=f"{arm.current_stage or stage} exceeded the plan's "
                                      f"wall_clock_s ({arm.plan.budget.wall_clock_s:g} s per stage, all its jobs "
                                      f"together); process group killed"))
    if outcome.ok and result is None:
        raise AdapterFailed(ErrorInfo(kind="missing-result", message=f"the adapter exited 0 without writing "
                                      f"{out_dir / 'result.json'} (logs: {outcome.stderr})"))
    if not outcome.ok:
        message = (result.error.message if result and result.error else "") or last_error_lines(outcome.stderr)
        kind = result.error.kind if result and result.error else "adapter-exit"
        raise AdapterFailed(ErrorInfo(kind=kind, message=f"adapter exited {outcome.exit_code}: {message}"
                                      f" (logs: {outcome.stderr})"))
    return outcome, result


def read_any(folder: Path, name: str, record_type):
    """Records of a finished file, or of its .partial twin left by a killed writer (whole lines only)."""
    if (folder / name).is_file():
        return read_jsonl(folder / name, record_type)
    partial = folder / (name + PARTIAL_SUFFIX)
    return read_jsonl(partial, record_type, allow_truncated_tail=True) if partial.is_file() else []
