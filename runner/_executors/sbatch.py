"""The Slurm executor: one sbatch script per arm, rendered from a typed job and a template, submitted
with sbatch and followed with squeue / scontrol / sacct. Slurm schedules; runner only submits, chains
and reads states. On the node the script runs `runner qualify --resume` for its arm, so a requeued
job keeps every passed stage and resumes an interrupted one."""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import string
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runner_contracts import Plan, write_atomic

from .._errors import EngineError, UserError
from .._files import convert, load_toml, toml_line
from .._secrets import is_secret
from .._paths import PROJECT_ROOT

TEMPLATES = Path(__file__).parent / "templates"
JOBS_FILE = "jobs.json"
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}
# Variables the job's environment keeps from the submitting shell (sbatch --export=NONE drops the rest).
DEFAULT_ENV_ALLOW = ("RUNNER_CACHE_DIR", "RUNNER_STACKS_DIR", "XDG_CACHE_HOME", "HOME", "LANG", "PATH",
                     "SSL_CERT_FILE", "PIP_FIND_LINKS", "DOCKER_HOST", "RUNNER_PODMAN_HOST")


@dataclass(frozen=True)
class ClusterProfile:
    """What a cluster needs in every script (clusters/*.toml)."""

    name: str = "default"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    gres: str = "gpu:{gpus}"
    cpus: int = 2  # CPUs per task when the plan's budget names none
    cpus_per_gpu: int = 8
    mem_per_gpu_gb: float | None = None
    time_limit: str | None = None
    signal_before_s: int = 120
    modules: tuple[str, ...] = ()
    apptainer: str = "apptainer"
    sif_dir: str | None = None
    binds: tuple[str, ...] = ()
    runner: str | None = None
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    env_allow: tuple[str, ...] = DEFAULT_ENV_ALLOW


_PROFILE_KEYS = {f for f in ClusterProfile.__dataclass_fields__}


def load_profile(path: Path | None) -> ClusterProfile:
    if path is None:
        return ClusterProfile()
    text, data = load_toml(path, "cluster profile")
    unknown = sorted(set(data) - _PROFILE_KEYS)
    if unknown:
        raise UserError(f"{path}:{toml_line(text, unknown[0])}: unknown key(s) {', '.join(unknown)}; a cluster "
                        f"profile has {', '.join(sorted(_PROFILE_KEYS))}")
    if "{gpus}" not in str(data.get("gres", "{gpus}")):
        raise UserError(f"{path}:{toml_line(text, 'gres')}: field gres: expected a pattern with {{gpus}}, "
                        "e.g. 'gpu:h100:{gpus}'")
    return convert(data, ClusterProfile, path, text)


@dataclass(frozen=True)
class ArmJob:
    """One arm as a Slurm job."""

    stack: str
    arm_dir: Path
    plan_file: Path  # the frozen plan (plan.json) every arm of a comparison shares
    engine: str
    stages: tuple[str, ...] | None = None


def _format_time(seconds: float) -> str:
    minutes = max(1, math.ceil(seconds / 60))
    return f"{minutes // 60:02d}:{minutes % 60:02d}:00"


def _placement_lines(profile: ClusterProfile) -> list[str]:
    return [f"#SBATCH --{key}={value}" for key, value in (
        ("partition", profile.partition), ("account", profile.account), ("qos", profile.qos),
        ("constraint", profile.constraint)) if value]


def _resource_lines(profile: ClusterProfile, plan: Plan) -> list[str]:
    budget = plan.budget
    lines = _placement_lines(profile)
    # Each stage runs up to wall_clock_s; resume runs three trainings and rollout an extra batch.
    lines.append(f"#SBATCH --time={profile.time_limit or _format_time(budget.wall_clock_s * 10)}")
    lines += ["#SBATCH --nodes=1", "#SBATCH --ntasks=1"]
    lines.append(f"#SBATCH --cpus-per-task={max(math.ceil(budget.cpus or profile.cpus), budget.gpus * profile.cpus_per_gpu)}")
    memory = budget.memory_gb or (budget.gpus * profile.mem_per_gpu_gb if profile.mem_per_gpu_gb else None)
    if memory:
        lines.append(f"#SBATCH --mem={math.ceil(memory)}G")
    if budget.gpus:
        lines.append(f"#SBATCH --gres={profile.gres.format(gpus=budget.gpus)}")
    return lines


