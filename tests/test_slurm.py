"""The Slurm executor against a real one-node Slurm (tests/slurm_cluster.py: Debian's slurm-wlm + munge on
loopback, started and stopped here): a qualification submitted and followed, a failing job explained by
`runner status`, `runner cancel` and a resubmission with --resume, a job requeued mid-update that resumes
and passes the boundary audit. A comparison under Slurm equal to the local executor's is test_apptainer's
(its arms run from their SIFs).

Slow: each test runs the trl arm's early stages as Slurm jobs."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CALC_PLAN, stage_evidence, wait_until

RUNNER = str(Path(sys.executable).parent / "runner")
wait_for = functools.partial(wait_until, poll_s=0.5)  # most predicates run `runner status` (a process each)

pytestmark = pytest.mark.slow


def runner(cluster, *args: str, env: dict[str, str] | None = None, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([RUNNER, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "400", **cluster.env, **(env or {})})


def status(cluster, run_dir: Path) -> dict:
    return json.loads(runner(cluster, "status", str(run_dir), "--json").stdout)


def test_qualification_is_submitted_followed_and_its_evidence_collected(cluster, tmp_path):
    run_dir = tmp_path / "trl"
    result = runner(cluster, "qualify", "--stack", "trl", "--plan", str(CALC_PLAN), "--executor", "slurm",
                    "--stages", "probe,service", "--run-dir", str(run_dir), "--json")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    summary = json.loads(result.stdout)
    assert summary["stages"] == {"probe": "passed", "service": "passed"}
    assert (run_dir / "slurm" / "trl.sbatch").is_file() and list((run_dir / "slurm").glob("job-*.out"))
    jobs = status(cluster, run_dir)["jobs"]
    assert [(job["name"], job["state"]) for job in jobs] == [("trl", "COMPLETED")]
    # Once slurmctld has purged the job (MinJobAge after its end), squeue -j refuses its id; status must still
    # read how it ended (found by the soak loop: `runner status` exited 2 on a cancelled job purged in between).
    job_id = jobs[0]["job_id"]
    squeue = ["squeue", "-h", "-j", job_id]
    wait_for(lambda: "Invalid job id" in subprocess.run(squeue, capture_output=True, text=True,
                                                        env={**os.environ, **cluster.env}).stderr,
             "slurmctld to purge the finished job", 120)
    later = runner(cluster, "status", str(run_dir), "--json")
    assert later.returncode == 0, later.stderr
    assert [(job["name"], job["state"]) for job in json.loads(later.stdout)["jobs"]] == [("trl", "COMPLETED")]


def test_dry_run_writes_scripts_and_submits_nothing(cluster, tmp_path):
    result = runner(cluster, "compare", "--stacks", "trl,openenv", "--plan", str(CALC_PLAN), "--executor", "slurm",
                    "--dry-run", "--run-dir", str(tmp_path / "c"), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    jobs = json.loads(result.stdout)["jobs"]
    assert [job["name"] for job in jobs] == ["trl", "openenv", "report"] and all(job["job_id"] is None for job in jobs)
    assert json.loads((tmp_path / "c" / "plan.json").read_text())["plan_id"]
    queue = subprocess.run(["squeue", "-h"], capture_output=True, text=True, env={**os.environ, **cluster.env})
    assert queue.returncode == 0, queue.stderr  # an unanswered squeue must not pass as an empty queue
    assert queue.stdout.strip() == ""


def test_a_failing_job_shows_its_error_in_status(cluster, tmp_path):
    run_dir = tmp_path / "broken"
    result = runner(cluster, "qualify", "--stack", "trl", "--plan", str(CALC_PLAN), "--executor", "slurm",
                    "--engine", "docker", "--stages", "probe", "--run-dir", str(run_dir), "--json",
                    env={"DOCKER_HOST": f"unix://{tmp_path}/no-such-docker.sock"})
    assert result.returncode != 0
    job = status(cluster, run_dir)["jobs"][0]
    assert job["state"] == "FAILED", job
    assert "no docker engine answers" in job["error"], job


def test_cancel_stops_a_running_job_and_marks_its_stage_and_resume_continues_it(cluster, tmp_path):
    """What `runner status` recommends after a job that ended early: submit the arm again into its run
    directory with --resume; the stages that passed are kept, the interrupted one is set aside and rerun."""
    run_dir = tmp_path / "cancelled"
    first_stages = ("--stages", "probe,service,rollout")
    submitted = runner(cluster, "qualify", "--stack", "trl", "--plan", str(CALC_PLAN), "--executor", "slurm",
                       *first_stages, "--no-follow", "--run-dir", str(run_dir), "--json")
    assert submitted.returncode == 0, submitted.stderr[-2000:]
    wait_for(lambda: (run_dir / "stages" / "rollout" / "request.json").is_file(), "the rollout stage to start")
    cancelled = runner(cluster, "cancel", str(run_dir))
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout
    wait_for(lambda: status(cluster, run_dir)["finished"], "the cancelled job to end", 120)
    job = status(cluster, run_dir)["jobs"][0]
    assert job["state"] == "CANCELLED"
    assert stage_evidence(run_dir, "probe")["status"] == "passed"
    marked = stage_evidence(run_dir, "rollout")
    assert marked["status"] == "error" and marked["error"]["kind"] == "interrupted"
    assert runner(cluster, "status", str(run_dir)).returncode == 1
    probe_finished = stage_evidence(run_dir, "probe")["finished_at"]

    resumed = runner(cluster, "qualify", "--stack", "trl", "--plan", str(CALC_PLAN), "--executor", "slurm",
                     *first_stages, "--resume", "--run-dir", str(run_dir), "--json")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert json.loads(resumed.stdout)["stages"] == {"probe": "passed", "service": "passed", "rollout": "passed"}
    assert stage_evidence(run_dir, "probe")["finished_at"] == probe_finished  # kept, not run again
    set_aside = json.loads((run_dir / "stages" / "rollout.attempt-1" / "evidence.json").read_text())
    assert set_aside["error"]["kind"] == "interrupted"
    jobs = status(cluster, run_dir)["jobs"]
    assert [job["state"] for job in jobs] == ["COMPLETED"] and jobs[0]["job_id"] != json.loads(submitted.stdout)["jobs"][0]["job_id"]


def test_requeued_mid_update_resumes_from_the_checkpoint_and_passes_the_boundary_audit(cluster, tmp_path):
    plan = tmp_path / "plan.yaml"  # four update steps, so the job is requeued between two checkpoints
    plan.write_text(CALC_PLAN.read_text().replace("update_steps: 2", "update_steps: 4"))
    run_dir = tmp_path / "requeued"
    submitted = runner(cluster, "qualify", "--stack", "trl", "--plan", str(plan), "--executor", "slurm",
                       "--stages", "probe,update", "--no-follow", "--run-dir", str(run_dir), "--json")
    assert submitted.returncode == 0, submitted.stderr[-2000:]
    job_id = json.loads(submitted.stdout)["jobs"][0]["job_id"]
    wait_for(lambda: (run_dir / "stages" / "update" / "checkpoints" / "checkpoint-1" / "COMPLETE").is_file(),
             "the first update checkpoint")
    slurm_env = {**os.environ, **cluster.env}
    subprocess.run(["scontrol", "requeue", job_id], check=True, env=slurm_env)
    # Slurm holds a requeued job back for two minutes (BeginTime); an operator may release it early, but not
    # within the second of the requeue: slurmd revoked the killed attempt's credential at that second, a
    # launch credential made in the same second counts as revoked, and slurmctld then ends the job FAILED
    # ("Killing non-startable batch JobId=N: Job credential revoked"; seen here on an idle machine, where the
    # runner stops in 0.15 s and all of this fits in one second). test_slurm_golden covers what
    # `runner status` says then.
    wait_for(lambda: status(cluster, run_dir)["jobs"][0]["reason"] == "BeginTime", "the requeued job to be pending", 60)
    requeued_at = int(time.time())
    wait_until(lambda: time.time() >= requeued_at + 1.05, "the second of the requeue to pass", 5, poll_s=0.05)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True, env=slurm_env)
    def requeued_and_finished() -> bool:
        current = status(cluster, run_dir)
        return current["finished"] and current["jobs"][0]["restarts"] >= 1

    wait_for(requeued_and_finished, "the requeued job to finish", 900)
    job = status(cluster, run_dir)["jobs"][0]
    assert job["state"] == "COMPLETED", job
    attempt = json.loads((run_dir / "stages" / "update.attempt-1" / "evidence.json").read_text())
    assert attempt["error"]["kind"] == "interrupted"
    update = stage_evidence(run_dir, "update")
    gates = {g["name"]: g for g in update["gates"]}
    assert update["status"] == "passed", [g for g in update["gates"] if not g["passed"]]
    assert {"requeue:same-order", "requeue:same-tokens", "requeue:same-final-weights"} <= set(gates)
    assert update["metrics"]["requeue"]["resumed_from"].startswith("checkpoint-")
    assert stage_evidence(run_dir, "probe")["status"] == "passed"  # kept from the first attempt, not run again
    assert not (run_dir / "stages" / "probe.attempt-1").exists()
