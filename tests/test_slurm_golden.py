"""Golden tests of the Slurm executor's rendered sbatch scripts: a GPU arm under Apptainer with the
example cluster profile, a CPU comparison under the local engine, and the report job. Paths and the
submitting environment are fixed so the files are stable. Regenerate after a reviewed change with
UPDATE_GOLDEN=1."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest
from conftest import matches_golden
from runner_contracts import freeze_plan

from runner._executors.sbatch import (
    ArmJob,
    ClusterProfile,
    load_profile,
    render_arm,
    render_report,
)
from runner.api import UserError, load_plan

ROOT = Path(__file__).resolve().parents[1]
ENVIRON = {"HOME": "/home/ada", "LANG": "C.UTF-8", "PATH": "/usr/bin:/bin", "RUNNER_CACHE_DIR": "/shared/cache",
           "SECRET_TOKEN": "never-exported"}


def plan(gpus: int):
    frozen = freeze_plan(load_plan(ROOT / "qualification" / "plans" / "calc-tool-cpu.yaml"))
    budget = msgspec.structs.replace(frozen.budget, gpus=gpus, wall_clock_s=3600.0)
    return freeze_plan(msgspec.structs.replace(frozen, budget=budget, plan_id=None))


def test_golden_gpu_arm_under_apptainer_with_the_example_profile():
    profile = load_profile(ROOT / "clusters" / "example-h100.toml")
    job = ArmJob(stack="openenv", arm_dir=Path("/shared/runs/c1/arms/openenv"), plan_file=Path("/shared/runs/c1/plan.json"),
                 engine="apptainer")
    script = render_arm(job, plan(gpus=1), profile, command="compare", environ=ENVIRON)
    for line in ("#SBATCH --partition=gpu-h100", "#SBATCH --constraint=h100", "#SBATCH --gres=gpu:h100:1",
                 "#SBATCH --requeue", "#SBATCH --signal=B:TERM@300", "#SBATCH --export=NONE",
                 "module load apptainer/1.3.4", "export RUNNER_APPTAINER=apptainer",
                 "export RUNNER_APPTAINER_BINDS=/shared/models:/scratch", "--engine apptainer", "--resume"):
        assert line in script, line
    assert "SECRET_TOKEN" not in script
    matches_golden("slurm_arm_gpu_apptainer.sbatch", script)


def test_golden_cpu_arm_under_the_local_engine():
    profile = ClusterProfile(partition="cpu", runner="/opt/runner/bin/runner", workdir="/opt/runner/src")
    job = ArmJob(stack="trl", arm_dir=Path("/shared/runs/r1"), plan_file=Path("/shared/runs/r1/plan.json"),
                 engine="local", stages=("probe", "update"))
    script = render_arm(job, plan(gpus=0), profile, command="qualify", environ=ENVIRON)
    assert "--gres" not in script and "#SBATCH --cpus-per-task=2" in script and "--stages probe,update" in script
    matches_golden("slurm_arm_cpu_local.sbatch", script)


def test_golden_report_job():
    profile = ClusterProfile(partition="cpu", runner="/opt/runner/bin/runner", workdir="/opt/runner/src")
    script = render_report(Path("/shared/runs/c1"), ["trl", "openenv"], plan(gpus=0), profile, environ=ENVIRON)
    matches_golden("slurm_report.sbatch", script)


def test_profile_errors_name_the_file_and_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('partition = "x"\ngpus_syntax = "gpu"\n')
    with pytest.raises(UserError, match=r"bad.toml:2: unknown key\(s\) gpus_syntax"):
        load_profile(bad)
    bad.write_text('partition = "x"\ngres = "gpu:h100"\n')
    with pytest.raises(UserError, match=r"field gres: expected a pattern with \{gpus\}"):
        load_profile(bad)


def test_the_gpu_plan_renders_one_gpu_apptainer_job_per_arm(tmp_path):
    """qualification/plans/calc-tool-gpu.yaml through `runner compare --executor slurm --dry-run`: the
    checkpoint is given by path (a stand-in file here: nothing loads it in a dry run); each arm asks for one
    H100 and runs under Apptainer, where lightning-verl's training jobs use its GPU environment's SIF."""
    import json
    import subprocess
    import sys

    from conftest import stand_in_checkpoint

    checkpoint = stand_in_checkpoint(tmp_path / "Qwen2.5-0.5B-Instruct", b"stand-in weights")
    plan_file = tmp_path / "calc-tool-gpu.yaml"
    plan_file.write_text((ROOT / "qualification" / "plans" / "calc-tool-gpu.yaml").read_text()
                         .replace("/shared/models/Qwen2.5-0.5B-Instruct", str(checkpoint)))
    result = subprocess.run([str(Path(sys.executable).parent / "runner"), "compare", "--stacks", "trl,lightning-verl",
                             "--plan", str(plan_file), "--executor", "slurm", "--engine", "apptainer",
                             "--cluster", str(ROOT / "clusters" / "example-h100.toml"), "--dry-run",
                             "--run-dir", str(tmp_path / "c"), "--json"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert [job["job_id"] for job in json.loads(result.stdout)["jobs"]] == [None, None, None]  # 2 arms + report
    script = (tmp_path / "c" / "slurm" / "lightning-verl.sbatch").read_text()
    assert "#SBATCH --gres=gpu:h100:1" in script and "#SBATCH --cpus-per-task=16" in script
    assert "--engine apptainer" in script and "RUNNER_SIF_DIR=/shared/runner/sif" in script
    frozen = json.loads((tmp_path / "c" / "plan.json").read_text())
    assert frozen["budget"]["gpus"] == 1 and frozen["policy"]["path"] == str(checkpoint)


def _row(state: str, restarts: int, exit_code: str = "1:0") -> dict:
    return {"state": state, "restarts": restarts, "exit_code": exit_code, "reason": ""}


def _interrupted_update(finished_at: str):
    from runner_contracts import ErrorInfo, Evidence
    return {"probe": Evidence(run_id="r", stack="trl", stage="probe", plan_id="p", status="passed", started_at="2026-12-01T07:51:00+00:00",
                              finished_at="2026-12-01T07:52:00+00:00"),
            "update": Evidence(run_id="r", stack="trl", stage="update", plan_id="p", status="error", started_at="2026-12-01T07:52:30+00:00",
                               finished_at=finished_at, error=ErrorInfo(kind="interrupted", message="stopped"))}


def test_status_tells_a_requeued_attempt_from_the_one_before(tmp_path):
    """An arm's log holds one line per attempt (arm.sbatch prints it first); the job's final state belongs to
    attempt restarts+1, and the evidence an earlier attempt left is not that attempt's error."""
    from runner._executors.slurm import _first_error, read_attempts

    log = tmp_path / "job-4.out"
    log.write_text("runner: job 4 attempt 1 started on node1 at 2026-12-01T07:52:10+00:00\n"
                   "slurmstepd-node1: error: *** JOB 4 ON node1 CANCELLED AT 2026-12-01T07:53:48 DUE TO JOB REQUEUE ***\n")
    attempts, last = read_attempts(log)
    assert [(a.number, a.host) for a in attempts] == [(1, "node1")] and "DUE TO JOB REQUEUE" in last[0]
    never = _first_error(_interrupted_update("2026-12-01T07:53:48+00:00"), attempts, last, _row("FAILED", 1))
    assert never.startswith("attempt 2 (after 1 requeue(s)) never started: Slurm ended the job FAILED (exit code 1:0")

    log.write_text(log.read_text() + "runner: job 4 attempt 2 started on node1 at 2026-12-01T07:54:00+00:00\n"
                   "error: run directory /r: holds plan abc, not def\n")
    attempts, last = read_attempts(log)
    silent = _first_error(_interrupted_update("2026-12-01T07:53:48+00:00"), attempts, last, _row("FAILED", 1, "2:0"))
    assert silent == ("attempt 2 ended FAILED (exit code 2:0) before writing stage evidence: "
                      "error: run directory /r: holds plan abc, not def")
    # The same interruption written by the last attempt is its error.
    own = _first_error(_interrupted_update("2026-12-01T07:55:00+00:00"), attempts, last, _row("CANCELLED", 1))
    assert own == "update: interrupted: stopped"
    assert _first_error(_interrupted_update("2026-12-01T07:53:48+00:00"), attempts, last, _row("COMPLETED", 1, "0:0")) is None


