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
import threading
import time

import pytest
from conftest import wait_until
from runner_contracts.processes import ended
from runner_kit.prefork import ForkedProgram, Prefork, start_prefork

PROGRAM = textwrap.dedent("""
    import gc, json, os, signal, sys, time

    def main():
        request = sys.stdin.read()
        if request == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if request.startswith("sleep "):  # writes its pid to the file named, says so, and sleeps
            with open(request[6:], "w") as pid_file:
                pid_file.write(str(os.getpid()))
            print("asleep", flush=True)
            time.sleep(600)
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
    yield started, script
    started.process.kill()
    started.process.wait()


def run(launcher, script, stdin: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([str(launcher), str(script), "--flag"], input=stdin, capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "EPISODE": "e-7"}, timeout=60, start_new_session=True)


def test_the_program_runs_as_a_fork_of_the_server_with_its_own_argv_cwd_environment_stdio_and_a_frozen_heap(
        prefork, tmp_path):
    (server, launcher, _), script = prefork
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
    (server, launcher, _), script = prefork
    deadline = time.monotonic() + 30
    while json.loads(run(launcher, script, "", tmp_path).stdout)["ppid"] != server.pid:
        assert time.monotonic() < deadline, "the fork server never answered"
        time.sleep(0.2)
    assert run(launcher, script, "fail", tmp_path).returncode == 3
    assert run(launcher, script, "die", tmp_path).returncode == 128 + signal.SIGKILL


def answering(prefork, tmp_path) -> tuple[Prefork, object]:
    """The fork server, once it answers (the launcher starts the program plainly before that), and the script."""
    started, script = prefork
    wait_until(lambda: json.loads(run(started.launcher, script, "", tmp_path).stdout)["ppid"] == started.process.pid,
               "the fork server to answer", 30)
    return started, script


def forked(started: Prefork, script, stdin: str) -> tuple[ForkedProgram, str]:
    program = ForkedProgram(started, [str(script), "--flag"], env={**os.environ, "EPISODE": "e-8"})
    return program, program.communicate(stdin, timeout=60)[0]


def test_a_program_run_from_this_process_is_a_fork_of_the_server_without_a_launcher(prefork, tmp_path):
    started, script = answering(prefork, tmp_path)
    program, out = forked(started, script, "hello")
    said = json.loads(out)
    del said["frozen"]
    assert program.forked and program.returncode == 0
    assert said == {"argv": [str(script), "--flag"], "cwd": os.getcwd(), "episode": "e-8",
                    "ppid": started.process.pid, "stdin": "hello"}
    assert forked(started, script, "fail")[0].returncode == 3
    assert forked(started, script, "die")[0].returncode == 128 + signal.SIGKILL


def test_a_fork_server_refuses_a_program_it_does_not_run_and_says_so(prefork, tmp_path):
    started, _ = answering(prefork, tmp_path)
    other = tmp_path / "other.py"
    other.write_text("print('ran')")
    program = ForkedProgram(started, [str(other)], env=dict(os.environ))
    out, err = program.communicate(timeout=60)
    assert program.forked and program.returncode == 1 and out == ""
    assert f"this fork server runs {prefork[1]}, not ['{other}']" in err


def test_a_forked_program_outlives_a_timeout_loses_no_output_and_dies_when_killed(prefork, tmp_path):
    started, script = answering(prefork, tmp_path)
    pid_file = tmp_path / "sleeper.pid"
    program = ForkedProgram(started, [str(script)], env=dict(os.environ))
    with pytest.raises(subprocess.TimeoutExpired):
        program.communicate(f"sleep {pid_file}", timeout=1)
    pid = int(pid_file.read_text())
    assert program.poll() is None and not ended(pid)
    threading.Thread(target=program.kill).start()
    out, _ = program.communicate(timeout=30)
    assert out == "asleep\n" and program.returncode == -signal.SIGKILL
    wait_until(lambda: ended(pid), "the fork server to kill the program", 10)


def test_modules_run_as_python_m_would_run_them_and_any_other_command_line_on_the_real_interpreter(tmp_path):
    """The launcher of modules stands in for `sys.executable` where an upstream starts a server as `python -m
    MODULE` (verifiers' MCP tool servers): those command lines are forked, every other one runs plainly."""
    package = tmp_path / "pkg" / "served_tool"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "server.py").write_text(PROGRAM)
    for module in ("other", "unserved"):
        (package / f"{module}.py").write_text(PROGRAM)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "pkg")}
    started = start_prefork(tmp_path / "modules", ["served_tool.server", "served_tool.other"], ["json"], env=env)
    assert started is not None
    try:
        def served(argv: list[str]) -> dict:
            result = subprocess.run([str(started.launcher), *argv], input="hello", capture_output=True, text=True,
                                    cwd=tmp_path, env={**env, "EPISODE": "e-10"}, timeout=60)
            assert result.returncode == 0, result.stderr
            return json.loads(result.stdout)

        wait_until(lambda: served(["-m", "served_tool.server"])["ppid"] == started.process.pid,
                   "the fork server to answer", 30)
        for module in ("server", "other"):
            said = served(["-m", f"served_tool.{module}", "--flag"])
            del said["frozen"]
            assert said == {"argv": [str(package / f"{module}.py"), "--flag"], "cwd": str(tmp_path),
                            "episode": "e-10", "ppid": started.process.pid, "stdin": "hello"}
        assert served(["-m", "served_tool.unserved"])["ppid"] == os.getpid()  # a module it does not serve: plain
        plain = subprocess.run([str(started.launcher), "-c", "import os, sys; print(os.getppid(), sys.argv)"],
                               capture_output=True, text=True, timeout=60)
        assert plain.stdout.split(maxsplit=1) == [str(os.getpid()), "['-c']\n"], plain.stderr
    finally:
        started.process.kill()
        started.process.wait()


