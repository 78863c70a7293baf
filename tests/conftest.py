"""Shared fixtures: builders for valid contract records, so tests corrupt one thing at a time, and the
six-arm local comparison that the compare, container, Apptainer and Slurm tests read (run once per session,
in the background from the session's start, while the tests that do not read it run first)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from runner_contracts import Segment, TrainingRow, Trajectory
from runner_contracts.processes import command_line, ended


def make_episode(step: int = 1, group: int = 0, sample: int = 0, *, stage: str = "rollout",
                 reward: float = 1.0, revision: str = "a" * 64) -> tuple[Trajectory, TrainingRow]:
    """A two-turn tool episode and the training row built from it."""
    prompt, call, tool, answer = [1, 2, 3], [10, 11], [20, 21, 22], [12, 13]
    call_lp, answer_lp = [-0.5, -0.25], [-0.125, -1.0]
    episode_id = f"{stage}/s{step}/g{group}/{sample}"
    trajectory = Trajectory(
        run_id="run", stack="trl", stage=stage, step=step, episode_id=episode_id, task_id=f"t{group}",
        group_id=f"{stage}/s{step}/g{group}", sample_index=sample, policy_revision=revision,
        segments=[Segment(source="prompt", token_ids=prompt, text="p"),
                  Segment(source="policy", token_ids=call, logprobs=call_lp, text="c"),
                  Segment(source="tool", token_ids=tool, text="t"),
                  Segment(source="policy", token_ids=answer, logprobs=answer_lp, text="a")],
        reward=reward, outcome="success" if reward else "failure", finish_reason="stop", turns=2)
    ids = prompt + call + tool + answer
    mask = [0] * 3 + [1] * 2 + [0] * 3 + [1] * 2
    old = [0.0] * 3 + call_lp + [0.0] * 3 + answer_lp
    row = TrainingRow(step=step, row_id=f"{stage}/s{step}/r{group * 2 + sample}", episode_ids=[episode_id],
                      input_ids=ids, loss_mask=mask, advantage=0.5 if reward else -0.5, old_logprobs=old)
    return trajectory, row


@pytest.fixture
def episodes():
    """Two groups of two episodes with reward variance in each group."""
    pairs = [make_episode(group=g, sample=s, reward=float(s)) for g in range(2) for s in range(2)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


GOLDEN = Path(__file__).resolve().parent / "golden"


def matches_golden(name: str, text: str) -> None:
    """`text` equals the reviewed tests/golden/<name>; UPDATE_GOLDEN=1 rewrites the file instead."""
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.read_text() == text, f"{name} differs from the reviewed golden file (UPDATE_GOLDEN=1 to accept)"


def publish_to_local_index(project: Path, name: str, index: Path, monkeypatch) -> None:
    """Publishes the Python project under distribution `name` to a package index that is a folder of wheels
    (PIP_FIND_LINKS, as a team's private index is configured for pip)."""
    pyproject = project / "pyproject.toml"
    pyproject.write_text(re.sub(r'(?m)^name = ".*"$', f'name = "{name}"', pyproject.read_text(), count=1))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(index), str(project)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))


def stage_evidence(run_dir: Path, stage: str) -> dict:
    """An arm's stage evidence.json as plain JSON."""
    return json.loads((run_dir / "stages" / stage / "evidence.json").read_text())


def rollout_tokens(run_dir: Path) -> dict[str, list]:
    """episode id -> its segments' token ids, from an arm's rollout stage."""
    lines = (run_dir / "stages" / "rollout" / "trajectories.jsonl").read_text().splitlines()
    return {r["episode_id"]: [s["token_ids"] for s in r["segments"]] for r in map(json.loads, lines)}


COMPARED_ARMS = ["trl", "nemo-gym", "openenv", "verifiers", "lightning-verl", "skyrl-gym"]
# The suite's end-to-end runs (the session comparison and the runs compared with it): the demo's plan at half
# its sizes.
CALC_PLAN = Path(__file__).resolve().parents[1] / "qualification" / "plans" / "calc-tool-cpu-suite.yaml"


# Planted in the comparison's environment; no file the run writes may contain one (test_e2e_compare).
PLANTED_SECRETS = {"HF_TOKEN": "hf_plantedTokenValue0001", "WANDB_API_KEY": "planted-wandb-key-0002",
                   "LAB_SERVICE_KEY": "planted-service-key-0003", "GH_TOKEN": "planted-gh-token-0004",
                   "LAB_DB_SECRET": "planted-db-secret-0005",
                   "LAB_INDEX_URL": "https://lab:planted-url-password-0006@pypi.invalid/simple"}


COMPARISON_TIMEOUT_S = 5400