FROM_SHELL = "# runner: from the submitting shell, never written here (sbatch --export="


def _common(profile: ClusterProfile, plan: Plan, engine: str, environ: dict[str, str]) -> dict[str, str]:
    written = [key for key, value in profile.env.items() if is_secret(key, value)]
    if written:
        raise UserError(f"cluster profile {profile.name}: env {', '.join(written)} holds a secret; set it in the "
                        "submitting shell and name it in env_allow, so it is never written into a script")
    exports = {key: environ[key] for key in profile.env_allow if key in environ}
    from_shell = sorted(key for key, value in exports.items() if is_secret(key, value))
    exports = {key: value for key, value in exports.items() if key not in from_shell}
    exports.update(profile.env)
    if engine == "apptainer":
        exports["RUNNER_APPTAINER"] = profile.apptainer
        if profile.sif_dir:
            exports["RUNNER_SIF_DIR"] = profile.sif_dir
        if profile.binds:
            exports["RUNNER_APPTAINER_BINDS"] = ":".join(profile.binds)
    return {
        "plan_name": plan.name, "plan_id_short": (plan.plan_id or "")[:12], "engine": engine,
        "module_lines": "\n".join(f"module load {shlex.quote(m)}" for m in profile.modules) or "# (no modules)",
        "export_lines": "\n".join([f"export {key}={shlex.quote(value)}" for key, value in sorted(exports.items())]
                                  + ([f"{FROM_SHELL}{','.join(from_shell)})"] if from_shell else [])),
        "workdir": shlex.quote(profile.workdir or str(PROJECT_ROOT)),
    }


def runner_command(profile: ClusterProfile) -> list[str]:
    """How a node calls the runner: the profile's, else this interpreter's `runner` script."""
    if profile.runner:
        return [profile.runner]
    script = Path(sys.executable).parent / "runner"
    return [str(script)] if script.exists() else [sys.executable, "-m", "runner.cli"]


def render_arm(job: ArmJob, plan: Plan, profile: ClusterProfile, *, command: str,
               environ: dict[str, str] | None = None) -> str:
    environ = dict(os.environ if environ is None else environ)
    args = [*runner_command(profile), "qualify", "--stack", job.stack, "--plan", str(job.plan_file), "--engine",
            job.engine, "--run-dir", str(job.arm_dir), "--resume", "--json"]
    if job.stages:
        args += ["--stages", ",".join(job.stages)]
    values = {
        **_common(profile, plan, job.engine, environ), "stack": job.stack, "command": command,
        "job_name": f"runner-{job.stack}-{(plan.plan_id or '')[:8]}",
        "resource_lines": "\n".join(_resource_lines(profile, plan)),
        "signal_before_s": str(profile.signal_before_s), "log": str(job.arm_dir / "slurm" / "job-%j.out"),
        "runner_command": shlex.join(args),
    }
    return string.Template((TEMPLATES / "arm.sbatch").read_text()).substitute(values)


def render_report(compare_dir: Path, arms: list[str], plan: Plan, profile: ClusterProfile, *,
                  environ: dict[str, str] | None = None) -> str:
    environ = dict(os.environ if environ is None else environ)
    values = {
        **_common(profile, plan, "local", environ), "arms": ", ".join(arms),
        "job_name": f"runner-report-{(plan.plan_id or '')[:8]}",
        "resource_lines": "\n".join([  # a short CPU job on the arms' partition
            *_placement_lines(profile), "#SBATCH --nodes=1", "#SBATCH --ntasks=1",
            *([f"#SBATCH --mem={math.ceil(plan.budget.memory_gb)}G"] if plan.budget.memory_gb else []),
            "#SBATCH --time=00:15:00", "#SBATCH --cpus-per-task=1"]),
        "log": str(compare_dir / "slurm" / "report-%j.out"),
        "runner_command": shlex.join([*runner_command(profile), "report", str(compare_dir)]),
    }
    return string.Template((TEMPLATES / "report.sbatch").read_text()).substitute(values)


# --- talking to Slurm ----------------------------------------------------------------------------------


def _slurm(cmd: list[str]) -> str:
    if shutil.which(cmd[0]) is None:
        raise EngineError(f"{cmd[0]} not found: the Slurm client commands must be on PATH (and SLURM_CONF set "
                          "if the cluster's config is not in the default place)")
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise EngineError(f"{shlex.join(cmd)} failed (exit {result.returncode}): {result.stderr.strip()}")
    return result.stdout