def test_a_program_starts_plainly_when_the_fork_server_does_not_answer(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    nobody = Prefork(process=None, launcher=tmp_path / "bin" / "python", address="\0runner-prefork-nobody-listens")
    program = ForkedProgram(nobody, [str(script)], env={**os.environ, "EPISODE": "e-9"})
    said = json.loads(program.communicate("plain", timeout=60)[0])
    assert not program.forked and program.returncode == 0
    assert (said["ppid"], said["episode"], said["stdin"], said["argv"]) == (os.getpid(), "e-9", "plain", [str(script)])


FLOOD = textwrap.dedent("""
    import os, sys

    if __name__ == "__main__":  # reads a little, writes more than a pipe holds, then reads the rest
        first = os.read(0, 4096)
        sys.stdout.write("x" * (1 << 20))
        sys.stdout.flush()
        sys.stderr.write(str(len(first) + len(sys.stdin.buffer.read())))
""")


def test_a_forked_program_that_writes_before_it_reads_does_not_deadlock(tmp_path):
    script = tmp_path / "flood.py"
    script.write_text(FLOOD)
    started = start_prefork(tmp_path / "flood", script, [])
    try:
        deadline = time.monotonic() + 30
        while True:  # until the fork server answers (a plain start before that)
            program, said = ForkedProgram(started, [str(script)], env=dict(os.environ)), []
            # on a thread: a deadlocked write would block past any timeout communicate was given
            talk = threading.Thread(target=lambda: said.extend(program.communicate("y" * (1 << 20), timeout=60)),
                                    daemon=True)
            talk.start()
            talk.join(90)
            assert not talk.is_alive(), "communicate deadlocked: blocked writing stdin while the program wrote"
            if program.forked or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert program.forked and program.returncode == 0
        assert (len(said[0]), said[1]) == (1 << 20, str(1 << 20))
    finally:
        started.process.kill()
        started.process.wait()


LOOKUP = textwrap.dedent("""
    import json, os
    from qualification.tasks import registry

    if __name__ == "__main__":  # what the server looked up before it forked, before this child asks
        print(json.dumps({"ppid": os.getppid(), "loaded": registry._load_family.cache_info().currsize,
                          "family": registry.get_family("calc-tool").name}))
""")


def test_warm_calls_run_once_in_the_server_and_a_failing_one_is_skipped(tmp_path):
    """`module:function` entries are called before the first fork (qualification.tasks:families loads every
    family, which a child would otherwise look up through every distribution's entry points); one that fails
    is logged and the server serves all the same."""
    script = tmp_path / "lookup.py"
    script.write_text(LOOKUP)
    started = start_prefork(tmp_path / "lookup", script, ["qualification.tasks:no_such_function",
                                                         "qualification.tasks:families"])
    try:
        said = {}
        wait_until(lambda: said.update(json.loads(ForkedProgram(started, [str(script)], env=dict(os.environ))
                                                  .communicate("", timeout=60)[0])) or
                   said["ppid"] == started.process.pid, "the fork server to answer", 30)
        assert said["loaded"] >= 4 and said["family"] == "calc-tool"
    finally:
        started.process.kill()
        started.process.wait()


CA_FILES = textwrap.dedent("""
    import json, os, ssl, sys

    def main():
        bundle, changed = sys.argv[1], sys.argv[2]
        loads = []
        load = ssl.SSLContext.load_verify_locations
        ssl.SSLContext.load_verify_locations = lambda self, *a, **k: (loads.append(a or k), load(self, *a, **k))[1]
        made = [ssl.create_default_context(cafile=bundle) for _ in range(3)]
        before = len(loads)
        fresh = ssl.create_default_context(cafile=changed)
        print(json.dumps({"ppid": os.getppid(), "loads": before, "changed_loads": len(loads) - before,
                          "stores": [context.cert_store_stats()["x509_ca"] for context in made],
                          "changed_store": fresh.cert_store_stats()["x509_ca"],
                          "distinct": len({id(context) for context in made}),
                          "verify": [context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
                                     for context in made]}))

    if __name__ == "__main__":
        main()
""")


def test_a_forked_program_gets_ca_contexts_the_server_loaded_from_an_unchanged_file(tmp_path, monkeypatch):
    """ssl.create_default_context(cafile=F) in a forked program: the first CA_CONTEXTS_PER_FILE come loaded
    from F by the fork server (no load in the program), the next is loaded as usual, all verify and trust the
    same certificates; a file changed since the server loaded it is loaded afresh."""
    import certifi
    from runner_kit.prefork import CA_CONTEXTS_PER_FILE

    bundle, changed = tmp_path / "bundle.pem", tmp_path / "changed.pem"
    pem = certifi.contents()
    bundle.write_text(pem)
    changed.write_text(pem)
    monkeypatch.setenv("SSL_CERT_FILE", str(changed))  # the server loads the files SSL_CERT_FILE and certifi name
    script = tmp_path / "ca.py"
    script.write_text(CA_FILES)
    started = start_prefork(tmp_path / "ca", script, ["certifi"])
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
    try:
        said = {}

        def ask() -> bool:
            said.update(json.loads(ForkedProgram(started, [str(script), str(certifi.where()), str(changed)],
                                                 env=dict(os.environ)).communicate("", timeout=60)[0]))
            return said["ppid"] == started.process.pid

        wait_until(ask, "the fork server to answer", 30)
        assert (said["changed_loads"], said["changed_store"]) == (0, pem.count("BEGIN CERTIFICATE"))
        changed.write_text(pem.split("-----END CERTIFICATE-----")[0] + "-----END CERTIFICATE-----\n")
        assert ask()
        assert said["loads"] == 3 - CA_CONTEXTS_PER_FILE  # certifi's bundle: loaded by the server, then by itself
        total = pem.count("BEGIN CERTIFICATE")
        assert said["stores"] == [total] * 3 and said["distinct"] == 3 and all(said["verify"])
        assert (said["changed_loads"], said["changed_store"]) == (1, 1)
    finally:
        started.process.kill()
        started.process.wait()
