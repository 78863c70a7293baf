"""Apptainer for real: Apptainer 1.4.5 from a sid root filesystem, run unprivileged (tests/apptainer_host.py,
the test harness that stands in for a cluster's own `apptainer`). trl's and openenv's images, built under the
test Docker Engine, become SIFs through `runner images export --to sif`. openenv's environment arm runs probe
and rollout from its SIF (the trainer's jobs from trl's, meeting on 127.0.0.1, the crash injected inside the
SIF); trl and openenv run every stage as a `runner compare` on the one-node Slurm, requeued mid-update. The
other stacks' images are qualified under Docker (test_containers.py): the SIF path is the same code for all.

Slow: the root filesystem (~50 s), each SIF (~1.5 min cold with lz4) and the images are cached under the
runner cache (SIFs by the digest of the image they were built from)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from apptainer_host import launcher, missing
from conftest import CALC_PLAN, rollout_tokens, stage_evidence
from container_daemons import copy_stacks
from container_daemons import missing as missing_tools

from runner._paths import cache_dir
from runner.api import get_stack

RUNNER = str(Path(sys.executable).parent / "runner")

pytestmark = pytest.mark.slow


SIF_ARMS = ["trl", "openenv"]  # the trainer, and the environment arm of the Slurm comparison and the arm test


def runner(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([RUNNER, *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "400", **(env or {})})


@pytest.fixture(scope="module")
def apptainer() -> Path:
    reason = missing() or missing_tools("dockerd", "debootstrap")
    if reason:
        pytest.skip(f"no Apptainer for these tests: {reason}")
    return launcher()


@pytest.fixture(scope="module")
def sif_env(apptainer, docker_engine, tmp_path_factory) -> dict[str, str]:
    """RUNNER_APPTAINER and RUNNER_SIF_DIR with the SIF of each stack in SIF_ARMS exported into it, and
    RUNNER_STACKS_DIR, a copy of the stacks (an export records the SIF's sha256 in pins.json; same contents,
    same image tags)."""
    sif_dir = cache_dir() / "sif"
    stacks = copy_stacks(tmp_path_factory.mktemp("apptainer") / "stacks")
    env = {"RUNNER_APPTAINER": str(apptainer), "RUNNER_SIF_DIR": str(sif_dir), "RUNNER_STACKS_DIR": str(stacks)}
    for stack in SIF_ARMS:
        result = runner("images", "export", "--stack", stack, "--to", "sif", "--out", str(sif_dir),
                        "--apptainer", str(apptainer), "--mksquashfs-args", "-comp lz4",
                        env={**env, "DOCKER_HOST": docker_engine})
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        assert f"sif: {sif_dir / (stack + '.sif')}" in result.stdout
    return env


def cluster_profile(sif_env: dict[str, str], folder: Path) -> Path:
    """A cluster profile naming the test harness's apptainer and the SIF folder."""
    profile = folder / "cluster.toml"
    profile.write_text(f'apptainer = "{sif_env["RUNNER_APPTAINER"]}"\nsif_dir = "{sif_env["RUNNER_SIF_DIR"]}"\n')
    return profile


def test_a_sifs_sha256_is_recorded_in_the_stacks_pins(sif_env):
    from runner._file_hashes import cached_sha256

    sif = Path(sif_env["RUNNER_SIF_DIR"]) / "openenv.sif"
    pins = json.loads((Path(sif_env["RUNNER_STACKS_DIR"]) / "openenv" / "pins.json").read_text())
    recorded = {tag: image for tag, image in pins["images"].items() if image["engine"] == "apptainer"}
    built_from = (sif.with_name(sif.name + ".image")).read_text()
    assert [image["digest"] for image in recorded.values()] == ["sha256:" + cached_sha256(sif)], recorded
    assert all(tag.endswith(".sif") for tag in recorded) and built_from.startswith("sha256:")


