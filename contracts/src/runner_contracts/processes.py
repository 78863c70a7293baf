"""Process lifecycle shared by the host and every stack job (Linux; elsewhere a no-op).

A stage's job runs under a supervisor (`python -m runner_contracts.launch`): it is a child subreaper, so
every process the adapter starts stays below it even when it starts a new session and its parent dies
(upstreams do both: Verifiers' MCP tool server, Ray's daemons, uvicorn workers). When the adapter exits,
or the supervisor is told to stop (SIGTERM from the host, or from the kernel when the host dies), the
supervisor ends every process below it before it exits itself.

The host marks each job's environment with a token (JOB_TOKEN_VAR) and, after the job, ends whatever
still carries it: the backstop for a supervisor that was SIGKILLed with its process group.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

JOB_TOKEN_VAR = "RUNNER_JOB_TOKEN"
PROC = Path("/proc")
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """The calling process gets `sig` when the thread that started it exits (PR_SET_PDEATHSIG); usable as a
    Popen preexec_fn. Survives exec."""
    _prctl(_PR_SET_PDEATHSIG, int(sig))


class StopSignal:
    """Catches SIGTERM and SIGINT from construction on; `wait()` blocks until one has arrived.

    A job's graceful stop brings SIGTERM twice (the host signals the job's process group, and the
    supervisor passes its own on), so the handler only writes to a pipe (an Event set from a handler can
    deadlock when the second signal lands while the first handler holds the Event's lock), and once one
    has arrived the rest are ignored: the stop is under way, and the supervisor's SIGKILL bounds it."""

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)):
        self._signals = tuple(signals)
        self._read, self._write = os.pipe()
        for sig in self._signals:
            signal.signal(sig, self._caught)

    def _caught(self, signum: int, frame: object) -> None:
        for sig in self._signals:
            signal.signal(sig, signal.SIG_IGN)
        os.write(self._write, bytes([signum]))

    def wait(self) -> int:
        """The first signal caught (one already caught returns at once)."""
        return os.read(self._read, 1)[0]


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every process visible in /proc (empty where there is no /proc). The
    start time (clock ticks after boot) tells a process from a later one given the same pid."""
    table: dict[int, tuple[int, str]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir(PROC):
            if entry.name.isdigit() and (fields := _stat(int(entry.name))):
                table[int(entry.name)] = (int(fields[1]), fields[19])
    return table


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state, ppid, ... starttime at [19]); [] when the
    process is gone."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return []
    fields = stat.rsplit(")", 1)[-1].split()  # the command name may hold spaces and parentheses
    return fields if len(fields) > 19 else []


def _below(pid: int, table: dict[int, tuple[int, str]]) -> list[int]:
    children: dict[int, list[int]] = {}
    for child, (parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    found, queue = [], list(children.get(pid, []))
    while queue:
        current = queue.pop(0)
        found.append(current)
        queue.extend(children.get(current, []))
    return found


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, parents before children."""
    return _below(pid, process_table())


