"""The docker and podman engines against real engines started by the test harness (tests/container_daemons.py):
the trl stack's image built from a debootstrapped Debian base, a qualification in it up to the resume stage
(a container SIGKILLed mid-training and resumed; train and evaluate run the same job kinds again and are
left to the local comparison), token identity with the local engine, isolation, and drift of a pinned
version without a rebuild.

Slow: the first run makes the base (~40 s) and the trl image (~1.5 min); both are cached (image stores
under the runner cache) and reused by later runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from conftest import CALC_PLAN, rollout_tokens, stage_evidence
from container_daemons import copy_stacks, docker_daemon, missing, podman_service

ROOT = Path(__file__).resolve().parents[1]
RUNNER = str(Path(sys.executable).parent / "runner")

pytestmark = pytest.mark.slow


def runner(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([RUNNER, *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "400", **(env or {})})


def checked(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def docker_host(tmp_path_factory):
    """DOCKER_HOST of a dockerd started for this module, and RUNNER_STACKS_DIR of a copy of the stacks."""
    reason = missing("dockerd", "debootstrap")
    if reason:
        pytest.skip(f"no Docker Engine for the container tests: {reason}")
    with docker_daemon() as url:
        yield {"DOCKER_HOST": url, "RUNNER_STACKS_DIR": str(copy_stacks(tmp_path_factory.mktemp("d") / "stacks"))}


@pytest.fixture(scope="module")
def trl_image(docker_host) -> dict:
    return checked(runner("images", "build", "--stack", "trl", "--engine", "docker", "--json", env=docker_host))


@pytest.fixture(scope="module")
def docker_run(docker_host, trl_image, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("docker") / "trl"
    result = runner("qualify", "--stack", "trl", "--plan", str(CALC_PLAN), "--engine", "docker", "--stages",
                    "probe,service,rollout,update,resume", "--run-dir", str(run_dir), "--json", env=docker_host)
    summary = json.loads(result.stdout)
    assert result.returncode == 0, f"{summary['failed_gates']} {summary['errors']}\n{result.stderr[-3000:]}"
    return run_dir


def test_image_is_tagged_by_content_and_not_rebuilt(docker_host, trl_image):
    assert trl_image["tag"].startswith("runner-trl:") and trl_image["digest"].startswith("sha256:")
    again = runner("images", "build", "--stack", "trl", "--engine", "docker", "--json", env=docker_host)
    assert checked(again)["digest"] == trl_image["digest"]
    assert "building" not in again.stderr, again.stderr
    listed = checked(runner("images", "list", "--engine", "docker", "--json", env=docker_host))
    row = next(r for r in listed if r["tag"] == trl_image["tag"])
    assert row["upstream"] == "trl==1.16.0" and row["lock_sha256"] == trl_image["lock_sha256"]
    pins = json.loads((Path(docker_host["RUNNER_STACKS_DIR"]) / "trl" / "pins.json").read_text())
    assert pins["images"][trl_image["tag"]]["digest"] == trl_image["digest"]


def test_export_writes_a_docker_archive_and_says_how_to_build_the_sif(docker_host, trl_image, tmp_path):
    result = runner("images", "export", "--stack", "trl", "--to", "sif", "--image", trl_image["tag"], "--out",
                    str(tmp_path), env=docker_host)
    archive = tmp_path / (trl_image["tag"].replace(":", "-") + ".tar")
    with tarfile.open(archive) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))
    assert manifest[0]["RepoTags"] == [trl_image["tag"]]
    assert result.returncode == 2  # no Apptainer binary here: the archive is written, the SIF is not
    said = " ".join(result.stderr.split())
    assert "apptainer is not installed here" in said
    assert f"apptainer build --force {tmp_path / 'trl.sif'} docker-archive://{archive}" in said


def test_qualify_in_docker_passes_every_gate_with_image_stage_evidence(docker_run, trl_image):
    summary = json.loads((docker_run / "summary.json").read_text())
    assert summary["stages"] == dict.fromkeys(("probe", "service", "rollout", "update", "resume"), "passed")
    environment = stage_evidence(docker_run, "probe")["environment"]
    assert environment["engine"] == "docker"
    assert (environment["image"], environment["image_digest"]) == (trl_image["tag"], trl_image["digest"])
    assert environment["packages"]["trl"] == "1.16.0" and environment["packages"]["torch"].startswith("2.13.0")
    gates = {g["name"]: g for g in stage_evidence(docker_run, "probe")["gates"]}
    assert gates["probe:pins"]["passed"] and trl_image["digest"] in gates["probe:pins"]["detail"]


def test_container_isolation_blocks_network_and_input_writes(docker_run):
    """Measured inside the stack's container by its probe: no outbound connection, the policy (a
    read-only input) cannot be written, nothing outside the run directory either."""
    reach = stage_evidence(docker_run, "probe")["metrics"]["reach"]
    assert reach["inputs"], "the probe must have tried to write into the policy folder"
    assert reach["outbound_tcp"] is False
    assert reach["write_inputs"] is False
    assert reach["write_outside_run_dir"] is False


def test_docker_trajectories_are_token_identical_to_the_local_engine(docker_run, local_comparison):
    local = local_comparison[0] / "arms" / "trl"  # the session comparison's trl arm: local engine, same plan
    in_docker, on_host = rollout_tokens(docker_run), rollout_tokens(local)
    budget = yaml.safe_load(CALC_PLAN.read_text())["budget"]
    assert len(in_docker) == budget["prompts_per_step"] * budget["generations_per_prompt"]
    assert in_docker == on_host


def test_changed_pin_without_rebuild_fails_the_probe_naming_the_package(docker_host, trl_image, docker_run, tmp_path):
    stacks = copy_stacks(tmp_path / "stacks")
    lock = stacks / "trl" / "requirements.lock"
    lock.write_text(lock.read_text().replace("PyYAML==6.0.4", "PyYAML==6.0.3"))
    env = {**docker_host, "RUNNER_STACKS_DIR": str(stacks)}
    # The policy by path (the one the docker run used): the tiny-policy builder is the trl stack, and
    # its changed lock would otherwise mean a new builder environment and a new policy.
    policy = json.loads((docker_run / "plan.json").read_text())["policy"]["path"]
    plan = tmp_path / "plan.yaml"
    plan.write_text(CALC_PLAN.read_text().replace("kind: tiny", f"kind: path\n  path: {policy}"))

    check = runner("pin", "--check", "--stack", "trl", "--json", env=env)
    assert check.returncode == 1
    assert any("sha256" in line for line in json.loads(check.stdout)["drift"]["trl"])

    result = runner("qualify", "--stack", "trl", "--plan", str(plan), "--engine", "docker", "--image",
                    trl_image["tag"], "--stages", "probe", "--run-dir", str(tmp_path / "run"), "--json", env=env)
    assert result.returncode == 1, result.stderr[-2000:]
    gates = {g["name"]: g for g in stage_evidence(tmp_path / "run", "probe")["gates"]}
    assert not gates["probe:lock-match"]["passed"]
    assert "pyyaml: locked 6.0.3, installed 6.0.4" in gates["probe:lock-match"]["detail"]
    assert not gates["probe:pins"]["passed"] and "was built from lock" in gates["probe:pins"]["detail"]


def test_podman_engine_runs_the_same_image_definition(tmp_path):
    reason = missing("podman", "debootstrap")
    if reason:
        pytest.skip(f"no Podman for the container tests: {reason}")
    with podman_service() as url:
        env = {"RUNNER_PODMAN_HOST": url, "RUNNER_STACKS_DIR": str(copy_stacks(tmp_path / "stacks"))}
        image = checked(runner("images", "build", "--stack", "trl", "--engine", "podman", "--json", env=env))
        run_dir = tmp_path / "podman"
        # The engine's own parts (build, run, mounts, isolation, a service in the container) need no more
        # than probe and service; sampling and training in a container are the docker run's.
        result = runner("qualify", "--stack", "trl", "--plan", str(CALC_PLAN), "--engine", "podman", "--stages",
                        "probe,service", "--run-dir", str(run_dir), "--json", env=env)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    probe = stage_evidence(run_dir, "probe")
    assert probe["environment"]["engine"] == "podman" and probe["environment"]["image_digest"] == image["digest"]
    reach = probe["metrics"]["reach"]
    assert (reach["outbound_tcp"], reach["write_inputs"], reach["write_outside_run_dir"]) == (False, False, False)


def test_environment_arm_in_docker_talks_to_its_service_over_loopback_only(docker_host, local_comparison, tmp_path):
    """openenv's rollout service runs in its own container, the trl trainer jobs join that container's
    network namespace; both show no outbound network, and the episodes equal the local engine's."""
    run_dir = tmp_path / "openenv"
    result = runner("qualify", "--stack", "openenv", "--plan", str(CALC_PLAN), "--engine", "docker", "--stages",
                    "probe,service,rollout", "--run-dir", str(run_dir), "--json", env=docker_host)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    probe = stage_evidence(run_dir, "probe")
    assert probe["environment"]["image"].startswith("runner-openenv:")
    for reach in (probe["metrics"]["reach"], probe["metrics"]["trainer"]["reach"]):
        assert (reach["outbound_tcp"], reach["write_inputs"]) == (False, False)
    recovery = stage_evidence(run_dir, "rollout")["metrics"]["recovery"]
    assert recovery["killed_pids"] and recovery["lost"] == 0  # killed inside the service's container
    assert rollout_tokens(run_dir) == rollout_tokens(local_comparison[0] / "arms" / "openenv")


