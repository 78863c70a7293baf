"""The docker and podman engines against real engines started by the test harness (tests/container_daemons.py):
the trl stack's image built from a debootstrapped Debian base, its probe and resume stages in a container
(a container SIGKILLed mid-training and resumed; train and evaluate run the same job kinds again and are
left to the local comparison), isolation, and drift of a pinned version without a rebuild; every stack's
image compared under docker up to the first update, with the local engine's tokens and weights; Podman
builds and runs the same definition (every stack with RUNNER_TEST_ALL_ENGINES=1, `make test-engines`).

Slow: the first run makes the three bases (~45 s each) and the six images (~9 min in all); they are cached
(image stores under the runner cache) and reused by later runs. The session's dockerd (conftest.docker_engine)
starts building them as the session begins, when the docker comparison is selected (ImagesInBackground)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import CALC_PLAN, COMPARED_ARMS, rollout_tokens, stage_evidence
from container_daemons import copy_stacks, missing, podman_service

from runner.api import get_stack

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
def docker_host(docker_engine, tmp_path_factory):
    """DOCKER_HOST of the session's dockerd, and RUNNER_STACKS_DIR of a copy of the stacks."""
    return {"DOCKER_HOST": docker_engine, "RUNNER_STACKS_DIR": str(copy_stacks(tmp_path_factory.mktemp("d") / "stacks"))}


@pytest.fixture(scope="module")
def trl_image(docker_host) -> dict:
    return checked(runner("images", "build", "--stack", "trl", "--engine", "docker", "--json", env=docker_host))


@pytest.fixture(scope="module")
def docker_run(docker_host, trl_image, tmp_path_factory) -> Path:
    """trl's probe and resume in its container (a container SIGKILLed mid-training and resumed); the other stages
    of every arm in a container are the docker comparison's."""
    run_dir = tmp_path_factory.mktemp("docker") / "trl"
    result = runner("qualify", "--stack", "trl", "--plan", str(CALC_PLAN), "--engine", "docker", "--stages",
                    "probe,resume", "--run-dir", str(run_dir), "--json", env=docker_host)
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
    assert summary["stages"] == dict.fromkeys(("probe", "resume"), "passed")
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


@pytest.fixture(scope="module")
def podman_host(tmp_path_factory):
    """RUNNER_PODMAN_HOST of a Podman service started for this module, and RUNNER_STACKS_DIR of a copy of the stacks."""
    reason = missing("podman", "debootstrap")
    if reason:
        pytest.skip(f"no Podman for the container tests: {reason}")
    with podman_service() as url:
        yield {"RUNNER_PODMAN_HOST": url, "RUNNER_STACKS_DIR": str(copy_stacks(tmp_path_factory.mktemp("p") / "stacks"))}


def test_podman_engine_runs_the_same_image_definition(podman_host, tmp_path):
    image = checked(runner("images", "build", "--stack", "trl", "--engine", "podman", "--json", env=podman_host))
    run_dir = tmp_path / "podman"
    # The engine's own parts (build, run, mounts, isolation, a service in the container) need no more
    # than probe and service; sampling and training in a container are the docker run's.
    result = runner("qualify", "--stack", "trl", "--plan", str(CALC_PLAN), "--engine", "podman", "--stages",
                    "probe,service", "--run-dir", str(run_dir), "--json", env=podman_host)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    probe = stage_evidence(run_dir, "probe")
    assert probe["environment"]["engine"] == "podman" and probe["environment"]["image_digest"] == image["digest"]
    reach = probe["metrics"]["reach"]
    assert (reach["outbound_tcp"], reach["write_inputs"], reach["write_outside_run_dir"]) == (False, False, False)


ALL_ENGINES = "RUNNER_TEST_ALL_ENGINES"


@pytest.mark.skipif(not os.environ.get(ALL_ENGINES), reason=(
    f"{ALL_ENGINES}=1 (`make test-engines`) builds the five other stack images under Podman too and compares "
    "every stack there: ~15 min more than CI's 60-minute budget holds; the docker suite runs every stack's image"))
