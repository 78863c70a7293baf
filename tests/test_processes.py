"""Nothing a stage's job starts outlives it (runner_contracts.processes): real processes, a real adapter
entry that starts a grandchild in a session of its own (as Verifiers' MCP tool server is started), run by
the launcher exactly as the engines run it. Checked when the adapter returns, when it crashes, when the
host stops a service, and when the host itself is SIGKILLed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CALC_PLAN, leftover_processes, wait_until
from runner_contracts import StageRequest, write_record
from runner_contracts.processes import (JOB_TOKEN_VAR, command_line, descendants, end_job, end_processes, ended,
                                        kill_identified, kill_trees, same_process, tree)

from runner.api import load_plan, run_process, scrubbed_env, start_process_service

ADAPTER = '''
import json, os, subprocess, sys, time
from pathlib import Path
from runner_contracts import StageResult

def start_orphan(out_dir):
    """A grandchild in a new session whose parent exits at once: it is nobody's child but the subreaper's."""
    code = "import os, time; open('orphan.pid', 'w').write(str(os.getpid())); time.sleep(600)"
    middle = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', %r], start_new_session=True)" % code)
    subprocess.run([sys.executable, "-c", middle], cwd=out_dir, check=True)
    while not (Path(out_dir) / "orphan.pid").is_file():
        time.sleep(0.01)

def leak(request):
    start_orphan(request.out_dir)
    if request.options.get("crash"):
        raise RuntimeError("adapter crashed after starting a server")
    if request.options.get("hang"):
        time.sleep(600)
    return StageResult(stage=request.stage)

def tidy(request):
    """Leaves work to a normal exit: a thread still running, an atexit handler, unflushed output."""
    import atexit, threading
    out = Path(request.out_dir)
    def late():
        time.sleep(0.3)
        (out / "thread.done").write_text("joined")
    threading.Thread(target=late).start()
    atexit.register(lambda: (out / "atexit.done").write_text("ran"))
    print("an unflushed line", end="")
    return StageResult(stage=request.stage)

def full_collections_while_growing():
    """Makes 600k objects that stay alive, as an upstream's imports do; the full collections that ran meanwhile."""
    import gc
    before = gc.get_stats()[2]["collections"]
    kept = [[{"n": i}] for i in range(300_000)]
    return gc.get_stats()[2]["collections"] - before

def grow(request):
    (Path(request.out_dir) / "full_collections").write_text(str(full_collections_while_growing()))
    return StageResult(stage=request.stage)

def serve(request):
    start_orphan(request.out_dir)
    (Path(request.out_dir) / "service.json").write_text(json.dumps({"url": "http://127.0.0.1:1", "pid": os.getpid()}))
    time.sleep(600)
