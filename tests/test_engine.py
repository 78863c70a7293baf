"""The local engine against a real virtualenv: a minimal stack whose lock pins only msgspec.

The adapter here is a test double for a stack (it drives no upstream package); the engine, venv,
pip, process groups and timeouts are all real.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest
from conftest import self_signed_certificate, stand_in_checkpoint, wait_until
from runner_contracts import StageRequest, StageResult, read_record
from runner_contracts.processes import ended
from test_contracts import PLAN

from runner._engines.local import ENV_MARKER, LocalEngine
from runner._pins import record_lock
from runner.api import load_manifest, load_plan

# The echo stack's lock, hashed as every lock is (the engine installs in pip's hash-checking mode).
ECHO_LOCK = ("msgspec==0.23.0 --hash=sha256:2e514e5b2a23e376f545f4962834b7312d9400705627c53330116b46daddfbe3\n"
             "setuptools==84.2.1 --hash=sha256:ca140b45d5325a9478f880e351484f62fef15f336462e449ca0c03c873d589c2\n")
ADAPTER = '''
import json, os, time
from pathlib import Path
from runner_contracts import StageResult

def run(request):
    if request.stage == "sleep":
        Path("child.pid").write_text(str(os.getpid()))
        time.sleep(600)
    if request.stage == "fail":
        raise ValueError("the adapter refused: bad option")
    if request.stage == "serve":  # a service on 127.0.0.1 that stops cleanly on SIGTERM
        import socket, threading
        from runner_contracts.processes import StopSignal
        server = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=lambda: [server.accept()[0].close() for _ in iter(int, 1)], daemon=True).start()
        stop = StopSignal()
        Path("service.json").write_text(json.dumps({"url": f"http://127.0.0.1:{server.getsockname()[1]}"}))
        stop.wait()
        return StageResult(stage="serve")
    if request.stage == "reach":  # what a job can reach: the network, files outside its folder, its inputs
        import socket, tempfile

        def connects(host, port):
            try:
                socket.create_connection((host, port), timeout=3).close()
                return True
            except OSError:
                return False

        def try_write(path):
            try:
                path.write_text("out")
                return True
            except OSError:
                return False

        def writes(folder):
            try:
                tempfile.NamedTemporaryFile(dir=folder).close()
                return True
            except OSError:
                return False

        peer = request.options.get("peer_port")
        if writes("/tmp") and not os.path.samefile("/tmp", os.environ["TMPDIR"]):
            raise RuntimeError("/tmp is the host's, writable")
        return StageResult(stage="reach", metrics={
            "outbound": connects("1.1.1.1", 443), "peer": peer is not None and connects("127.0.0.1", peer),
            "var_tmp": writes("/var/tmp"), "policy": writes(request.policy_dir), "own_folder": writes("."),
            "tmpdir": writes(os.environ["TMPDIR"]), "home": writes(os.environ["HOME"]),
            "escaped": try_write(Path.cwd().parent / f"escaped-{Path.cwd().name}")})
    if request.plan.name == "exit-without-result":  # a misbehaving stack
        os._exit(0)
    if request.plan.name == "hang":
        time.sleep(600)
    if request.plan.name == "malformed-trajectory":  # a record missing its fields, then one cut off mid-line
        Path("trajectories.jsonl").write_text('{"contract": "trajectory", "version": 1, "run_id": "r"}\\n{"contr')
        return StageResult(stage=request.stage)
    if request.plan.name == "fill-the-disk" and (Path(request.policy_dir) / "fill-the-disk").exists():
        with open("trajectories.jsonl.partial", "wb", buffering=0) as out:  # until not one byte is left
            for size in (1 << 16, 1 << 10, 1):
                try:
                    while True:
                        out.write(b"x" * size)
                except OSError:
                    pass
        raise OSError(28, "No space left on device", "trajectories.jsonl.partial")
    if request.stage == "probe":
        import importlib.metadata, platform
        from runner_contracts import EnvironmentInfo
        packages = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions()}
        return StageResult(stage="probe", capabilities=["cpu"], environment=EnvironmentInfo(
            engine="", python=platform.python_version(), packages=packages))
    Path("env.json").write_text(json.dumps(dict(os.environ)))
    if os.path.isdir(os.environ.get("SSL_CERT_DIR", "")):
        Path("certificates.json").write_text(json.dumps(sorted(os.listdir(os.environ["SSL_CERT_DIR"]))))
    return StageResult(stage=request.stage, metrics={"cwd": os.getcwd()})
'''


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("stacks") / "echo"
    (root / "adapter" / "src" / "echo_adapter").mkdir(parents=True)
    (root / "adapter" / "src" / "echo_adapter" / "__init__.py").write_text(ADAPTER)
    (root / "adapter" / "pyproject.toml").write_text(textwrap.dedent('''
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "runner-stack-echo"
        version = "0.0.1"
        [tool.setuptools.packages.find]
        where = ["src"]
    '''))
    (root / "requirements.lock").write_text(ECHO_LOCK)
    (root / "stack.toml").write_text(textwrap.dedent('''
        name = "echo"
        description = "test double stack"
        python = "3.11"
        lock = "requirements.lock"
        adapter = "echo_adapter:run"
        adapter_package = "adapter"
        stages = ["probe", "rollout"]
        capabilities = ["cpu"]
        [upstream]
        name = "msgspec"
        version = "0.23.0"
    '''))
    manifest = load_manifest(root / "stack.toml")
    record_lock(manifest, resolver="test fixture")  # the probe's pins gate needs a pin record
    return manifest


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return LocalEngine(cache_root=tmp_path_factory.mktemp("cache"))


def request(stage: str, out: Path) -> StageRequest:
    return StageRequest(run_id="r", stack="echo", stage=stage, plan=load_plan(PLAN), out_dir=str(out))


def test_environment_is_built_once_and_reused(stack, engine):
    env = engine.prepare(stack)
    marker = (env.path / ENV_MARKER).stat().st_mtime_ns
    again = engine.prepare(stack)
    assert again.path == env.path and (again.path / ENV_MARKER).stat().st_mtime_ns == marker
    assert env.path.name == f"echo-{engine.environment_key(stack, env.python_version)}"


def test_changed_lock_gets_a_new_environment_key(stack, engine, tmp_path):
    lock = tmp_path / "requirements.lock"
    lock.write_text(stack.lock.read_text() + "# changed\n")
    import dataclasses

    changed = dataclasses.replace(stack, lock=lock)
    assert engine.environment_key(changed, "3.11.7") != engine.environment_key(stack, "3.11.7")


def test_adapter_runs_in_its_folder_with_a_scrubbed_environment(stack, engine, tmp_path, monkeypatch):
    """Host variables stay out; the host's CA bundle comes in as a hashed directory the sandboxed job can read,
    though it lies under /tmp, which the sandbox replaces with the job's own."""
    monkeypatch.setenv("SECRET_TOKEN", "do-not-leak")
    if shutil.which("openssl"):
        bundle = self_signed_certificate(tmp_path, "host-ca")[0]
        monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
        monkeypatch.setenv("RUNNER_CACHE_DIR", str(tmp_path / "cache"))
    else:
        print("no openssl CLI: the job gets SSL_CERT_FILE as the host gives it, and that is not checked here")
    env = engine.prepare(stack)
    out = tmp_path / "echo"
    outcome = engine.run(env, request("echo", out), timeout_s=60)
    assert outcome.ok
    result = read_record(out / "result.json", StageResult)
    assert Path(result.metrics["cwd"]) == out
    seen = json.loads((out / "env.json").read_text())
    assert "SECRET_TOKEN" not in seen
    assert seen["HF_HUB_OFFLINE"] == "1" and seen["HOME"].startswith(str(out))
    if shutil.which("openssl"):
        assert "SSL_CERT_FILE" not in seen
        assert Path(seen["SSL_CERT_DIR"]).parent == tmp_path / "cache" / "ca-certificates"
        listed = json.loads((out / "certificates.json").read_text())
        assert "0000.pem" in listed and any(name.endswith(".0") for name in listed)