@pytest.mark.parametrize("stack", ["nemo-gym", "verifiers", "lightning-verl", "skyrl-gym"])
def test_every_environment_stack_runs_its_arm_from_its_own_image(docker_host, local_comparison, stack, tmp_path):
    """The other four stacks' images, each on the base that has its Python (lightning-verl: Ubuntu noble's
    3.12; nemo-gym: Debian sid's 3.13, which satisfies its declared >=3.13.14, so the deviation its local
    environment on 3.13.0 records is gone): digest written to pins.json, probe, service and rollout with the
    crash injected in the container, and the same tokens as the local engine's arm."""
    from runner.api import get_stack

    image = checked(runner("images", "build", "--stack", stack, "--engine", "docker", "--json", env=docker_host))
    pins = json.loads((Path(docker_host["RUNNER_STACKS_DIR"]) / stack / "pins.json").read_text())
    assert pins["images"][image["tag"]]["digest"] == image["digest"]
    run_dir = tmp_path / stack
    result = runner("qualify", "--stack", stack, "--plan", str(CALC_PLAN), "--engine", "docker", "--stages",
                    "probe,service,rollout", "--run-dir", str(run_dir), "--json", env=docker_host)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    environment = stage_evidence(run_dir, "probe")["environment"]
    assert environment["image_digest"] == image["digest"]
    assert environment["python"].startswith(get_stack(stack).python + ".") and environment["deviations"] == []
    recovery = stage_evidence(run_dir, "rollout")["metrics"]["recovery"]
    assert recovery["killed_pids"] and recovery["lost"] == 0
    assert rollout_tokens(run_dir) == rollout_tokens(local_comparison[0] / "arms" / stack)


def test_a_native_asset_runs_in_its_stacks_container(docker_host, tmp_path):
    """The team's OpenEnv environment (examples/native/openenv-rechner), built on the host into its cached
    folder and mounted read-only into the openenv container with its dataset copy: the service stage runs its
    answer key there, its own tools and reward."""
    run_dir = tmp_path / "native"
    plan = ROOT / "examples" / "native" / "openenv-rechner" / "plan.yaml"
    result = runner("qualify", "--stack", "openenv", "--plan", str(plan), "--engine", "docker", "--stages",
                    "probe,service", "--run-dir", str(run_dir), "--json", env=docker_host)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    probe = stage_evidence(run_dir, "probe")
    assert probe["environment"]["engine"] == "docker" and probe["environment"]["image"].startswith("runner-openenv:")
    cases = [json.loads(line) for line in (run_dir / "stages" / "service" / "service.jsonl").read_text().splitlines()]
    native = {c["case"]: c for c in cases if json.loads(c["item"])["family"] == "rechner"}
    assert native["tool-then-answer"]["tool_calls"][0]["result"] == "2" and native["wrong-answer"]["stack_reward"] == 0.0