'''


@pytest.fixture
def adapter(tmp_path, monkeypatch):
    """The adapter module on the job's PYTHONPATH, and a request factory."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "leaky_adapter.py").write_text(ADAPTER)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plan = load_plan(CALC_PLAN)
    write_record(run_dir / "plan.json", plan)

    def job(stage: str, **options) -> tuple[list[str], Path, dict[str, str]]:
        out_dir = run_dir / "stages" / stage
        out_dir.mkdir(parents=True)
        request = write_record(out_dir / "request.json", StageRequest(
            run_id="run", stack="test", stage=stage, plan=plan, out_dir=str(out_dir), options=options))
        entry = {"serve": "leaky_adapter:serve", "tidy": "leaky_adapter:tidy", "grow": "leaky_adapter:grow"}.get(
            stage, "leaky_adapter:leak")
        env = {**scrubbed_env(Path(sys.executable).parent, out_dir / ".home"), "PYTHONPATH": str(package)}
        return [sys.executable, "-m", "runner_contracts.launch", entry, str(request)], out_dir, env

    job.run_dir = run_dir
    return job


def orphan_of(out_dir: Path) -> int:
    return int((out_dir / "orphan.pid").read_text())


@pytest.mark.parametrize("options", [{}, {"crash": True}], ids=["returns", "crashes"])
def test_a_job_ends_everything_it_started(adapter, options):
    cmd, out_dir, env = adapter("service", **options)
    outcome = run_process(cmd, out_dir, env, timeout_s=60)
    assert outcome.exit_code == (1 if options else 0), outcome.stderr.read_text()
    assert ended(orphan_of(out_dir))
    assert leftover_processes(adapter.run_dir) == []


def test_an_adapter_process_skips_only_the_interpreters_teardown(adapter):
    """The launcher's adapter process ends without finalizing its modules, but as a normal exit otherwise:
    its threads are joined, its atexit handlers run and its output is flushed."""
    cmd, out_dir, env = adapter("tidy")
    outcome = run_process(cmd, out_dir, env, timeout_s=60)
    assert outcome.exit_code == 0, outcome.stderr.read_text()
    assert (out_dir / "result.json").is_file()
    assert (out_dir / "thread.done").read_text() == "joined" and (out_dir / "atexit.done").read_text() == "ran"
    assert outcome.stdout.read_text() == "an unflushed line"


def test_an_adapter_start_runs_no_full_collection(adapter):
    """The objects an adapter's start makes live as long as the job: the launcher keeps CPython from scanning
    them all again each time they grow by a quarter (a plain interpreter runs several full collections here)."""
    cmd, out_dir, env = adapter("grow")
    plain = subprocess.run([sys.executable, "-c", "import leaky_adapter; print(leaky_adapter."
                            "full_collections_while_growing())"], env=env, capture_output=True, text=True, check=True)
    assert int(plain.stdout) > 0
    outcome = run_process(cmd, out_dir, env, timeout_s=60)
    assert outcome.exit_code == 0, outcome.stderr.read_text()
    assert (out_dir / "full_collections").read_text() == "0"


def test_a_timed_out_job_is_ended_with_what_it_started(adapter):
    cmd, out_dir, env = adapter("train", hang=True)
    outcome = run_process(cmd, out_dir, env, timeout_s=3)
    assert outcome.timed_out
    assert ended(orphan_of(out_dir)) and leftover_processes(adapter.run_dir) == []


def test_a_stopped_service_ends_what_it_started(adapter):
    cmd, out_dir, env = adapter("serve")
    service = start_process_service(cmd, out_dir, env, what="leaky service", ready_timeout_s=30)
    orphan = orphan_of(out_dir)
    assert not ended(orphan)
    service.stop()
    assert ended(orphan) and leftover_processes(adapter.run_dir) == []


HOST = '''
import json, sys
from pathlib import Path
from runner.api import run_process
cmd, out_dir, env = json.loads(sys.argv[1])
run_process(cmd, Path(out_dir), env, timeout_s=600)
'''


def test_a_sigkilled_host_leaves_nothing_behind(adapter):
    """The host (a process running a job as the engines do) is SIGKILLed mid-job: the job's supervisor
    gets SIGTERM from the kernel and ends the adapter and the orphan it started."""
    cmd, out_dir, env = adapter("train", hang=True)
    host = subprocess.Popen([sys.executable, "-c", HOST, json.dumps([cmd, str(out_dir), env])])
    wait_until(lambda: (out_dir / "orphan.pid").is_file(), "the adapter to start its server", 60)
    orphan = orphan_of(out_dir)
    host.send_signal(signal.SIGKILL)
    host.wait()
    wait_until(lambda: ended(orphan) and not leftover_processes(adapter.run_dir), "the job to end", 30)


def test_end_processes_ends_a_tree_that_ignores_sigterm(tmp_path):
    script = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
    parent = subprocess.Popen([sys.executable, "-c", script])
    wait_until(lambda: len(descendants(parent.pid)) == 1, "the grandchild to start", 30)
    tree = [parent.pid, *descendants(parent.pid)]
    started = time.monotonic()
    assert end_processes(lambda: [pid for pid in tree if not ended(pid)], grace_s=0.5) == 2
    parent.wait()
    assert all(ended(pid) for pid in tree) and time.monotonic() - started < 30


def test_a_tree_names_each_process_by_pid_and_start_time_and_kills_only_those_still_alive():
    """kill_identified ends the (pid, start time) it was given and leaves alone a pid whose start time differs,
    as a pid reused by a later process would."""
    script = ("import subprocess, sys, time; "
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        wait_until(lambda: len(tree(parent.pid)) == 2, "the child to start", 30)
        (top, top_start), (child, child_start) = tree(parent.pid)
        assert top == parent.pid and command_line(child).endswith("import time; time.sleep(600)")
        assert same_process(child, child_start) and not same_process(child, str(int(child_start) + 1))
        kill_identified([(top, str(int(top_start) + 1)), (child, child_start)])
        wait_until(lambda: ended(child), "the child to end", 30)
        assert parent.poll() is None and same_process(top, top_start), "a process of another start time was killed"
        assert not same_process(child, child_start) and command_line(child) == ""
    finally:
        parent.kill()
        parent.wait()
    assert tree(parent.pid) == []


def test_a_stop_signal_survives_a_burst_of_sigterms():
    """A graceful stop brings SIGTERM more than once (the group's and the supervisor's); the waiting
    process must stop with its own exit code however they land."""
    script = ("import sys; from runner_contracts.processes import StopSignal; stop = StopSignal(); "
              "print('ready', flush=True); sys.exit(100 + stop.wait())")
    for _ in range(20):
        process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert process.stdout.readline() == "ready\n"
        for _ in range(50):
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 100 + signal.SIGTERM


def _holding_memory(token: str) -> subprocess.Popen:
    """A process with 256 MB of touched memory: once killed, it frees that memory for tens of milliseconds
    after /proc/PID/environ has become unreadable and before it turns zombie."""
    code = ("b = bytearray(256 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint('ready', flush=True)\n"
            "import time; time.sleep(600)")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, JOB_TOKEN_VAR: token})
    assert process.stdout.readline() == "ready\n"
    return process


def test_killing_returns_only_once_the_processes_have_ended():
    """Both ways of ending what a job left wait for the exit itself, not only for the token to vanish
    (end_job once returned while a SIGKILLed process was still freeing its memory)."""
    killed = _holding_memory("kill-trees")
    kill_trees([killed.pid])
    assert ended(killed.pid), "kill_trees returned before the process had ended"
    killed.wait()
    left = _holding_memory("end-job")
    assert end_job("end-job", grace_s=5) == 1
    assert ended(left.pid), "end_job returned before the process had ended"
    left.wait()