def test_every_stack_qualifies_from_its_own_podman_image(podman_host, tmp_path):
    """Each stack's image built by Podman from the same definition, then `runner compare` of every stack under
    podman on the stages up to the first update: every gate passes, each arm from its own image."""
    images = {stack: checked(runner("images", "build", "--stack", stack, "--engine", "podman", "--json", env=podman_host))
              for stack in COMPARED_ARMS}
    run_dir = tmp_path / "podman-compare"
    result = runner("compare", "--stacks", ",".join(COMPARED_ARMS), "--plan", str(CALC_PLAN), "--engine", "podman",
                    "--stages", "probe,service,rollout,update", "--run-dir", str(run_dir), "--json", env=podman_host)
    assert checked(result)["passed"]
    for stack in COMPARED_ARMS:
        environment = stage_evidence(run_dir / "arms" / stack, "probe")["environment"]
        assert (environment["engine"], environment["image_digest"]) == ("podman", images[stack]["digest"])
        assert environment["deviations"] == list(get_stack(stack).deviations)


DOCKER_STAGES = ("probe", "rollout", "update")


@pytest.fixture(scope="module")
def docker_comparison(docker_host, tmp_path_factory) -> tuple[Path, dict, dict]:
    """`runner images build` for every stack (each on the base with its Python: lightning-verl on Ubuntu noble's
    3.12, nemo-gym on Debian sid's 3.13), then `runner compare` of every stack under docker on the stages up to
    the first update, without the service stage (the shortest that exercise each arm's container path: probe,
    rollout with the injected crash, one update; the trl run above covers resume in a container, and the native
    asset's test below the service stage)."""
    images = {stack: checked(runner("images", "build", "--stack", stack, "--engine", "docker", "--json", env=docker_host))
              for stack in COMPARED_ARMS}
    run_dir = tmp_path_factory.mktemp("docker-compare")
    result = runner("compare", "--stacks", ",".join(COMPARED_ARMS), "--plan", str(CALC_PLAN), "--engine", "docker",
                    "--stages", ",".join(DOCKER_STAGES), "--run-dir", str(run_dir), "--json", env=docker_host)
    return run_dir, checked(result), images


def test_every_stack_qualifies_from_its_own_image_as_it_does_on_the_host(docker_host, docker_comparison, local_comparison):
    """Every arm passes every gate from its image, with its image's digest in pins.json and no deviation from
    its upstream's declared Python (the local nemo-gym environment on 3.13.0 has one); environment arms' services
    run in their own containers, the trainer's jobs join their network namespace (loopback only, no outbound
    network for either), the crash is injected in the service's container, and the sampled tokens and the
    updated weights are the local engine's, byte for byte."""
    run_dir, data, images = docker_comparison
    assert data["passed"] and [arm["stack"] for arm in data["arms"]] == COMPARED_ARMS
    assert "(a subset: the other stages' figures are blank)" in (run_dir / "comparison.md").read_text()
    for stack in COMPARED_ARMS:
        in_docker, local = run_dir / "arms" / stack, local_comparison[0] / "arms" / stack
        probe = stage_evidence(in_docker, "probe")
        environment = probe["environment"]
        assert (environment["engine"], environment["image"], environment["image_digest"]) == \
            ("docker", images[stack]["tag"], images[stack]["digest"])
        pins = json.loads((Path(docker_host["RUNNER_STACKS_DIR"]) / stack / "pins.json").read_text())
        assert pins["images"][images[stack]["tag"]]["digest"] == images[stack]["digest"]
        assert environment["python"].startswith(get_stack(stack).python + ".")
        assert environment["deviations"] == list(get_stack(stack).deviations)  # none measured
        reaches = [probe["metrics"]["reach"]] + ([probe["metrics"]["trainer"]["reach"]] if stack != "trl" else [])
        assert all((reach["outbound_tcp"], reach["write_inputs"]) == (False, False) for reach in reaches), stack
        if stack != "trl":
            recovery = stage_evidence(in_docker, "rollout")["metrics"]["recovery"]
            assert recovery["killed_pids"] and recovery["lost"] == 0 and recovery["retried_episodes"] > 0, stack
            assert recovery["call_hold"]["released"] == "by the host", stack  # the release file crossed the mount
        assert rollout_tokens(in_docker) == rollout_tokens(local), stack
        weights = [[c["sha256"] for c in stage_evidence(folder, "update")["checkpoints"]] for folder in (in_docker, local)]
        assert weights[0] and weights[0] == weights[1], stack


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
