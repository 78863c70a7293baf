"""Process plumbing an adapter needs for the servers it starts: a listening socket on 127.0.0.1, a child
that dies with the adapter, readiness waits, SIGKILL of a whole tree, restart after a crash.

The launcher already ends everything a stage started when the stage ends (runner_contracts.processes);
what is here keeps an adapter's own servers in step with the adapter while it runs.
"""

from __future__ import annotations

import gc
import os
import queue
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from runner_contracts.processes import (command_line, descendants, die_with_parent, kill_identified, kill_trees,
                                        process_table, same_process, tree)

HOST = "127.0.0.1"

__all__ = ["HOST", "ServerProcess", "SocketServer", "bind_loopback", "command_line", "descendants", "die_with_parent",
           "free_port", "freeze_heap", "kill_identified", "kill_trees", "process_table", "same_process", "spawn",
           "tree", "wait_until"]


def bind_loopback(port: int = 0, backlog: int = 256) -> socket.socket:
    """A listening TCP socket on 127.0.0.1: on `port` when it is free, else on a free one. Passing its file
    descriptor to a server (pass_fds) means the server cannot listen anywhere else, and the port is known
    before it starts."""
    for candidate in ([port] if port else []) + [0]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, candidate))
        except OSError:
            sock.close()
            continue
        sock.listen(backlog)
        return sock
    raise OSError(f"no free port on {HOST}")


def freeze_heap() -> None:
    """Takes every object alive now out of the cyclic collector's reach (gc.freeze): a full collection then
    walks only what was allocated since, not the imports. For a long-lived server once it has imported what it
    serves with, and for a fork server before each fork (its children inherit the frozen heap). Measured: NeMo
    Gym's model and agent servers, forked after importing NeMo Gym, each ran a ~0.3 s full collection in the
    middle of a train stage's rollouts; 5-13 ms with the heap frozen. Cyclic garbage that exists at the call is
    kept, not freed: a one-time cost, against a full collection now that would cost what it saves."""
    gc.freeze()


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago (for servers that only take a port number)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class _Spawner:
    """Starts children from one long-lived thread. PR_SET_PDEATHSIG fires when the *thread* that forked
    the child ends, and adapters restart servers from short-lived episode threads."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, name="runner-kit-spawner", daemon=True).start()

    def _loop(self) -> None:
        while True:
            future, args, kwargs = self._jobs.get()
            try:
                future.set_result(subprocess.Popen(*args, preexec_fn=die_with_parent, **kwargs))
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                future.set_exception(error)

    def popen(self, *args: Any, **kwargs: Any) -> subprocess.Popen:
        future: Future = Future()
        self._jobs.put((future, args, kwargs))
        return future.result()


_spawner: _Spawner | None = None
_spawner_lock = threading.Lock()


def spawn(*args: Any, **kwargs: Any) -> subprocess.Popen:
    """subprocess.Popen(*args, **kwargs) for a child that gets SIGKILL when this process exits, from any
    thread."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = _Spawner()
    return _spawner.popen(*args, **kwargs)


def wait_until(ready: Callable[[], bool], *, what: str, timeout_s: float,
               alive: Callable[[], bool] | None = None) -> None:
    """Polls `ready()` every 50 ms; raises RuntimeError when `alive()` turns false or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if alive is not None and not alive():
            raise RuntimeError(f"{what} exited before it was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s")
        time.sleep(0.05)


class ServerProcess:
    """An upstream server an adapter started as a subprocess: health, readiness, SIGKILL, stop.
    Subclasses set `name`, `health_path`, `url` and start `process` themselves (with `spawn`)."""

    name = "server"
    health_path = "/health"
    process: subprocess.Popen | None = None
    ready_timeout_s: float = 60.0

    @property
    def url(self) -> str:
        raise NotImplementedError

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.health_path, timeout=2) as response:
                return response.status == 200
        except (OSError, ValueError):
            return False

    def wait_ready(self) -> None:
        try:
            wait_until(self.healthy, what=f"{self.name} on {self.url}", timeout_s=self.ready_timeout_s,
                       alive=self.alive)
        except RuntimeError:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL the server and whatever it started."""
        if self.process is not None:
            if self.process.poll() is None:
                kill_trees([self.process.pid])
            self.process.wait()

    def stop(self, grace_s: float = 5.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self.process = None


class SocketServer(ServerProcess):
    """A server child that listens on a 127.0.0.1 socket bound here and passed as `--fd N` (the previous port
    when it is free again): it cannot listen anywhere else, and once it dies connections are refused, not
    queued. Subclasses give `command()` (without --fd) and may set `env`."""

    def __init__(self, ready_timeout_s: float = 60.0):
        self.ready_timeout_s = ready_timeout_s
        self.process: subprocess.Popen | None = None
        self.port = 0
        self.starts = 0
        self.env: dict[str, str] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        sock = bind_loopback(self.port)
        self.port = sock.getsockname()[1]
        try:
            self.process = spawn([*self.command(), "--fd", str(sock.fileno())], pass_fds=(sock.fileno(),),
                                 env=self.env, stdin=subprocess.DEVNULL)
        finally:
            sock.close()  # the child holds the only listening copy
        self.starts += 1
        self.wait_ready()
