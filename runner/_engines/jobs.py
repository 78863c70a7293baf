"""What every engine shares: the stack environment and job outcome records, the job environment
(offline flags, private HOME, an allow-list of host variables), read-only inputs, and the job runner:
a job in its own session with a fresh token, logs to files, a wall-clock limit or a kill condition that
kills its group, and whatever it started ended with it; a long-running service job and its readiness
wait on service.json."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from qualification.tasks.native import NATIVE_DATA, NATIVE_DATA_VAR
from runner_contracts import Plan, StageRequest, write_record
from runner_contracts.processes import JOB_TOKEN_VAR, descendants, die_with_parent, end_job, innermost_pid, kill_trees

from .._errors import EngineError
from .._paths import job_paths, native_asset_dir
from .._stacks import StackManifest
from .certificates import IMAGE_CERTIFICATES, certificate_env

STACK_PREFIX = Path("/opt/stack")  # the stack's virtualenv inside its image or SIF
# Variables a stack process may see; everything else of the caller's environment is dropped.
PASSTHROUGH = ("LANG", "LC_ALL", "TZ", "SSL_CERT_FILE", "PIP_CERT", "PIP_INDEX_URL", "PIP_FIND_LINKS")
FIXED_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "2",
    "MKL_NUM_THREADS": "2",
    # MKL may otherwise use fewer threads than asked at run time, and a product's rounding depends on its
    # thread count: Intel's condition for run-to-run reproducible results. Same results when it uses all.
    "MKL_DYNAMIC": "FALSE",
    "OMP_DYNAMIC": "FALSE",
    "PYTHONHASHSEED": "0",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "TRL_EXPERIMENTAL_SILENCE": "1",
    "WANDB_MODE": "disabled",
}


@dataclass(frozen=True)
class StackEnvironment:
    manifest: StackManifest
    path: Path
    python_version: str
    lock_sha256: str
    image: str | None = None  # container engines: the image reference and its digest
    image_digest: str | None = None

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


@dataclass(frozen=True)
class RunOutcome:
    exit_code: int | None
    killed: bool
    timed_out: bool
    seconds: float
    stdout: Path
    stderr: Path

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.killed and not self.timed_out


def tree_hash(roots: list[Path]) -> str:
    """sha256 over the source files (path + bytes) of our local packages, build outputs excluded."""
    digest = hashlib.sha256()
    for root in roots:
        files = ([(rel, root / rel) for rel in _source_files(root)] if root.is_dir()
                 else [(root.name, root)] if root.is_file() else [])
        for rel, path in files:
            digest.update(f"{root.name}/{rel}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _is_build_output(name: str) -> bool:
    return name in ("build", "__pycache__") or name.endswith(".egg-info")


def _source_files(root: Path) -> list[str]:
    """The files under `root` as relative posix paths in path order, build-output folders not entered."""
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if not _is_build_output(name)]
        prefix = os.path.relpath(folder, root).replace(os.sep, "/")
        found += [name if prefix == "." else f"{prefix}/{name}" for name in files if not _is_build_output(name)]
    return sorted(found, key=lambda rel: rel.split("/"))


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def read_only_inputs(request: StageRequest, stack: str, *, outside: Path | None = None) -> list[Path]:
    """Host paths a job reads: the policy (and a distillation teacher), a checkpoint to resume from, a trained
    policy or matched baseline to evaluate, the
    plan's built task packages and its built native asset (whose data every job reads; only `stack`'s own
    jobs import it); with `outside`, only those not under that folder (the run directory, mounted writable
    anyway). The paths are the ones the request names, made absolute but not resolved:
    a job opens them by those names, so a policy or cache reached through a symlink (a home cache linked
    to scratch space) is mounted at the name the job uses (the mount follows the link on the host)."""
    paths = [Path(request.policy_dir)] if request.policy_dir else []
    paths += job_paths(request.plan, stack)
    native = native_asset_dir(request.plan)
    if native is not None and native not in paths:
        paths.append(native)
    if request.resume_from:
        paths.append(Path(request.resume_from))
    paths += [Path(request.options[key]) for key in ("trained_policy", "baseline_policy") if request.options.get(key)]
    teacher = getattr(getattr(request.plan, "distill", None), "teacher", None)
    if teacher is not None and teacher.path:  # the distill stage's teacher, a policy like the plan's own
        paths.append(Path(teacher.path))
    given = [Path(os.path.abspath(path)) for path in paths]
    if outside is None:
        return given
    return [path for path in given if not str(path.resolve()).startswith(str(outside.resolve()) + os.sep)]


def write_request(request: StageRequest) -> tuple[Path, Path]:
    """The job's output folder and its request.json, written there (what every engine starts a job with)."""
    out_dir = Path(request.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir, write_record(out_dir / "request.json", request)


def run_dir_of(out_dir: Path) -> Path:
    """The arm's run directory (the folder holding plan.json above the stage folder)."""
    for parent in [out_dir, *out_dir.parents]:
        if (parent / "plan.json").is_file():
            return parent.resolve()
    return out_dir.resolve()


def job_env(python_bin_dir: Path, home: Path, plan: Plan | None = None, stack: str = "") -> dict[str, str]:
    """What every job's environment sets, whatever the host: offline flags, PATH, a private HOME and TMPDIR,
    and the plan's task packages (and, for its own stack's jobs, its native asset) on PYTHONPATH."""
    packages = os.pathsep.join(map(str, job_paths(plan, stack))) if plan is not None else None
    native = native_asset_dir(plan) if plan is not None else None
    return {**FIXED_ENV, "LANG": "C.UTF-8", "PATH": f"{python_bin_dir}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(home), "HF_HOME": str(home / "hf"), "XDG_CACHE_HOME": str(home / "cache"),
            "TMPDIR": str(home / "tmp"), **({"PYTHONPATH": str(packages)} if packages else {}),
            **({NATIVE_DATA_VAR: str(native / NATIVE_DATA)} if native is not None else {})}


def scrubbed_env(python_bin_dir: Path, home: Path, plan: Plan | None = None, stack: str = "", *,
                 host_paths: bool = True) -> dict[str, str]:
    """job_env plus the allow-listed host variables (LANG too, when the host sets it); creates TMPDIR. The CA
    certificates as a hashed directory in place of SSL_CERT_FILE: with `host_paths` (a job that sees the host's
    files) the host's (certificates.certificate_env), else the stack image's."""
    env = {key: os.environ[key] for key in PASSTHROUGH if key in os.environ}
    env.pop("SSL_CERT_FILE", None)
    env.update(certificate_env() if host_paths else IMAGE_CERTIFICATES)
    env.update({key: value for key, value in job_env(python_bin_dir, home, plan, stack).items()
                if not (key == "LANG" and "LANG" in env)})
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    return env


def end_with_the_runner() -> None:
    """Popen preexec_fn of a job: it gets SIGTERM when the runner's thread that started it ends."""
    die_with_parent(signal.SIGTERM)


def _start_job(cmd: list[str], out_dir: Path, env: dict[str, str], stdout, stderr,
               preexec: Callable[[], None] = end_with_the_runner) -> tuple[subprocess.Popen, str]:
    """Starts a job (the launcher's supervisor, or a sandbox around it) in its own session, marked with a
    fresh token; by default it gets SIGTERM, and so ends everything below it, if the runner dies."""
    token = uuid.uuid4().hex
    process = subprocess.Popen(cmd, cwd=out_dir, env={**env, JOB_TOKEN_VAR: token}, stdout=stdout, stderr=stderr,
                               stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec)
    return process, token


def run_process(cmd: list[str], out_dir: Path, env: dict[str, str], *, timeout_s: float,
                kill_when: Callable[[], bool] | None = None,
                preexec: Callable[[], None] = end_with_the_runner) -> RunOutcome:
    """Runs one job in `out_dir` in its own process group, logs to files; SIGKILLs the group on timeout
    or when `kill_when()` turns true. Whatever the job started is ended with it."""
    stdout, stderr = out_dir / "stdout.log", out_dir / "stderr.log"
    started = time.monotonic()
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        process, token = _start_job(cmd, out_dir, env, out, err, preexec)
        try:
            with exit_waiter(process) as finished:
                killed, timed_out = watch(finished, lambda: _kill_group(process), timeout_s=timeout_s,
                                          kill_when=kill_when)
        except BaseException:
            _kill_group(process)
            raise
        finally:
            end_job(token)
    shutil.rmtree(out_dir / ".home", ignore_errors=True)
    return RunOutcome(exit_code=process.returncode, killed=killed, timed_out=timed_out,
                      seconds=time.monotonic() - started, stdout=stdout, stderr=stderr)


@contextlib.contextmanager
def exit_waiter(process: subprocess.Popen) -> Iterator[Callable[[float], bool]]:
    """`finished(step_s)`: waits up to `step_s` for the process to exit, woken by its pidfd the moment it
    does (Popen.wait's timeout polls in growing sleeps: ~7 ms late on average, per job)."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):  # not Linux >= 5.3, or the process is already reaped
        pidfd = None

    def finished(step_s: float) -> bool:
        if pidfd is not None:
            select.select([pidfd], [], [], step_s)
            return process.poll() is not None
        try:
            process.wait(timeout=step_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    try:
        yield finished
    finally:
        if pidfd is not None:
            os.close(pidfd)


def watch(finished: Callable[[float], bool], kill: Callable[[], None], *, timeout_s: float,
          kill_when: Callable[[], bool] | None) -> tuple[bool, bool]:
    """Waits in 50 ms steps until `finished(step)`; calls `kill()` once, when `kill_when()` turns true or
    after `timeout_s`. Returns (killed, timed_out)."""
    started = time.monotonic()
    killed = timed_out = False
    while not finished(0.05):
        if killed or timed_out:
            continue
        if kill_when is not None and kill_when():
            killed = True
            kill()
        elif time.monotonic() - started > timeout_s:
            timed_out = True
            kill()
    return killed, timed_out


def wait_for_service(out_dir: Path, alive: Callable[[], bool], stop: Callable[[], object], *, what: str,
                     ready_timeout_s: float) -> str:
    """The url from the service.json a starting service writes into `out_dir`; stops it and raises
    (with its last stderr lines) if it exits or is not ready in time."""
    ready = out_dir / "service.json"
    deadline = time.monotonic() + ready_timeout_s
    while not ready.is_file():
        running = alive()
        if not running or time.monotonic() > deadline:
            stop()  # also collects a container's logs into stderr.log
            why = "did not become ready in time" if running else "exited"
            raise EngineError(f"{what} {why}: {last_error_lines(out_dir / 'stderr.log')} "
                              f"(logs: {out_dir / 'stderr.log'})")
        time.sleep(0.05)
    return json.loads(ready.read_text())["url"]


def start_process_service(cmd: list[str], out_dir: Path, env: dict[str, str], *, what: str,
                          ready_timeout_s: float, preexec: Callable[[], None] = end_with_the_runner) -> ServiceHandle:
    """Starts a long-running job in its own process group and waits for the service.json it writes."""
    (out_dir / "service.json").unlink(missing_ok=True)
    with open(out_dir / "stdout.log", "wb") as stdout, open(out_dir / "stderr.log", "wb") as stderr:
        process, token = _start_job(cmd, out_dir, env, stdout, stderr, preexec)
    handle = ServiceHandle(process=process, out_dir=out_dir, url="", token=token)
    handle.url = wait_for_service(out_dir, handle.alive, handle.stop, what=what, ready_timeout_s=ready_timeout_s)
    return handle


@dataclass
class ServiceHandle:
    """A running adapter service (its own process group, started by us)."""

    process: subprocess.Popen
    out_dir: Path
    url: str
    token: str  # JOB_TOKEN_VAR of everything the service started

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill_processes(self, pids: list[int]) -> list[int]:
        """Processes below this service's own process, matched by the pid they see (a sandbox or an
        Apptainer --containall may give them a pid namespace of their own)."""
        wanted = set(pids)
        ours = {innermost_pid(pid): pid for pid in descendants(self.process.pid)}
        killed = kill_trees([ours[pid] for pid in sorted(wanted & ours.keys())])
        return [pid for pid, host in ours.items() if host in killed]

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the group, SIGKILL after `grace_s`; returns the exit code."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _kill_group(self.process)
        end_job(self.token)
        shutil.rmtree(self.out_dir / ".home", ignore_errors=True)
        return self.process.returncode


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the job's process group (one we started, in its own session) and everything below its process
    in other groups: Apptainer runs squashfuse_ll, which holds the container's SIF mount, in a session of its
    own, so killing the group alone leaves it running, orphaned, with the mount."""
    kill_trees([process.pid])
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def last_error_lines(path: Path, lines: int = 3) -> str:
    """The last few meaningful lines of a log (warnings and progress bars dropped), joined on one line."""
    if not path.is_file():
        return ""
    text = path.read_text(errors="replace").splitlines()
    interesting = [line.strip() for line in text
                   if line.strip() and not re.search(r"Warning|warnings.warn|it/s\]|^\s*\^+\s*$", line)]
    return " | ".join(interesting[-lines:])
