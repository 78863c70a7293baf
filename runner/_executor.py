"""Submitting qualifications and comparisons to Slurm and following them; `runner status` and `cancel`
read the run directory's slurm/jobs.json."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner_contracts import Evidence, Plan, RecordError, read_record, write_atomic, write_record

from ._errors import UserError
from ._qualify import STAGES
from ._slurm import (
    FINISHED,
    JOBS_FILE,
    ArmJob,
    ClusterProfile,
    JobState,
    SubmittedJob,
    cancel,
    job_states,
    read_jobs,
    render_arm,
    render_report,
    submit,
    write_jobs,
)

EXECUTORS = ("local", "slurm")
ENDED = FINISHED | {"UNKNOWN"}


def _write_script(path: Path, text: str) -> Path:
    write_atomic(path, text.encode())
    path.chmod(0o755)
    return path


def submit_qualification(stack: str, plan: Plan, run_dir: Path, engine: str, profile: ClusterProfile, *,
                         stages: list[str] | None, dry_run: bool) -> list[SubmittedJob]:
    """One arm as one job; the frozen plan and the script go into the run directory first."""
    write_record(run_dir / "plan.json", plan)
    job = ArmJob(stack=stack, arm_dir=run_dir, plan_file=run_dir / "plan.json", engine=engine,
                 stages=tuple(stages) if stages else None)
    script = _write_script(run_dir / "slurm" / f"{stack}.sbatch", render_arm(job, plan, profile, command="qualify"))
    jobs = [SubmittedJob(name=stack, job_id=None if dry_run else submit(script), script=str(script),
                         run_dir=str(run_dir))]
    write_jobs(run_dir, jobs, profile=profile, kind="qualify")
    return jobs


def submit_comparison(stacks: list[str], plan: Plan, compare_dir: Path, engine: str, profile: ClusterProfile, *,
                      dry_run: bool) -> list[SubmittedJob]:
    """One job per arm, each waiting for the previous one (matched arms run one after another on the same
    partition and constraint), then a report job after all of them."""
    write_record(compare_dir / "plan.json", plan)
    jobs: list[SubmittedJob] = []
    previous: list[str] = []
    for stack in stacks:
        arm_dir = compare_dir / "arms" / stack
        job = ArmJob(stack=stack, arm_dir=arm_dir, plan_file=compare_dir / "plan.json", engine=engine)
        script = _write_script(compare_dir / "slurm" / f"{stack}.sbatch",
                               render_arm(job, plan, profile, command="compare"))
        (arm_dir / "slurm").mkdir(parents=True, exist_ok=True)
        job_id = None if dry_run else submit(script, after=previous)
        jobs.append(SubmittedJob(name=stack, job_id=job_id, script=str(script), run_dir=str(arm_dir)))
        previous = [job_id] if job_id else []
        write_jobs(compare_dir, jobs, profile=profile, kind="compare")  # a failing sbatch leaves a true record
    script = _write_script(compare_dir / "slurm" / "report.sbatch", render_report(compare_dir, stacks, plan, profile))
    arm_ids = [job.job_id for job in jobs if job.job_id]
    jobs.append(SubmittedJob(name="report", job_id=None if dry_run else submit(script, after=arm_ids),
                             script=str(script), run_dir=str(compare_dir)))
    write_jobs(compare_dir, jobs, profile=profile, kind="compare")
    return jobs


def _arm_evidence(arm_dir: Path) -> dict[str, Evidence | None]:
    """stage -> the evidence already written (None if unreadable), read once per status call."""
    found: dict[str, Evidence | None] = {}
    for stage in STAGES:
        path = arm_dir / "stages" / stage / "evidence.json"
        if path.is_file():
            try:
                found[stage] = read_record(path, Evidence)
            except RecordError:
                found[stage] = None
    return found


def status(run_dir: Path) -> dict[str, Any]:
    """Job states and stage evidence of a run submitted with --executor slurm."""
    record = read_jobs(run_dir)
    states = job_states([job["job_id"] for job in record["jobs"] if job["job_id"]])  # one state per id
    rows = []
    for job in record["jobs"]:
        state = states[job["job_id"]] if job["job_id"] else JobState("-", "NOT SUBMITTED (dry run)")
        arm_dir = Path(job["run_dir"])
        row = {"name": job["name"], "job_id": job["job_id"], "state": state.state, "reason": state.reason,
               "exit_code": state.exit_code, "restarts": state.restarts, "script": job["script"]}
        if job["name"] != "report":
            evidence = _arm_evidence(arm_dir)
            row["stages"] = {stage: e.status if e else "unreadable" for stage, e in evidence.items()}
            row["error"] = _first_error(evidence, arm_dir, job["job_id"], row)
        rows.append(row)
    finished = all(row["state"] in ENDED or row["job_id"] is None for row in rows)
    return {"run_dir": str(run_dir), "kind": record["kind"], "jobs": rows, "finished": finished}


def _first_error(evidence: dict[str, Evidence | None], arm_dir: Path, job_id: str | None,
                 row: dict[str, Any]) -> str | None:
    """Why an arm failed: the first stage error or failed gate, else the tail of the job's log."""
    for stage, found in evidence.items():
        if found is None:
            continue
        if found.error is not None and found.status == "error":
            return f"{stage}: {found.error.kind}: {found.error.message}"
        failed = [g.name for g in found.gates if not g.passed]
        if found.status == "failed" and failed:
            return f"{stage}: failed gates {', '.join(failed)}"
    if job_id and row["state"] in ("FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"):
        log = arm_dir / "slurm" / f"job-{job_id}.out"
        if log.is_file():
            lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
            return " | ".join(lines[-3:]) or f"job {row['state']} with exit code {row['exit_code']}"
        return f"job {row['state']} with exit code {row['exit_code']} (no log at {log})"
    return None


def follow(run_dir: Path, on_update: Callable[[dict[str, Any]], None], *, poll_s: float = 2.0,
           timeout_s: float | None = None) -> dict[str, Any]:
    """Polls `status` until every job ended; returns the last status."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        current = status(run_dir)
        on_update(current)
        if current["finished"]:
            return current
        if deadline is not None and time.monotonic() > deadline:
            raise UserError(f"{run_dir}: jobs still running after {timeout_s:.0f} s; `runner status {run_dir}`")
        time.sleep(poll_s)


def cancel_run(run_dir: Path) -> list[str]:
    """scancel the run's jobs that have not ended; returns their ids."""
    states = job_states([job["job_id"] for job in read_jobs(run_dir)["jobs"] if job["job_id"]])
    live = [job_id for job_id, state in states.items() if state.state not in ENDED]
    cancel(live)
    return live


def arm_order(compare_dir: Path) -> list[str] | None:
    """The arms of a comparison in the order they were submitted (None if not a Slurm comparison)."""
    if not (compare_dir / "slurm" / JOBS_FILE).is_file():
        return None
    return [job["name"] for job in read_jobs(compare_dir)["jobs"] if job["name"] != "report"]
