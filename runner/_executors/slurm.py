"""The Slurm executor: an arm is one sbatch job (a comparison chains one per arm, then a report job),
followed until it ends; `runner status` and `cancel` read the run directory's slurm/jobs.json. The batch
script always runs `runner qualify --resume`, so a requeued job, or one submitted again into the same run
directory, keeps the stages that passed."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner_contracts import Evidence, Plan, RecordError, read_record, write_atomic, write_record

from .._console import progress as progress_lines
from .._errors import EngineError, UserError
from .._report import write_report
from .._stacks import StackManifest
from .._stages import STAGES
from .._stages.arm import check_run_dir
from . import Submitted
from .sbatch import (
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

ENDED = FINISHED | {"UNKNOWN"}
ATTEMPT_LINE = re.compile(r"^runner: job (\d+) attempt (\d+) started on (\S+) at (\S+)$")


class SlurmExecutor:
    """Submits arms as sbatch jobs with the cluster profile's resources and follows them, or returns the
    submitted jobs (`follow=False`, or a dry run that writes the scripts only)."""

    name = "slurm"

    def __init__(self, engine: str, profile: ClusterProfile, *, dry_run: bool = False, follow: bool = True,
                 quiet: bool = False):
        self.engine, self.profile = engine, profile
        self.dry_run, self.follow, self.quiet = dry_run, follow, quiet

    def qualify(self, manifest: StackManifest, plan: Plan, run_dir: Path, stages: list[str], *,
                all_stages: bool, resume: bool) -> dict[str, Any] | Submitted:
        check_run_dir(run_dir, plan)
        jobs = submit_qualification(manifest.name, plan, run_dir, self.engine, self.profile,
                                    stages=None if all_stages else stages, dry_run=self.dry_run)
        if self.dry_run or not self.follow:
            return Submitted(run_dir=run_dir, jobs=jobs, dry_run=self.dry_run)
        follow_with_progress(run_dir, quiet=self.quiet)
        return {**write_report(run_dir), "run_dir": str(run_dir)}

    def compare(self, manifests: list[StackManifest], plan: Plan, compare_dir: Path,
                stages: dict[str, list[str]], *, all_stages: bool, resume: bool) -> dict[str, Any] | Submitted:
        # Every arm's job runs `qualify --resume`: submitted again into the same directory, it continues.
        names = [manifest.name for manifest in manifests]
        for name in names:
            check_run_dir(compare_dir / "arms" / name, plan)
        jobs = submit_comparison(names, plan, compare_dir, self.engine, self.profile,
                                 stages=None if all_stages else stages, dry_run=self.dry_run)
        if self.dry_run or not self.follow:
            return Submitted(run_dir=compare_dir, jobs=jobs, dry_run=self.dry_run)
        follow_with_progress(compare_dir, quiet=self.quiet)
        if not (compare_dir / "comparison.json").is_file():
            raise EngineError(f"the report job wrote no comparison.json; `runner status {compare_dir}` shows why")
        return json.loads((compare_dir / "comparison.json").read_text())


def follow_with_progress(target: Path, *, quiet: bool) -> dict[str, Any]:
    """Follows the run's Slurm jobs with one line per job (state, reason, stages done)."""
    with progress_lines(quiet=quiet) as progress:
        lines: dict[str, Any] = {}

        def update(current: dict[str, Any]) -> None:
            for row in current["jobs"]:
                if row["name"] not in lines:
                    lines[row["name"]] = progress.add_task("", total=1)
                stages = row.get("stages") or {}
                done = ", ".join(f"{stage} {status}" for stage, status in stages.items())
                reason = f" ({row['reason']})" if row["reason"] else ""
                progress.update(lines[row["name"]], description=f"{row['name']} job {row['job_id']}: "
                                                                f"{row['state']}{reason}{'; ' + done if done else ''}",
                                completed=1 if row["state"] in ENDED else 0)

        return follow(target, update)


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
                      stages: dict[str, list[str]] | None, dry_run: bool) -> list[SubmittedJob]:
    """One job per arm, each waiting for the previous one (matched arms run one after another on the same
    partition and constraint), then a report job after all of them."""
    write_record(compare_dir / "plan.json", plan)
    jobs: list[SubmittedJob] = []
    previous: list[str] = []
    for stack in stacks:
        arm_dir = compare_dir / "arms" / stack
        job = ArmJob(stack=stack, arm_dir=arm_dir, plan_file=compare_dir / "plan.json", engine=engine,
                     stages=tuple(stages[stack]) if stages else None)
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