def test_secrets_are_passed_by_name_never_written_into_a_script(tmp_path):
    """A token and an index URL with credentials named in env_allow reach the job through sbatch --export
    from the submitting shell; the script names them and holds neither value."""
    profile = dataclasses.replace(load_profile(None), env_allow=("HF_TOKEN", "PIP_INDEX_URL", "LANG"))
    environ = {"HF_TOKEN": "hf_secretvalue123", "PIP_INDEX_URL": "https://lab:hunter2@pypi.lab.example/simple",
               "LANG": "C.UTF-8"}
    script = render_report(Path("/shared/runs/c1"), ["trl", "openenv"], plan(gpus=0), profile, environ=environ)
    assert "hf_secretvalue123" not in script and "hunter2" not in script
    assert "export LANG=C.UTF-8" in script
    assert "sbatch --export=HF_TOKEN,PIP_INDEX_URL)" in script
    leaky = dataclasses.replace(profile, env={"LAB_API_KEY": "k-123"})
    with pytest.raises(UserError, match="env LAB_API_KEY holds a secret"):
        render_report(Path("/shared/runs/c1"), ["trl"], plan(gpus=0), leaky, environ=environ)


def test_secrets_in_job_logs_are_redacted(tmp_path, monkeypatch):
    from runner._secrets import redact_file

    monkeypatch.setenv("LAB_SERVICE_TOKEN", "tok-0123456789")
    log = tmp_path / "stderr.log"
    log.write_text("auth with tok-0123456789\nfetching https://lab:hunter2@pypi.lab.example/simple/torch\n")
    redact_file(log)
    assert log.read_text() == ("auth with [redacted]\nfetching https://[redacted]@pypi.lab.example/simple/torch\n")