# One environment arm from its SIF: every stack's image is qualified by the docker suite (test_containers.py);
# a SIF export costs ~1.5 min per stack on 2 cores, which the suite's budget does not hold for all six.
@pytest.mark.parametrize("stack", ["openenv"])
def test_an_environment_arm_runs_from_its_sif_and_the_trainers(sif_env, local_comparison, stack, tmp_path):
    """The rollout service from the stack's SIF, the trainer's jobs from trl's, the crash injected inside the
    stack's SIF; the SIF's lock label is the stack's lock; the same tokens as the local engine's arm."""
    run_dir = tmp_path / stack
    result = runner("qualify", "--stack", stack, "--plan", str(CALC_PLAN), "--engine", "apptainer", "--stages",
                    "probe,rollout", "--run-dir", str(run_dir), "--json", env=sif_env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    probe = stage_evidence(run_dir, "probe")
    environment = probe["environment"]
    assert environment["engine"] == "apptainer" and environment["image"] == str(Path(sif_env["RUNNER_SIF_DIR"]) / f"{stack}.sif")
    assert environment["python"].startswith(get_stack(stack).python + ".")
    assert environment["deviations"] == list(get_stack(stack).deviations)  # none measured
    assert {gate["name"]: gate for gate in probe["gates"]}["probe:pins"]["passed"]
    recovery = stage_evidence(run_dir, "rollout")["metrics"]["recovery"]
    assert recovery["killed_pids"] and recovery["lost"] == 0
    assert rollout_tokens(run_dir) == rollout_tokens(local_comparison[0] / "arms" / stack)


def test_the_sifs_certificates_are_a_hashed_directory_read_lazily(sif_env):
    """What a job in a SIF gets as SSL_CERT_DIR (certificates.IMAGE_CERTIFICATES) is the image's CA directory,
    hashed by update-ca-certificates at build: an SSL context made from it has parsed no certificate yet
    (OpenSSL finds each CA by its subject hash when a handshake needs it)."""
    from runner._engines.certificates import IMAGE_CERTIFICATES
    from runner._engines.jobs import STACK_PREFIX

    code = ("import json, os, ssl; folder = os.environ['SSL_CERT_DIR']; "
            "context = ssl.create_default_context(capath=folder); "
            "print(json.dumps({'parsed': context.cert_store_stats()['x509_ca'], "
            "'hashed': sum(name.endswith('.0') for name in os.listdir(folder)), "
            "'bundle': os.environ.get('SSL_CERT_FILE')}))")
    sif = Path(sif_env["RUNNER_SIF_DIR"]) / "openenv.sif"
    result = subprocess.run([sif_env["RUNNER_APPTAINER"], "exec", "--containall", "--cleanenv",
                             *(f"--env={key}={value}" for key, value in IMAGE_CERTIFICATES.items()), str(sif),
                             str(STACK_PREFIX / "bin" / "python"), "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    said = json.loads(result.stdout.strip().splitlines()[-1])
    assert said["parsed"] == 0 and said["hashed"] > 100 and said["bundle"] is None, said


def test_a_killed_job_takes_its_sif_mount_with_it(sif_env, tmp_path):
    """Killing a job (its timeout, a kill condition, a service's stop) ends everything it started, Apptainer's
    squashfuse_ll included: Apptainer runs it in a session of its own, holding the container's SIF mount, so a
    kill of the job's process group alone left it running, orphaned, after the job."""
    from runner_contracts.processes import ended

    from runner._engines.jobs import run_process
    from runner_contracts.processes import command_line, descendants

    mounts: list[int] = []

    def mounted() -> bool:  # the kill condition: the container's SIF is mounted
        mounts.extend(pid for pid in descendants(os.getpid()) if command_line(pid).startswith("/usr/bin/squashfuse_ll"))
        return bool(mounts)

    sif = Path(sif_env["RUNNER_SIF_DIR"]) / "openenv.sif"
    outcome = run_process([sif_env["RUNNER_APPTAINER"], "exec", "--containall", "--cleanenv", str(sif), "sleep",
                           "120"], tmp_path, dict(os.environ), timeout_s=60, kill_when=mounted)
    assert outcome.killed and not outcome.timed_out, outcome
    assert mounts, "no squashfuse_ll ran below the job"
    time.sleep(0.5)
    assert [pid for pid in mounts if not ended(pid)] == []


def test_a_sif_is_checked_by_its_labels_before_any_job(apptainer, tmp_path, monkeypatch):
    """A SIF of another stack under a stack's name is refused naming both; a SIF's lock label is what the
    probe's pins gate compares with the stack's lock (a SIF built from another lock fails it)."""
    from runner._engines.apptainer import ApptainerEngine
    from runner._errors import EngineError
    folder = tmp_path / "sif"
    folder.mkdir()
    os.chmod(folder, 0o777)

    def labelled(name: str, labels: dict[str, str]) -> Path:
        definition = folder / f"{name}.def"
        definition.write_text("Bootstrap: scratch\n\n%labels\n" + "".join(f"    {k} {v}\n" for k, v in labels.items()))
        built = subprocess.run([str(apptainer), "build", "--force", str(folder / f"{name}.sif"), str(definition)],
                               capture_output=True, text=True)
        assert built.returncode == 0, built.stderr
        return folder / f"{name}.sif"

    monkeypatch.setenv("RUNNER_APPTAINER", str(apptainer))
    monkeypatch.setenv("RUNNER_SIF_DIR", str(folder))
    labelled("trl", {"runner.stack": "openenv", "runner.lock.sha256": "0" * 64})
    with pytest.raises(EngineError, match=r"trl.sif is not a runner image of the trl stack \(its runner.stack label "
                                          r"is 'openenv'\)"):
        ApptainerEngine().prepare(get_stack("trl"))
    labelled("trl", {"runner.stack": "trl", "runner.lock.sha256": "0" * 64})
    assert ApptainerEngine().prepare(get_stack("trl")).lock_sha256 == "0" * 64 != get_stack("trl").lock_sha256


def test_a_comparison_on_slurm_runs_from_the_sifs_survives_a_requeue_and_equals_the_local_one(
        cluster, sif_env, local_comparison, tmp_path):
    """`runner compare --stacks trl,openenv --executor slurm --engine apptainer`, every stage: each arm's sbatch
    job runs its stages' jobs through the profile's apptainer and SIF folder. The trl arm's job is requeued
    mid-train (scontrol requeue), resumes from the last complete checkpoint inside the SIF and passes the
    boundary audit; `runner status` follows the jobs; the comparison passes every gate of both arms, with the
    same plan, sampled tokens and trained weights as the session's comparison (local executor and engine)."""
    from conftest import wait_until

    profile = cluster_profile(sif_env, tmp_path)
    plan = CALC_PLAN  # four train steps: the job is requeued between two checkpoints
    run_dir = tmp_path / "compare"
    environment = {**cluster.env}
    submitted = runner("compare", "--stacks", "trl,openenv", "--plan", str(plan), "--executor", "slurm", "--engine",
                       "apptainer", "--cluster", str(profile), "--no-follow", "--run-dir", str(run_dir), "--json",
                       env=environment)
    assert submitted.returncode == 0, submitted.stdout[-2000:] + submitted.stderr[-2000:]
    jobs = {job["name"]: job["job_id"] for job in json.loads(submitted.stdout)["jobs"]}

    def status() -> dict:
        return json.loads(runner("status", str(run_dir), "--json", env=environment).stdout)

    def trl_job() -> dict:
        return next(job for job in status()["jobs"] if job["job_id"] == jobs["trl"])

    checkpoint = run_dir / "arms" / "trl" / "stages" / "train" / "checkpoints" / "checkpoint-1" / "COMPLETE"
    wait_until(lambda: checkpoint.is_file() or trl_job()["state"] not in ("PENDING", "RUNNING"),
               "the trl arm's first train checkpoint", 1200, poll_s=0.5)
    assert trl_job()["state"] == "RUNNING", trl_job()
    slurm_env = {**os.environ, **cluster.env}
    subprocess.run(["scontrol", "requeue", jobs["trl"]], check=True, env=slurm_env)
    # As in test_slurm: release the requeued job once the second of its requeue has passed.
    wait_until(lambda: trl_job()["reason"] == "BeginTime", "the requeued job to be pending", 60, poll_s=0.5)
    requeued_at = time.time()
    wait_until(lambda: time.time() >= requeued_at + 1.05, "the second of the requeue to pass", 5, poll_s=0.05)
    subprocess.run(["scontrol", "update", f"JobId={jobs['trl']}", "StartTime=now"], check=True, env=slurm_env)
    wait_until(lambda: status()["finished"], "the comparison's jobs to finish", 2400, poll_s=2)
    assert all(job["state"] == "COMPLETED" for job in status()["jobs"]), status()["jobs"]
    assert trl_job()["restarts"] >= 1
    comparison = json.loads((run_dir / "comparison.json").read_text())
    assert comparison["passed"], {arm["stack"]: arm["failed_gates"] for arm in comparison["arms"]}
    assert all(set(arm["gates"].values()) == {"passed"} and len(arm["gates"]) == 7 for arm in comparison["arms"])
    train = stage_evidence(run_dir / "arms" / "trl", "train")
    assert {"requeue:same-order", "requeue:same-tokens", "requeue:same-final-weights"} <= {g["name"] for g in train["gates"]}
    local_dir, local_data, _ = local_comparison
    assert comparison["plan_id"] == local_data["plan_id"]
    for stack in ("trl", "openenv"):  # every gate passed in both (above, and the session comparison's test)
        on_slurm, local = run_dir / "arms" / stack, local_dir / "arms" / stack
        for stage in ("rollout", "update", "train"):
            tokens = [[[s["token_ids"] for s in json.loads(line)["segments"]]
                       for line in (folder / "stages" / stage / "trajectories.jsonl").read_text().splitlines()]
                      for folder in (on_slurm, local)]
            assert tokens[0] == tokens[1], (stack, stage)
        weights = [[c["sha256"] for c in stage_evidence(folder, "train")["checkpoints"]] for folder in (on_slurm, local)]
        assert weights[0] and weights[0] == weights[1], stack
    probe = stage_evidence(run_dir / "arms" / "openenv", "probe")
    assert probe["environment"]["engine"] == "apptainer" and probe["environment"]["image"].endswith("/openenv.sif")
    # What a job could reach under --containall, as measured and reported: its inputs are read-only; the network
    # is the node's unless the site allows `--net` (here it reached pypi.org), and /tmp is Apptainer's private
    # one for the container (writable, discarded), unlike Docker's, so both read as reachable.
    for reach in (probe["metrics"]["reach"], probe["metrics"]["trainer"]["reach"]):
        assert reach["write_inputs"] is False and reach["inputs"]
        assert {"outbound_tcp", "write_outside_run_dir"} <= set(reach)
    recovery = stage_evidence(run_dir / "arms" / "openenv", "rollout")["metrics"]["recovery"]
    assert recovery["killed_pids"] and recovery["lost"] == 0  # the crash was injected inside openenv's SIF


def test_cancel_stops_an_arm_running_in_its_sifs_and_leaves_no_process(cluster, sif_env, tmp_path):
    """`runner cancel` on a Slurm + Apptainer arm mid-rollout: the job ends CANCELLED, the interrupted stage is
    marked (kept for --resume), and no process of the run is left on the node, inside a SIF or outside."""
    from conftest import leftover_processes, wait_until

    profile = cluster_profile(sif_env, tmp_path)
    run_dir = tmp_path / "cancelled"
    submitted = runner("qualify", "--stack", "openenv", "--plan", str(CALC_PLAN), "--executor", "slurm", "--engine",
                       "apptainer", "--cluster", str(profile), "--stages", "probe,service,rollout", "--no-follow",
                       "--run-dir", str(run_dir), "--json", env=cluster.env)
    assert submitted.returncode == 0, submitted.stdout[-2000:] + submitted.stderr[-2000:]
    wait_until(lambda: (run_dir / "stages" / "rollout" / "request.json").is_file(), "the rollout stage to start", 600)
    cancelled = runner("cancel", str(run_dir), env=cluster.env)
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout, cancelled.stdout + cancelled.stderr

    def status() -> dict:
        return json.loads(runner("status", str(run_dir), "--json", env=cluster.env).stdout)

    wait_until(lambda: status()["finished"], "the cancelled job to end", 120, poll_s=1)
    assert status()["jobs"][0]["state"] == "CANCELLED"
    assert stage_evidence(run_dir, "probe")["status"] == "passed"
    marked = stage_evidence(run_dir, "rollout")
    assert marked["status"] == "error" and marked["error"]["kind"] == "interrupted"
    with contextlib.suppress(AssertionError):  # Slurm's kill reaches the job's processes within seconds
        wait_until(lambda: not leftover_processes(run_dir), "the run's processes to be gone", 30, poll_s=0.5)
    assert leftover_processes(run_dir) == []