def test_a_job_runs_where_the_host_names_no_certificates(stack, engine, tmp_path, monkeypatch):
    """Without SSL_CERT_FILE or SSL_CERT_DIR the job gets OpenSSL's default directory when it is hashed (a
    symlink, /usr/lib/ssl/certs -> /etc/ssl/certs, on Debian and Ubuntu), which it reads where it is."""
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    out = tmp_path / "echo"
    outcome = engine.run(engine.prepare(stack), request("echo", out), timeout_s=60)
    assert outcome.ok, outcome.stderr.read_text()[-2000:]
    seen = json.loads((out / "env.json").read_text())
    assert "SSL_CERT_FILE" not in seen
    default = ssl.get_default_verify_paths().openssl_capath
    if seen.get("SSL_CERT_DIR"):
        assert seen["SSL_CERT_DIR"] == default and json.loads((out / "certificates.json").read_text())
    else:
        print(f"OpenSSL's default directory {default} holds no hashed certificates here: the job gets none")


def test_adapter_failure_becomes_a_result_with_error(stack, engine, tmp_path):
    env = engine.prepare(stack)
    out = tmp_path / "fail"
    outcome = engine.run(env, request("fail", out), timeout_s=60)
    assert outcome.exit_code == 1
    result = read_record(out / "result.json", StageResult)
    assert result.error.kind == "ValueError" and "bad option" in result.error.message
    assert "Traceback" in outcome.stderr.read_text()


