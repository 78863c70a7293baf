"""The kit's fork server (runner_kit.prefork): a program run per episode through its launcher is a fork of
the pre-imported server, with its own argv, cwd, environment and stdio, and the launcher exits as the
program did; the child inherits the server's heap frozen (a full collection in it skips the imports); from a
run directory deeper than a Unix socket path may be long."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time

import pytest
from runner_kit.prefork import start_prefork

PROGRAM = textwrap.dedent("""
    import gc, json, os, signal, sys

    def main():
        request = sys.stdin.read()
        if request == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "episode": os.environ.get("EPISODE"),
                          "ppid": os.getppid(), "stdin": request, "frozen": gc.get_freeze_count()}))
        sys.exit(3 if request == "fail" else 0)

    if __name__ == "__main__":  # the server imports the program's top level before it forks
        main()
""")


@pytest.fixture
def prefork(tmp_path):
    deep = tmp_path / ("run-directory-" * 8) / "service" / ".home" / "tmp"  # > 108 bytes with a socket name
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    started = start_prefork(deep, script, ["json"])
    assert started is not None and len(str(deep)) > 108
    server, launcher = started
    yield server, launcher, script
    server.kill()
    server.wait()


def run(launcher, script, stdin: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([str(launcher), str(script), "--flag"], input=stdin, capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "EPISODE": "e-7"}, timeout=60, start_new_session=True)


def test_the_program_runs_as_a_fork_of_the_server_with_its_own_argv_cwd_environment_stdio_and_a_frozen_heap(
        prefork, tmp_path):
    server, launcher, script = prefork
    deadline = time.monotonic() + 30
    while True:  # until the server listens (the launcher falls back to a plain start before that)
        result = run(launcher, script, "hello", tmp_path)
        said = json.loads(result.stdout)
        if said["ppid"] == server.pid or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    frozen = said.pop("frozen")
    assert said == {"argv": [str(script), "--flag"], "cwd": str(tmp_path), "episode": "e-7", "ppid": server.pid,
                    "stdin": "hello"}
    assert frozen > 10_000, f"only {frozen} objects frozen: the server's imports should be out of the collector's reach"
    assert result.returncode == 0


def test_the_launcher_exits_as_the_program_did(prefork, tmp_path):
    server, launcher, script = prefork
    deadline = time.monotonic() + 30
    while json.loads(run(launcher, script, "", tmp_path).stdout)["ppid"] != server.pid:
        assert time.monotonic() < deadline, "the fork server never answered"
        time.sleep(0.2)
    assert run(launcher, script, "fail", tmp_path).returncode == 3
    assert run(launcher, script, "die", tmp_path).returncode == 128 + signal.SIGKILL
