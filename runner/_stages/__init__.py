"""One qualification arm, stage by stage: each stage (a module here) runs its adapter jobs through the
arm's engine and audits the files on the host; the evidence module writes what each stage found. The
first stage that does not pass stops the arm."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable

from runner_contracts import ErrorInfo, Evidence, RecordError, write_record

from .._errors import DiskFull, EngineError, is_disk_full
from .._provenance import provenance_in_background
from .arm import TRIAL_STAGES, AdapterFailed, Arm, StageOutput, default_run_dir, now, prepare_arm, trial_dir
from .evidence import (
    DISK_FULL_MARK,
    earlier_evidence,
    mark_interrupted,
    set_aside,
    write_skipped,
    write_stage_evidence,
)

# Stage -> "module:function" in this package, imported when the stage runs (lm-evaluation-harness's lazy
# registration): a `--stages probe` imports the probe's module, not the audits of the others.
STAGE_FUNCTIONS = {
    "probe": "probe:stage_probe", "service": "service:stage_service", "rollout": "rollout:stage_rollout",
    "distill": "distill:stage_distill", "update": "training:stage_update", "resume": "resume:stage_resume",
    "train": "training:stage_train", "evaluate": "evaluate:stage_evaluate",
}
STAGES = tuple(STAGE_FUNCTIONS)
# SFT trains on demonstrations, not sampled episodes: there is no rollout to audit; distillation's come from
# the teacher's samples (the distill stage).
RECIPE_STAGES = {"grpo": tuple(s for s in STAGES if s != "distill"),
                 "sft": tuple(s for s in STAGES if s not in ("rollout", "distill")),
                 "distill": tuple(s for s in STAGES if s != "rollout")}

__all__ = ["RECIPE_STAGES", "STAGES", "TRIAL_STAGES", "Arm", "default_run_dir", "prepare_arm", "run_arm", "run_stage",
           "trial_dir"]


def stage_function(stage: str, *, domain: bool) -> Callable[[Arm], StageOutput]:
    """The function that runs `stage` for a language-model arm, or for a domain arm (stages/domain.py)."""
    if domain:
        return importlib.import_module(".domain", __name__).DOMAIN_STAGE_FUNCTIONS[stage]
    module, _, function = STAGE_FUNCTIONS[stage].partition(":")
    return getattr(importlib.import_module(f".{module}", __name__), function)


def run_stage(arm: Arm, stage: str) -> Evidence:
    started = now()
    arm.start_stage(stage)
    arm.stage_dir(stage).mkdir(parents=True, exist_ok=True)
    try:
        output = stage_function(stage, domain=arm.manifest.kind == "domain")(arm)
    except AdapterFailed as failure:
        output = StageOutput(error=failure.info)
    except RecordError as error:
        output = StageOutput(error=ErrorInfo(kind="contract-violation", message=str(error)))
    except EngineError as error:
        output = StageOutput(error=ErrorInfo(kind="engine", message=str(error)))
    except FileNotFoundError as error:
        output = StageOutput(error=ErrorInfo(kind="missing-output", message=f"adapter did not write {error.filename}"))
    except OSError as error:
        if not is_disk_full(error):
            raise
        output = StageOutput(error=ErrorInfo(kind="disk-full", message=f"{error.filename}: {error.strerror}"))
    except BaseException:
        # SIGTERM (a Slurm signal before the time limit, a preemption), Ctrl-C: the stage's files stay,
        # marked as interrupted; `runner qualify --resume` sets them aside and runs the stage again.
        mark_interrupted(arm, stage, arm.stage_dir(stage), "the runner was stopped during this stage",
                         started=started, environment=arm.environment)
        raise
    try:
        return write_stage_evidence(arm, stage, output, started)
    except OSError as error:
        if not is_disk_full(error):
            raise
        # No room for the evidence: an empty marker needs no data blocks. The files stay as they are.
        folder = arm.stage_dir(stage)
        with contextlib.suppress(OSError):
            (folder / DISK_FULL_MARK).touch()
        raise DiskFull(f"no space left on the run directory's disk ({error.filename}: {error.strerror}) in "
                       f"{stage} of {arm.manifest.name}: every file written so far is kept, and {folder} is marked "
                       f"{DISK_FULL_MARK}; free space, then run again with --resume (it sets the stage aside and "
                       f"reruns it)") from None


def run_arm(arm: Arm, stages: list[str], on_stage: Callable[[str, str], None] | None = None, *,
            resume: bool = False) -> list[Evidence]:
    """Runs the stages in order; a stage that does not pass stops the arm (later stages: skipped). Then,
    if every stage passed, the train and evaluate stages again for each further plan seed (a trial each,
    under seeds/seed-<n>/). With `resume`, stages that already passed in this run directory are kept, and
    a stage left behind by an interrupted run is set aside (marked) and run again."""
    arm.provenance = provenance_in_background(arm.plan)  # made while the first stage runs
    write_record(arm.run_dir / "plan.json", arm.plan)
    try:
        results = _run_stages(arm, stages, on_stage or (lambda stage, status: None), resume)
        trial_stages = [stage for stage in stages if stage in TRIAL_STAGES]
        for seed in arm.plan.seeds[1:] if trial_stages else ():
            if any(evidence.status != "passed" for evidence in results):
                break
            trial = arm.trial(seed)

            def notify(stage: str, status: str, seed: int = seed) -> None:
                arm.on_event(stage, f"seed {seed}: {'running' if status == 'start' else status}")

            results += _run_stages(trial, trial_stages, notify, resume)
    finally:
        arm.close()
    return results


def _run_stages(arm: Arm, stages: list[str], notify: Callable[[str, str], None], resume: bool) -> list[Evidence]:
    results: list[Evidence] = []
    stopped = False
    for stage in stages:
        if resume and not stopped:
            earlier = earlier_evidence(arm, stage)
            if earlier is not None and earlier.status == "passed" and earlier.plan_id == arm.plan.plan_id:
                if stage == "probe":
                    arm.environment = earlier.environment  # later stages record it; no second read
                results.append(earlier)
                notify(stage, "passed")
                continue
            if arm.stage_dir(stage).exists() and (earlier is None or earlier.status != "skipped"):
                arm.interrupted[stage] = set_aside(arm, stage)
        if stopped:
            results.append(write_skipped(arm, stage))
            continue
        notify(stage, "start")
        if stage != "probe" and arm.environment is None:
            probe = earlier_evidence(arm, "probe")
            arm.environment = probe.environment if probe else None
        evidence = run_stage(arm, stage)
        stopped = evidence.status != "passed"
        notify(stage, evidence.status)
        results.append(evidence)
    return results