def _live_jobs(job_ids: list[str]) -> str:
    """squeue's lines for the jobs slurmctld still holds. Once every one of them has ended and been purged
    (MinJobAge after its end: 300 s by default), squeue -j refuses the ids ("Invalid job id specified",
    exit 1) instead of printing nothing; that is an empty queue, and scontrol or sacct tell how they ended.
    Any other failure is an error: an unanswered squeue must not pass as an empty queue."""
    cmd = ["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i|%T|%r"]
    try:
        return _slurm(cmd)
    except EngineError as error:
        if "Invalid job id specified" in str(error):
            return ""
        raise


def submit(script: Path, *, after: list[str] | None = None) -> str:
    """sbatch the script; `after`: job ids it must wait for (afterany: each arm runs whatever the last did)."""
    cmd = ["sbatch", "--parsable"]
    line = next((line for line in script.read_text().splitlines() if line.startswith(FROM_SHELL)), None)
    if line:  # secrets: sbatch copies these from this environment, overriding the script's --export=NONE
        cmd.append("--export=" + line.removeprefix(FROM_SHELL).rstrip(")"))
    if after:
        cmd.append("--dependency=afterany:" + ":".join(after))
    return _slurm([*cmd, str(script)]).strip().split(";")[0]


def cancel(job_ids: list[str]) -> None:
    if job_ids:
        _slurm(["scancel", *job_ids])


@dataclass
class JobState:
    job_id: str
    state: str
    reason: str = ""
    exit_code: str = ""
    restarts: int = 0


def job_states(job_ids: list[str]) -> dict[str, JobState]:
    """Live states from squeue; finished jobs from scontrol (while Slurm remembers them), else from
    sacct, whose `-c` form reads the job-completion log when accounting storage is off."""
    states: dict[str, JobState] = {}
    if not job_ids:
        return states
    for line in _live_jobs(job_ids).splitlines():
        job_id, state, reason = (line.split("|") + ["", "", ""])[:3]
        states[job_id] = JobState(job_id, state, "" if reason == "None" else reason)
    for job_id in job_ids:  # scontrol also knows recently finished jobs, exit codes and restarts
        shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=False)
        fields = dict(part.split("=", 1) for part in shown.stdout.split() if "=" in part)
        if not fields.get("JobState"):
            continue
        state = states.setdefault(job_id, JobState(job_id, fields["JobState"]))
        state.exit_code = fields.get("ExitCode", "")
        state.restarts = int(fields.get("Restarts", "0") or 0)
        if not state.reason and fields.get("Reason") not in (None, "None"):
            state.reason = fields["Reason"]
    missing = [job_id for job_id in job_ids if job_id not in states]
    for flags in (["-c"], []) if missing else ():
        result = subprocess.run(["sacct", *flags, "-n", "-P", "-j", ",".join(missing), "-o", "JobID,State,ExitCode"],
                                capture_output=True, text=True, check=False)
        found: dict[str, JobState] = {}
        for line in result.stdout.splitlines():  # one record per attempt of a requeued job; the last one counts
            job_id, state, exit_code = (line.split("|") + ["", "", ""])[:3]
            if job_id in missing and state:
                restarts = found[job_id].restarts + 1 if job_id in found else 0
                found[job_id] = JobState(job_id, state.split()[0], exit_code=exit_code, restarts=restarts)
        states.update({job_id: state for job_id, state in found.items() if job_id not in states})
    for job_id in job_ids:
        states.setdefault(job_id, JobState(job_id, "UNKNOWN", "Slurm no longer knows this job"))
    return states


# --- the run directory's record of its jobs -------------------------------------------------------------


@dataclass
class SubmittedJob:
    name: str  # arm stack, or "report"
    job_id: str | None
    script: str
    run_dir: str


def write_jobs(run_dir: Path, jobs: list[SubmittedJob], *, profile: ClusterProfile, kind: str) -> Path:
    data = {"executor": "slurm", "kind": kind, "profile": asdict(profile), "jobs": [asdict(job) for job in jobs]}
    return write_atomic(run_dir / "slurm" / JOBS_FILE, (json.dumps(data, indent=2) + "\n").encode())


def read_jobs(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "slurm" / JOBS_FILE
    if not path.is_file():
        raise UserError(f"{run_dir}: no slurm/{JOBS_FILE}; not a run submitted with --executor slurm")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"{path}: not valid JSON ({error})") from None