class SessionComparison:
    """`runner compare` of every stack on the calc-tool CPU plan with the local executor and engine, started
    once; `result()` waits for it."""

    def __init__(self, tmp_path_factory) -> None:
        self.run_dir = tmp_path_factory.mktemp("compare")
        output = tmp_path_factory.mktemp("compare-output")
        self.stdout, self.stderr = output / "stdout.json", output / "stderr.log"
        self.args = [str(Path(sys.executable).parent / "runner"), "compare", "--stacks", ",".join(COMPARED_ARMS),
                     "--plan", str(CALC_PLAN), "--run-dir", str(self.run_dir), "--json"]
        self.deadline = time.monotonic() + COMPARISON_TIMEOUT_S
        with self.stdout.open("wb") as out, self.stderr.open("wb") as err:
            self.process = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                            env={**os.environ, **PLANTED_SECRETS})
        self._result: tuple[Path, dict, subprocess.CompletedProcess] | None = None

    def result(self) -> tuple[Path, dict, subprocess.CompletedProcess]:
        """(run dir, the comparison's --json output, the finished process with its stdout and stderr)."""
        if self._result is None:
            try:
                returncode = self.process.wait(timeout=max(0.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stop()
                raise
            completed = subprocess.CompletedProcess(self.args, returncode, self.stdout.read_text(),
                                                    self.stderr.read_text())
            assert returncode in (0, 1), completed.stderr[-3000:]
            self._result = self.run_dir, json.loads(completed.stdout), completed
        return self._result

    def stop(self) -> None:
        """Ends the comparison if it still runs (the session ended first); its jobs die with it."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def reads_comparison(item) -> bool:
    return "local_comparison" in getattr(item, "fixturenames", ())


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """The tests that read the session comparison run after all others (each group in its own order), so the
    others run while the comparison is made in the background: alone, the suite keeps about one of two cores
    busy (pip installs, image builds and process starts are mostly single-threaded)."""
    items[:] = sorted(items, key=reads_comparison)


@pytest.fixture(scope="session", autouse=True)
def session_comparison_in_background(request, tmp_path_factory):
    """Starts the session comparison as the session begins, when any selected test reads it."""
    comparison = SessionComparison(tmp_path_factory) if any(map(reads_comparison, request.session.items)) else None
    yield comparison
    if comparison is not None:
        comparison.stop()


@pytest.fixture(scope="session")
def local_comparison(session_comparison_in_background, tmp_path_factory):
    """The session comparison's (run dir, --json output, finished process)."""
    return (session_comparison_in_background or SessionComparison(tmp_path_factory)).result()


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[str]:
    """DOCKER_HOST of one dockerd for the session (tests/container_daemons.py), or a skip saying why not:
    test_apptainer builds its SIFs' images there, test_containers and test_domain qualify in it."""
    from container_daemons import docker_daemon, missing

    if reason := missing("dockerd", "debootstrap"):
        pytest.skip(f"no Docker Engine for the container tests: {reason}")
    with docker_daemon() as url:
        yield url


class ImagesInBackground:
    """`runner images build --engine docker` of every compared stack, one after another on a thread, from the
    session's start: the docker comparison, which runs last, then finds its images built (its own builds still
    check them), and the builds' pip installs share the cores with the tests instead of following them."""

    def __init__(self, url: str, folder: Path) -> None:
        from container_daemons import copy_stacks

        self.env = {**os.environ, "DOCKER_HOST": url, "RUNNER_STACKS_DIR": str(copy_stacks(folder / "stacks"))}
        self.log = folder / "builds.log"
        self.process: subprocess.Popen | None = None
        self.stopped = threading.Event()
        self.lock = threading.Lock()  # a build starts only while not stopped
        self.thread = threading.Thread(target=self._build_all, name="docker-images", daemon=True)
        self.thread.start()

    def _build_all(self) -> None:
        runner_bin = str(Path(sys.executable).parent / "runner")
        with self.log.open("ab") as log:
            for stack in COMPARED_ARMS:  # trl and openenv first: test_apptainer exports them early on
                with self.lock:
                    if self.stopped.is_set():
                        return
                    self.process = subprocess.Popen([runner_bin, "images", "build", "--stack", stack, "--engine",
                                                     "docker"], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                                    env=self.env)
                self.process.wait()

    def stop(self) -> None:
        """Ends a build still running (the session ended first) and waits for the thread."""
        with self.lock:
            self.stopped.set()
            if self.process is not None and self.process.poll() is None:
                self.process.terminate()
        self.thread.join()


@pytest.fixture(scope="session", autouse=True)
def docker_images_in_background(request, tmp_path_factory):
    """Starts building the compared stacks' images as the session begins, when the docker comparison is
    selected and a Docker Engine can run here."""
    from container_daemons import missing

    wanted = any("docker_comparison" in getattr(item, "fixturenames", ()) for item in request.session.items)
    if not wanted or missing("dockerd", "debootstrap"):
        yield None
        return
    builder = ImagesInBackground(request.getfixturevalue("docker_engine"), tmp_path_factory.mktemp("images"))
    yield builder
    builder.stop()


def leftover_processes(run_dir: Path) -> list[str]:
    """Live processes whose working directory is inside `run_dir` or whose environment names it
    ("pid: command line"); a finished stage must leave none."""
    root = str(Path(run_dir).resolve())
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid() or ended(int(proc.name)):
            continue
        try:
            cwd = os.readlink(proc / "cwd").removesuffix(" (deleted)")
            environ = (proc / "environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if cwd == root or cwd.startswith(root + os.sep) or root in environ:
            found.append(f"{proc.name}: {command_line(int(proc.name))}")
    return found


def wait_until(predicate, what: str, timeout_s: float = 600, poll_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(poll_s)


HERMES_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}<tool_call>{% endif %}"


def self_signed_certificate(folder: Path, name: str) -> tuple[Path, Path]:
    """(certificate, key) of a fresh self-signed EC certificate for 127.0.0.1, made by the openssl CLI."""
    certificate, key = folder / f"{name}.pem", folder / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-days", "2", "-subj", f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(certificate)], check=True, capture_output=True)
    return certificate, key


def stand_in_checkpoint(folder: Path, weights: bytes = b"weights are only hashed by the host") -> Path:
    """A checkpoint folder that passes the host's checks (config, weights, tokenizer, a Hermes chat template)
    for tests whose jobs never load it (stand-in: no real model is built or downloaded here)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "config.json").write_text(json.dumps({"vocab_size": 10, "model_type": "qwen2"}))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": HERMES_TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def cluster():
    """A one-node Slurm on loopback for this module (tests/slurm_cluster.py), or a skip saying why not."""
    from slurm_cluster import missing, slurm_cluster

    reason = missing()
    if reason:
        pytest.skip(f"no Slurm for the cluster tests: {reason}")
    with slurm_cluster() as running:
        yield running
