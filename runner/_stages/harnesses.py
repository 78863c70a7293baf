"""Evaluation harnesses in the evaluate stage (plan `harnesses`): for each harness and each checkpoint (base,
trained), the trainer's environment serves the checkpoint greedily (its `serve-policy` job: the policy server,
every call logged) and the harness stack's own environment runs the harness against it (its `harness` job,
in the server's network); the host audits the harness's samples against the server's calls."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from qualification.gates import HarnessRun, harness_gates
from runner_contracts import (
    HARNESS_FILE,
    EnvironmentInfo,
    GateResult,
    HarnessSample,
    HarnessSpec,
    PolicyCall,
    RecordError,
    StageRequest,
    StageResult,
    read_record,
)

from .._engines.jobs import RunOutcome, StackEnvironment
from .._stacks import StackManifest, get_stack
from .arm import Arm, read_any
from .probe import environment_gates

def run_harnesses(arm: Arm, trained: Path, out: Path) -> tuple[list[GateResult], list[dict[str, Any]]]:
    """Gates and one summary per harness of the plan; the files under out/harnesses/<stack>/<checkpoint>/."""
    gates: list[GateResult] = []
    summaries = []
    for spec in arm.plan.harnesses:
        task = _frozen_task(spec, arm.run_dir)
        manifest = get_stack(spec.stack)
        env = arm.engine.prepare(manifest)
        environment, probed = _probe(arm, manifest, env, out / "harnesses" / spec.stack / "probe")
        gates += probed
        runs = {}
        for label, policy in (("base", arm.policy_dir), ("trained", trained)):
            arm.on_event("evaluate", f"{spec.stack} on the {label} checkpoint")
            runs[label] = _run_one(arm, env, spec, task, label, policy, out / "harnesses" / spec.stack / label)
        checks, summary = harness_gates(spec.stack, runs, arm.plan.gates.confidence)
        gates += checks
        reported = runs["base"].reported
        summaries.append({"stack": spec.stack, "upstream": reported.get("upstream"), "task": reported.get("task"),
                          "task_sha256": spec.sha256, "metric": reported.get("metric"), "decoding": "greedy",
                          "environment": {"python": environment.python if environment else None,
                                          "lock_sha256": env.lock_sha256, "engine": arm.engine.name,
                                          "image": env.image, "image_digest": env.image_digest},
                          **summary})
    return gates, summaries


def _frozen_task(spec: HarnessSpec, run_dir: Path) -> Path:
    """The task's folder copied into the run (what the plan id's sha256 covers), so every engine's job reads
    it from the run directory it already mounts."""
    source = Path(spec.task)
    target = run_dir / "harness-tasks" / f"{spec.stack}-{(spec.sha256 or '')[:12]}"
    if not target.is_dir():
        scratch = target.with_name(target.name + ".partial")
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.copytree(source.parent, scratch, ignore=shutil.ignore_patterns("__pycache__", ".*"))
        scratch.rename(target)
    return target / source.name


def _probe(arm: Arm, manifest: StackManifest, env: StackEnvironment,
           folder: Path) -> tuple[EnvironmentInfo | None, list[GateResult]]:
    """The harness's environment checked as a stack's probe is (lock, Python, upstream, pins, nothing foreign)."""
    request = StageRequest(run_id=arm.run_id, stack=manifest.name, stage="probe", plan=arm.request_plan(),
                           out_dir=str(folder.resolve()))
    outcome = arm.run_job(env, request, timeout_s=max(arm.time_left(), 1.0))
    result, reason = _result(folder, outcome)
    if result is None or result.environment is None:
        return None, [GateResult(name=f"harness:{manifest.name}:probe", passed=False,
                                 detail=reason or "the probe reported no environment")]
    return environment_gates(arm, manifest, env, result, f"harness:{manifest.name}")


def _result(folder: Path, outcome: RunOutcome) -> tuple[StageResult | None, str | None]:
    """The job's result.json, and why it failed (its error, or why there is no result) or None."""
    try:
        result = read_record(folder / "result.json", StageResult)
    except (OSError, RecordError) as error:
        return None, f"exit {outcome.exit_code}, no result: {error} (logs: {outcome.stderr})"
    return result, result.error.message if result.error else None


def _run_one(arm: Arm, env: StackEnvironment, spec: HarnessSpec, task: Path, label: str, policy: Path,
             folder: Path) -> HarnessRun:
    trainer = arm.env.manifest.name
    served = StageRequest(run_id=arm.run_id, stack=trainer, stage="serve-policy", plan=arm.request_plan(),
                          out_dir=str((folder / "policy").resolve()), policy_dir=str(policy.resolve()))
    service = arm.engine.start_service(arm.env, served)
    try:
        request = StageRequest(run_id=arm.run_id, stack=spec.stack, stage="harness", plan=arm.request_plan(),
                               out_dir=str(folder.resolve()), policy_dir=str(policy.resolve()),
                               options={"policy_url": service.url, "task": str(task.resolve()), "label": label,
                                        "metric": spec.metric, "limit": spec.limit})
        outcome = arm.run_job(env, request, timeout_s=max(arm.time_left(), 1.0), peer=service)
    finally:
        service.stop()
    result, reason = _result(folder, outcome)
    reported: dict[str, Any] = dict(result.metrics) if result else {"status": "error"}
    if reason:
        reported["error"] = reason
    try:
        samples = read_any(folder, HARNESS_FILE, HarnessSample)
    except RecordError as error:
        samples, reported["status"], reported["error"] = [], "error", str(error)
    return HarnessRun(samples=samples, reported=reported, calls=read_any(folder / "policy", "calls.jsonl", PolicyCall))