def tree(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of `pid` and every process below it, parents before children; empty when `pid` is
    gone. What `kill_identified` takes."""
    table = process_table()
    if pid not in table:
        return []
    return [(member, table[member][1]) for member in (pid, *_below(pid, table))]


def same_process(pid: int, start: str) -> bool:
    """Whether `pid` is still the process that started at `start`, and not a zombie."""
    fields = _stat(pid)
    return bool(fields) and fields[19] == start and fields[0] not in ("Z", "X")


def kill_identified(processes: Iterable[tuple[int, str]]) -> None:
    """SIGKILLs each (pid, start time) that is still that process: a pid reused since is left alone."""
    _signal_all([pid for pid, start in processes if same_process(pid, start)], signal.SIGKILL)


def command_line(pid: int) -> str:
    """A process's argv joined by spaces ('' once it is gone)."""
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def innermost_pid(pid: int) -> int:
    """`pid` as the process sees itself: its pid in the innermost pid namespace it lives in (a container's
    --pid namespace), from /proc/<pid>/status NSpid; `pid` itself where there is none."""
    with contextlib.suppress(OSError, ValueError):
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    return pid


def kill_trees(pids: Iterable[int]) -> list[int]:
    """SIGKILLs each pid and every process below it and waits (bounded) until they have ended; returns the
    pids that were alive."""
    alive = [pid for pid in pids if not ended(pid)]
    table = process_table()
    members = [member for pid in alive for member in (pid, *_below(pid, table))]
    _signal_all(members, signal.SIGKILL)
    _await_ended(members)
    return alive


def carrying(token: str) -> list[int]:
    """Processes whose initial environment holds JOB_TOKEN_VAR=token (only ours are readable to us)."""
    needle = f"{JOB_TOKEN_VAR}={token}".encode()
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(PROC):
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                with contextlib.suppress(OSError):
                    if needle in (PROC / entry.name / "environ").read_bytes().split(b"\0"):
                        found.append(int(entry.name))
    return found


def ended(pid: int) -> bool:
    """The process is gone, or a zombie (it has exited; only its exit status waits to be collected)."""
    fields = _stat(pid)
    return not fields or fields[0] in ("Z", "X")


def _await_ended(pids: Iterable[int], timeout_s: float = 2.0) -> None:
    """Waits until each pid is a zombie or gone, at most `timeout_s`. A SIGKILLed process is still running
    its exit for a moment after its memory (and so /proc/PID/environ) is gone: `carrying` no longer finds
    it, but it has not ended yet."""
    pending = set(pids)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        pending = {pid for pid in pending if not ended(pid)}
        if pending:
            time.sleep(0.01)


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _reap_orphans() -> None:
    """Collects exited children (a subreaper inherits orphans and must wait for them)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def end_processes(find, *, grace_s: float = 2.0, reap: bool = False) -> int:
    """SIGTERM what `find()` returns, SIGKILL what is left after `grace_s`, until nothing is found and every
    process signalled has ended. Returns how many processes were signalled. `reap`: collect exited
    children, for a subreaper (elsewhere it would take a Popen's exit status from under it)."""
    pids = [pid for pid in find() if not ended(pid)]
    signalled = set(pids)
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids:
        if reap:
            _reap_orphans()
        pids = [pid for pid in find() if not ended(pid)]
        signalled.update(pids)
        if time.monotonic() > deadline:
            _signal_all(pids, signal.SIGKILL)
        time.sleep(0.05)
    _await_ended(signalled)
    if reap:
        _reap_orphans()
    return len(signalled)


def end_job(token: str, *, grace_s: float = 2.0) -> int:
    """Ends every process still carrying the job's token; returns how many there were."""
    return end_processes(lambda: carrying(token), grace_s=grace_s)


def supervise(cmd: list[str], *, stop_grace_s: float = 10.0) -> int:
    """Runs `cmd` as a child and returns its exit code (128 + N for signal N) once it and everything it
    started have ended. SIGTERM, SIGINT and SIGHUP are passed to the child; if it has not exited
    `stop_grace_s` later it is killed."""
    subreaper = _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    stop_at: list[float] = []
    child = subprocess.Popen(cmd, preexec_fn=die_with_parent)

    def forward(signum, frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signum)
        if not stop_at:
            stop_at.append(time.monotonic() + stop_grace_s)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            pid, status = os.waitpid(-1 if subreaper else child.pid, os.WNOHANG)
        except ChildProcessError:  # the child was collected elsewhere; nothing left to wait for
            break
        if pid == child.pid:
            child.returncode = os.waitstatus_to_exitcode(status)
            break
        if pid == 0:
            if stop_at and time.monotonic() > stop_at[0]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGKILL)
            time.sleep(0.05)
    if subreaper:
        me = os.getpid()
        end_processes(lambda: descendants(me), reap=True)
    code = child.returncode if child.returncode is not None else 1
    return 128 - code if code < 0 else code


def end_without_teardown(code: int) -> None:
    """Exits with `code` as a normal exit would (threads joined, atexit handlers run, output flushed), less
    the module finalization."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can reach it
            pass
    os._exit(code)
