"""Container engines the tests start themselves: a Docker Engine (dockerd) and Podman's Docker-compatible
service, each on its own socket in a scratch folder, stopped through the pid we started.

Their image stores live under the runner cache (RUNNER_CACHE_DIR or ~/.cache/runner: docker/, podman/),
so images built by one test session are reused by the next; a lock file keeps two sessions from sharing
one store at once. Facts these settings rest on (no bridge, runc for podman, explicit ulimits) are in
../shared/FIELD-NOTES.md."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from runner_contracts.processes import die_with_parent

from runner._engines.jobs import file_lock
from runner.api import cache_dir


def missing(*binaries: str) -> str | None:
    """Why these engines cannot be started here, or None."""
    absent = [name for name in binaries if shutil.which(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed (`make test` installs Debian's docker.io, podman, debootstrap)"
    if os.geteuid() != 0:
        return "starting dockerd/podman and debootstrap need root"
    return None


@contextlib.contextmanager
def _store_lock(store: Path) -> Iterator[None]:
    """One daemon per store at a time (parallel sessions of the suite share the cache)."""
    store.mkdir(parents=True, exist_ok=True)
    with file_lock(store.parent / f".{store.name}.lock"):
        yield


def _wait_for_socket(process: subprocess.Popen, socket: Path, log: Path, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not socket.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.1)


def _unmount_under(folder: str) -> None:
    """Lazily unmounts what a stopped daemon left mounted inside our own scratch folder (dockerd's
    netns bind mount under --exec-root can outlive it), so the folder can be removed."""
    with open("/proc/self/mounts") as handle:
        points = [line.split()[1] for line in handle if line.split()[1].startswith(folder.rstrip("/") + "/")]
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM a process we started, SIGKILL if it is still there after 30 s."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def _daemon(store: Path, prefix: str, what: str, command, env: dict[str, str] | None = None) -> Iterator[str]:
    """Runs `command(scratch, socket)` (a daemon serving `socket`) with its store locked and a scratch
    folder of its own; yields the socket's url, stops the daemon and cleans the folder afterwards."""
    with _store_lock(store), tempfile.TemporaryDirectory(prefix=prefix, dir="/tmp", ignore_cleanup_errors=True) as scratch:
        socket, log = Path(scratch) / "engine.sock", Path(scratch) / "engine.log"
        with open(log, "wb") as handle:
            # die_with_parent: a test session killed before its teardown must not leave a daemon holding the store
            process = subprocess.Popen(command(Path(scratch), socket), stdout=handle, stderr=subprocess.STDOUT,
                                       start_new_session=True, env={**os.environ, **(env or {})},
                                       preexec_fn=lambda: die_with_parent(signal.SIGTERM))
        try:
            _wait_for_socket(process, socket, log, what)
            yield f"unix://{socket}"
        finally:
            stop(process)
            _unmount_under(scratch)


def copy_stacks(target: Path) -> Path:
    """The stack folders, copied: `images build` and `images export` record digests in pins.json, and the
    repository stays clean. Same contents, same image tags."""
    shutil.copytree(Path(__file__).resolve().parents[1] / "stacks", target,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    return target


def docker_daemon():
    """A dockerd on its own unix socket; yields the DOCKER_HOST url."""
    store = cache_dir() / "docker"
    return _daemon(store, "rd-", "dockerd", lambda scratch, socket: [
        "dockerd", "-H", f"unix://{socket}", "--data-root", str(store), "--exec-root", f"{scratch}/exec",
        "--pidfile", f"{scratch}/docker.pid", "--iptables=false", "--ip6tables=false", "--bridge=none",
        "--storage-driver=overlay2"])


def podman_service():
    """`podman system service` on its own unix socket (runc, cgroupfs, explicit ulimits); yields its url."""
    store = cache_dir() / "podman"
    conf = store / "containers.conf"
    store.mkdir(parents=True, exist_ok=True)
    hard_nofile = int(subprocess.run(["sh", "-c", "ulimit -Hn"], capture_output=True, text=True).stdout.strip())
    nofile = min(hard_nofile, 65536)
    conf.write_text("[containers]\n"
                    f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc=4096:4096"]\n'
                    "[engine]\n"
                    'runtime = "runc"\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n')
    # Podman records the runroot in its database: it must stay the same for the same store.
    return _daemon(store, "rp-", "podman system service", lambda scratch, socket: [
        "podman", "--root", str(store / "storage"), "--runroot", str(store / "run"), "system", "service",
        "--time=0", f"unix://{socket}"], env={"CONTAINERS_CONF": str(conf)})
