"""The host itself killed mid-comparison (SIGKILL of `runner compare`, local executor and engine): nothing it
started outlives it, and `runner compare --resume` continues, keeping the passed arm and stages and setting the
interrupted stage aside. Real stacks, real environment server; the shortest stages that exercise a service."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CALC_PLAN, leftover_processes, wait_until
from runner_contracts.processes import ended

pytestmark = pytest.mark.slow
RUNNER = str(Path(sys.executable).parent / "runner")


def test_a_killed_comparison_leaves_nothing_running_and_resumes(tmp_path):
    run_dir = tmp_path / "compare"
    cli = [RUNNER, "compare", "--stacks", "trl,openenv", "--plan", str(CALC_PLAN), "--stages", "probe,service",
           "--run-dir", str(run_dir), "--json"]
    host = subprocess.Popen(cli, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    service_dir = run_dir / "arms" / "openenv" / "stages" / "service"
    try:
        wait_until(lambda: (service_dir.is_dir() and leftover_processes(run_dir)) or host.poll() is not None,
                   "the openenv service stage to start its jobs", 900)
        assert host.poll() is None, "the comparison ended before the kill"
        started = leftover_processes(run_dir)
        os.kill(host.pid, signal.SIGKILL)
        host.wait()
        # A process on its way out can no longer be read (so it is no leftover) before its state says so.
        wait_until(lambda: not leftover_processes(run_dir) and all(ended(int(line.split(":")[0])) for line in started),
                   f"the killed host's jobs to end: {started}", 30)
    finally:
        if host.poll() is None:
            host.kill()
    trl_probe = (run_dir / "arms" / "trl" / "stages" / "probe" / "evidence.json").read_bytes()
    resumed = subprocess.run([*cli, "--resume"], capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = json.loads(resumed.stdout)
    assert result["passed"] and [arm["stack"] for arm in result["arms"]] == ["trl", "openenv"]
    assert (run_dir / "arms" / "trl" / "stages" / "probe" / "evidence.json").read_bytes() == trl_probe, \
        "a stage that passed before the kill is kept, not run again"
    aside = run_dir / "arms" / "openenv" / "stages" / "service.attempt-1"
    evidence = json.loads((aside / "evidence.json").read_text())
    assert evidence["status"] == "error" and evidence["error"]["kind"] == "interrupted"
    assert not leftover_processes(run_dir)