def test_timeout_kills_the_process_group(stack, engine, tmp_path):
    env = engine.prepare(stack)
    out = tmp_path / "sleep"
    outcome = engine.run(env, request("sleep", out), timeout_s=3)
    assert outcome.timed_out and not outcome.ok
    assert ended(int((out / "child.pid").read_text()))


def test_probe_gate_names_the_drifted_package(stack, engine, tmp_path):
    """A real drift: a different msgspec is installed into the built environment after the fact."""

    env = engine.prepare(stack)
    policy = stand_in_checkpoint(tmp_path / "policy")
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.read_text().replace("  kind: tiny ", f"  path: {policy}\n  kind: path "))
    cli = [str(Path(sys.executable).parent / "runner"), "qualify", "--stack", "echo", "--plan", str(plan),
           "--stages", "probe", "--json"]
    environ = {**os.environ, "RUNNER_STACKS_DIR": str(stack.folder.parent),
               "RUNNER_CACHE_DIR": str(engine.root.parent), "COLUMNS": "300"}
    clean = subprocess.run([*cli, "--run-dir", str(tmp_path / "clean")], capture_output=True, text=True, env=environ)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    subprocess.run([str(env.python), "-m", "pip", "install", "-q", "--no-deps", "msgspec==0.22.0"], check=True,
                   capture_output=True)
    try:
        drifted = subprocess.run([*cli, "--run-dir", str(tmp_path / "drifted")], capture_output=True, text=True,
                                 env=environ)
        assert drifted.returncode == 1
        evidence = json.loads((tmp_path / "drifted" / "stages" / "probe" / "evidence.json").read_text())
        gate = next(g for g in evidence["gates"] if g["name"] == "probe:lock-match")
        assert not gate["passed"] and "msgspec: locked 0.23.0, installed 0.22.0" in gate["detail"]
    finally:
        subprocess.run([str(env.python), "-m", "pip", "install", "-q", "--no-deps", "msgspec==0.23.0"], check=True,
                       capture_output=True)


def test_adapter_dies_with_the_runner(stack, engine, tmp_path):
    """SIGKILL the host process: its adapter must not outlive it (parent-death signal)."""
    import time

    engine.prepare(stack)  # built here, so the killed runner below only starts the adapter
    out = tmp_path / "orphan"
    script = (f"from runner._engines.local import LocalEngine; from runner._stacks import load_manifest; "
              f"from test_engine import request; from pathlib import Path; "
              f"e = LocalEngine(cache_root=Path({str(engine.root.parent)!r})); "
              f"env = e.prepare(load_manifest(Path({str(stack.folder / 'stack.toml')!r}))); "
              f"e.run(env, request('sleep', Path({str(out)!r})), timeout_s=600)")
    host = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parent)
    pid_file = out / "child.pid"
    deadline = time.monotonic() + 60
    while not pid_file.is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(pid_file.read_text())
    host.kill()
    host.wait()
    wait_until(lambda: ended(child), "the adapter to end with the runner", 10)


def _prepare_in_a_process(stack, cache: Path, **popen):
    """Another runner process preparing the echo stack's environment in `cache`; it prints the engine's log."""

    script = (f"from runner._engines.local import LocalEngine; from runner._stacks import load_manifest; "
              f"from pathlib import Path; "
              f"e = LocalEngine(cache_root=Path({str(cache)!r}), log=lambda m: print(m, flush=True)); "
              f"print('ready', e.prepare(load_manifest(Path({str(stack.folder / 'stack.toml')!r}))).path)")
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, **popen)


def test_two_runners_preparing_one_environment_build_it_once(stack, tmp_path):
    cache = tmp_path / "cache"
    first, second = _prepare_in_a_process(stack, cache), _prepare_in_a_process(stack, cache)
    outputs = [process.communicate(timeout=600)[0] for process in (first, second)]
    assert [process.returncode for process in (first, second)] == [0, 0], outputs
    assert sum(output.count("building echo environment") for output in outputs) == 1, outputs
    paths = {line.split(" ", 1)[1] for output in outputs for line in output.splitlines() if line.startswith("ready")}
    assert len(paths) == 1 and (Path(paths.pop()) / ENV_MARKER).is_file()