@dataclass(frozen=True)
class Attempt:
    """One run of an arm's batch script, from the line arm.sbatch prints first."""

    number: int
    host: str
    started_at: str


def job_log(arm_dir: Path, job_id: str) -> Path:
    return arm_dir / "slurm" / f"job-{job_id}.out"


def read_attempts(log: Path) -> tuple[list[Attempt], list[str]]:
    """The attempts a job's log records, and the log lines of the last one (all lines if none is recorded)."""
    attempts: list[Attempt] = []
    lines: list[str] = []
    if log.is_file():
        for line in log.read_text(errors="replace").splitlines():
            found = ATTEMPT_LINE.match(line.strip())
            if found:
                attempts.append(Attempt(int(found[2]), found[3], found[4]))
                lines = []
            elif line.strip():
                lines.append(line.strip())
    return attempts, lines


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
            attempts, last_lines = read_attempts(job_log(arm_dir, job["job_id"])) if job["job_id"] else ([], [])
            row["attempts"] = len(attempts)
            row["stages"] = {stage: e.status if e else "unreadable" for stage, e in evidence.items()}
            row["error"] = _first_error(evidence, attempts, last_lines, row)
        rows.append(row)
    finished = all(row["state"] in ENDED or row["job_id"] is None for row in rows)
    return {"run_dir": str(run_dir), "kind": record["kind"], "jobs": rows, "finished": finished}


FAILED_STATES = ("FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED",
                 "CANCELLED")


def _first_error(evidence: dict[str, Evidence | None], attempts: list[Attempt], last_lines: list[str],
                 row: dict[str, Any]) -> str | None:
    """Why an arm failed: the first stage error or failed gate of the job's last attempt, else what that
    attempt printed; an attempt Slurm ended before its script ran is named as such."""
    ended_badly = row["state"] in FAILED_STATES
    expected = row["restarts"] + 1  # the attempt Slurm's state belongs to
    if ended_badly and attempts and attempts[-1].number < expected:
        return (f"attempt {expected} (after {row['restarts']} requeue(s)) never started: Slurm ended the job "
                f"{row['state']} (exit code {row['exit_code'] or '?'}"
                f"{', reason ' + row['reason'] if row['reason'] else ''}) before its batch script ran (a job "
                f"released within the second of its requeue is refused: 'Job credential revoked' in "
                f"slurmctld's log); the stages below are attempt {attempts[-1].number}'s. Continue the arm with "
                f"`runner qualify ... --executor slurm --run-dir <this run> --resume`")
    since = attempts[-1].started_at if attempts else ""
    for stage, found in evidence.items():
        if found is None or (found.finished_at or "") < since:
            continue  # unreadable, or left by an earlier attempt
        if found.error is not None and found.status == "error":
            return f"{stage}: {found.error.kind}: {found.error.message}"
        failed = [g.name for g in found.gates if not g.passed]
        if found.status == "failed" and failed:
            return f"{stage}: failed gates {', '.join(failed)}"
    if ended_badly:
        tail = " | ".join(last_lines[-3:])
        what = f"attempt {attempts[-1].number}" if attempts else "the job"
        return (f"{what} ended {row['state']} (exit code {row['exit_code'] or '?'}) before writing stage evidence"
                + (f": {tail}" if tail else "; its log has no line after the attempt started"))
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
