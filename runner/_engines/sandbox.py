"""The local engine's sandbox: every job runs under bubblewrap (`bwrap`, Debian's package bubblewrap).

A job sees the whole file system read-only (its stack environment, the policy, its inputs) except its
arm's run directory, which holds its private HOME and TMPDIR (mounted on /tmp as well); it gets a fresh
/dev, /proc and /dev/shm, and its own network namespace with only a loopback interface. A job that needs
a peer (an environment arm's trainer and its rollout service) joins the peer's network namespace with
nsenter, so the two meet on 127.0.0.1 and nothing else. Where bubblewrap is missing or cannot make a
sandbox (no user namespaces), jobs run as plain processes and the probe's evidence says so;
RUNNER_SANDBOX=none asks for that.

bwrap stays the job's process-group leader and ignores SIGTERM (bwrap dies at once on it, which would
SIGKILL the job); the launcher it starts takes the default back before the adapter inherits the ignore.
So a graceful stop reaches the job, which exits with its own code, and bwrap exits with that code.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from runner_contracts.processes import descendants, die_with_parent

from .jobs import end_with_the_runner

__all__ = ["Sandbox", "local_sandbox"]

_FRESH = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/dev/shm"]


@dataclass(frozen=True)
class Sandbox:
    """How local jobs are isolated: `bwrap` is the tool's path, or None when jobs run unsandboxed (`why`)."""

    bwrap: str | None
    version: str = ""
    why: str = ""

    def describe(self) -> str:
        """One line for the probe's evidence and the comparison."""
        if self.bwrap is None:
            return f"none (jobs run as plain processes: {self.why})"
        return (f"{self.version}: own network namespace (loopback only), read-only file system, writes to the "
                f"run directory")

    def command(self, cmd: list[str], *, run_dir: Path, cwd: Path, tmp: Path, read_only: list[Path],
                peer_pid: int | None = None, host_network: bool = False) -> list[str]:
        """`cmd` inside the sandbox, in `cwd`: `run_dir` writable, `tmp` (the job's private TMPDIR) mounted
        on /tmp too (upstreams write there by name), and `read_only` (inputs, the stack environment) mounted
        again over it where they lie under /tmp. With `peer_pid`, in the network namespace of that job;
        with `host_network`, in the host's (files stay confined)."""
        if self.bwrap is None:
            return cmd
        binds = [*(arg for path in sorted(glob.glob("/dev/nvidia*")) for arg in ("--dev-bind", path, path)),
                 "--bind", str(tmp), "/tmp",
                 *(arg for path in read_only for arg in ("--ro-bind", str(path), str(path))),
                 "--bind", str(run_dir), str(run_dir), "--chdir", str(cwd)]
        if host_network:
            return [self.bwrap, *_FRESH, *binds, "--", *cmd]
        if peer_pid is None:
            return [self.bwrap, *_FRESH, *binds, "--unshare-net", "--", *cmd]
        # Unprivileged bwrap made a user namespace too; entering it is allowed to the uid that owns it.
        user = [] if os.geteuid() == 0 else ["--user", "--preserve-credentials"]
        return ["nsenter", f"--target={_sandboxed_pid(peer_pid)}", "--net", *user, "--",
                self.bwrap, *_FRESH, *binds, "--", *cmd]

    def preexec(self) -> None:
        """Popen preexec_fn of a job: SIGTERM once the runner dies; bwrap, ignoring SIGTERM, gets SIGKILL and
        the launcher below it then gets its own SIGTERM."""
        if self.bwrap is None:
            end_with_the_runner()
            return
        die_with_parent(signal.SIGKILL)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _sandboxed_pid(job_pid: int) -> int:
    """A process of the job inside its network namespace (bwrap's own process stays outside)."""
    own = os.readlink("/proc/self/ns/net")
    for pid in descendants(job_pid):
        try:
            if os.readlink(f"/proc/{pid}/ns/net") != own:
                return pid
        except OSError:
            continue
    raise RuntimeError(f"job {job_pid} has no process in a network namespace of its own")


@functools.cache
def local_sandbox() -> Sandbox:
    """bubblewrap when it is installed and can make a sandbox here, else the reason it cannot."""
    if os.environ.get("RUNNER_SANDBOX", "bubblewrap") == "none":
        return Sandbox(None, why="RUNNER_SANDBOX=none")
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return Sandbox(None, why="bwrap not found; install the bubblewrap package")
    trial = subprocess.run([bwrap, *_FRESH, "--unshare-net", "--", "true"], capture_output=True, text=True,
                           stdin=subprocess.DEVNULL, check=False)
    if trial.returncode != 0:
        return Sandbox(None, why=f"bwrap cannot make a sandbox here: {trial.stderr.strip()[:300]}")
    version = subprocess.run([bwrap, "--version"], capture_output=True, text=True, check=False).stdout.strip()
    return Sandbox(bwrap, version=version or "bubblewrap")