def test_a_build_killed_half_way_is_rebuilt_not_used(stack, tmp_path):
    import time

    cache = tmp_path / "cache"
    killed = _prepare_in_a_process(stack, cache)
    python = None
    deadline = time.monotonic() + 120
    while python is None and time.monotonic() < deadline:  # the virtualenv exists; the lock is installing
        python = next(iter(cache.glob("envs/echo-*/bin/python")), None) if cache.exists() else None
        time.sleep(0.05)
    assert python is not None, "the build never started"
    killed.kill()
    killed.wait()
    env_dir = python.parent.parent
    assert not (env_dir / ENV_MARKER).exists(), "the build finished before it could be killed"
    again = _prepare_in_a_process(stack, cache)
    output = again.communicate(timeout=600)[0]
    assert again.returncode == 0 and "building echo environment" in output, output
    assert (env_dir / ENV_MARKER).is_file()


def test_an_adapter_that_exits_0_without_a_result_fails_its_stage(stack, engine, tmp_path):

    engine.prepare(stack)
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN.read_text().replace("name: calc-tool-cpu", "name: exit-without-result").replace(
        "  kind: tiny ", f"  path: {stand_in_checkpoint(tmp_path / 'policy')}\n  kind: path "))
    result = subprocess.run([str(Path(sys.executable).parent / "runner"), "qualify", "--stack", "echo", "--plan",
                             str(plan), "--stages", "probe", "--run-dir", str(tmp_path / "run"), "--json"],
                            capture_output=True, text=True, env={**os.environ, "RUNNER_STACKS_DIR": str(stack.folder.parent),
                                                                 "RUNNER_CACHE_DIR": str(engine.root.parent)})
    assert result.returncode == 1, result.stderr
    evidence = json.loads((tmp_path / "run" / "stages" / "probe" / "evidence.json").read_text())
    assert evidence["status"] == "error" and evidence["error"]["kind"] == "missing-result"
    assert "exited 0 without writing" in evidence["error"]["message"] and "Traceback" not in result.stderr


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs mounted for the test (needs root in this mount namespace); unmounted afterwards."""

    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()}): the full-disk test needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_during_a_stage_is_one_line_keeps_every_file_and_resumes(stack, engine, tmp_path, small_disk):

    plan = echo_plan(stack, engine, tmp_path, "fill-the-disk")
    (tmp_path / "policy" / "fill-the-disk").touch()  # inside an input: the only host paths a sandboxed job sees
    run_dir = small_disk / "run"

    def qualify(*extra: str) -> subprocess.CompletedProcess:
        return qualify_echo(stack, engine, plan, run_dir, "probe", *extra)

    full = qualify()
    assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr
    assert "no space left on the run directory's disk" in full.stderr and "--resume" in full.stderr, full.stderr
    stage = run_dir / "stages" / "probe"
    assert (stage / "DISK-FULL").is_file()
    assert json.loads((run_dir / "plan.json").read_text())["name"] == "fill-the-disk"  # written before: intact
    kept = (stage / "trajectories.jsonl.partial").stat().st_size
    assert kept > 3_000_000  # the adapter's partial output is kept, not cleaned up
    assert not list(stage.glob(".*.tmp"))  # no half-written twin of a file runner tried to write

    # Space freed (the tmpfs grown, as a user would clean up elsewhere): --resume sets the stage aside.
    (tmp_path / "policy" / "fill-the-disk").unlink()
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    resumed = qualify("--resume")
    assert resumed.returncode == 0, resumed.stderr
    aside = run_dir / "stages" / "probe.attempt-1"
    assert (aside / "trajectories.jsonl.partial").stat().st_size == kept
    evidence = json.loads((aside / "evidence.json").read_text())
    assert evidence["error"]["kind"] == "interrupted" and "the disk filled up" in evidence["error"]["message"]
    assert json.loads((stage / "evidence.json").read_text())["status"] == "passed"


def test_local_jobs_run_sandboxed_and_a_peer_shares_only_its_loopback(stack, engine, tmp_path):
    from runner._engines.sandbox import local_sandbox

    if local_sandbox().bwrap is None:
        pytest.skip(f"no sandbox on this machine: {local_sandbox().why}")
    env = engine.prepare(stack)
    policy = stand_in_checkpoint(tmp_path / "policy")
    service = engine.start_service(env, request("serve", tmp_path / "service"), ready_timeout_s=60)
    try:
        port = int(service.url.rsplit(":", 1)[1])
        reached = {}
        for name, peer in (("alone", None), ("with-peer", service)):
            job = msgspec.structs.replace(request("reach", tmp_path / name), policy_dir=str(policy),
                                          options={"peer_port": port})
            assert engine.run(env, job, timeout_s=60, peer=peer).ok
            reached[name] = read_record(tmp_path / name / "result.json", StageResult).metrics
    finally:
        assert service.stop() == 0  # a graceful stop reaches the job inside the sandbox: its own exit code
    writable = {"own_folder": True, "tmpdir": True, "home": True}
    for name, peer in (("alone", False), ("with-peer", True)):
        escaped = reached[name].pop("escaped")
        assert reached[name] == {"outbound": False, "peer": peer, "var_tmp": False, "policy": False, **writable}
        # Each job's folder is its run directory here (no plan.json above it): a write beside it, where
        # /tmp is the job's own, lands in the job's TMPDIR if anywhere, never on the host.
        assert not (tmp_path / f"escaped-{name}").exists(), escaped


def test_without_bubblewrap_jobs_run_as_plain_processes_and_say_so(monkeypatch):
    from runner._engines import sandbox

    sandbox.local_sandbox.cache_clear()
    monkeypatch.setenv("PATH", "/nonexistent")
    try:
        found = sandbox.local_sandbox()
        assert found.bwrap is None
        assert found.command(["true"], run_dir=Path("/r"), cwd=Path("/r"), tmp=Path("/t"), read_only=[]) == ["true"]
        assert found.describe() == "none (jobs run as plain processes: bwrap not found; install the bubblewrap package)"
    finally:
        sandbox.local_sandbox.cache_clear()


def test_a_malformed_trajectory_file_fails_its_stage_naming_file_line_and_field(stack, engine, tmp_path):
    """An adapter that writes a trajectory record missing its fields: the stage fails with the file, the line
    and the field, one line, no traceback; the file stays for the post-mortem."""
    run_dir = tmp_path / "run"
    result = qualify_echo(stack, engine, echo_plan(stack, engine, tmp_path, "malformed-trajectory"), run_dir, "rollout")
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr, result.stderr
    stage = run_dir / "stages" / "rollout"
    evidence = json.loads((stage / "evidence.json").read_text())
    assert evidence["status"] == "error" and evidence["error"]["kind"] == "contract-violation", evidence
    message = evidence["error"]["message"]
    assert "trajectories.jsonl:1" in message and "`stack`" in message, message  # the first field missing
    assert (stage / "trajectories.jsonl").read_text().startswith('{"contract": "trajectory"')


def test_a_stage_that_hangs_ends_at_the_plans_wall_clock(stack, engine, tmp_path):
    """A job that never returns: the stage's jobs together get budget.wall_clock_s, then the job's process
    group is killed and the stage fails as a timeout, a few seconds later at most."""
    run_dir = tmp_path / "run"
    result = qualify_echo(stack, engine, echo_plan(stack, engine, tmp_path, "hang", wall_clock_s=3), run_dir, "rollout")
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr, result.stderr
    evidence = json.loads((run_dir / "stages" / "rollout" / "evidence.json").read_text())
    assert evidence["error"]["kind"] == "timeout" and "3 s per stage" in evidence["error"]["message"], evidence
    took = dt.datetime.fromisoformat(evidence["finished_at"]) - dt.datetime.fromisoformat(evidence["started_at"])
    assert took.total_seconds() < 3 + 30  # the deadline plus the kill and the audit, not the job's 600 s


def echo_plan(stack, engine, tmp_path: Path, name: str, **budget: float) -> Path:
    """The calc-tool plan under another name (the echo adapter's behaviour switch) on a stand-in checkpoint."""
    engine.prepare(stack)
    policy = stand_in_checkpoint(tmp_path / "policy")
    text = PLAN.read_text().replace("name: calc-tool-cpu", f"name: {name}").replace(
        "  kind: tiny ", f"  path: {policy}\n  kind: path ")
    for key, value in budget.items():
        text = re.sub(rf"(?m)^  {key}: .*$", f"  {key}: {value}", text)
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    return plan


def qualify_echo(stack, engine, plan: Path, run_dir: Path, stages: str, *extra: str) -> subprocess.CompletedProcess:
    """`runner qualify --stack echo` with the test's stack folder and cache."""
    return subprocess.run([str(Path(sys.executable).parent / "runner"), "qualify", "--stack", "echo", "--plan",
                           str(plan), "--stages", stages, "--run-dir", str(run_dir), *extra],
                          capture_output=True, text=True,
                          env={**os.environ, "RUNNER_STACKS_DIR": str(stack.folder.parent),
                               "RUNNER_CACHE_DIR": str(engine.root.parent)})
