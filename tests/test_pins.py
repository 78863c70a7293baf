"""`runner pin`: pin records, drift checks that run nothing, and a real resolution with pip (slow)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runner.api import UserError, parse_lock

ROOT = Path(__file__).resolve().parents[1]
RUNNER = str(Path(sys.executable).parent / "runner")


def runner(*args: str, stacks: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "400"}
    if stacks is not None:
        env["RUNNER_STACKS_DIR"] = str(stacks)
    return subprocess.run([RUNNER, *args], capture_output=True, text=True, env=env)


@pytest.fixture
def stacks(tmp_path) -> Path:
    return Path(shutil.copytree(ROOT / "stacks", tmp_path / "stacks",
                                ignore=shutil.ignore_patterns("adapter", "*.egg-info")))


def drift_of(stacks: Path, stack: str) -> list[str]:
    result = runner("pin", "--check", "--stack", stack, "--json", stacks=stacks)
    assert result.returncode == (1 if json.loads(result.stdout)["drift"][stack] else 0), result.stderr
    return json.loads(result.stdout)["drift"][stack]


def test_the_repository_pins_agree():
    result = runner("pin", "--check", "--json")
    assert result.returncode == 0, result.stdout
    assert set(json.loads(result.stdout)["drift"]) >= {"trl", "openenv", "nemo-gym", "verifiers", "lightning-verl"}


def test_a_changed_lock_is_drift_naming_the_lock(stacks):
    lock = stacks / "openenv" / "requirements.lock"
    lock.write_text(lock.read_text().replace("openenv==0.10.0", "openenv==0.9.0"))
    problems = drift_of(stacks, "openenv")
    assert any("requirements.lock: sha256" in p for p in problems), problems
    assert any("openenv==0.9.0, stack.toml pins 0.10.0" in p for p in problems), problems
    assert any("requirements.in:2: openenv==0.10.0, the lock has 0.9.0" in p for p in problems), problems


def test_a_changed_upstream_in_the_manifest_is_drift_naming_the_field(stacks):
    manifest = stacks / "verifiers" / "stack.toml"
    manifest.write_text(manifest.read_text().replace('version = "0.4.0"', 'version = "0.4.1"'))
    problems = drift_of(stacks, "verifiers")
    assert any("pins.json: version is '0.4.0', stack.toml says '0.4.1'" in p for p in problems), problems


def test_a_stack_without_a_pin_record_is_drift(stacks):
    (stacks / "trl" / "pins.json").unlink()
    assert drift_of(stacks, "trl") == [f"{stacks / 'trl' / 'pins.json'}: missing; run `runner pin --stack trl`"]


def test_a_corrupt_pin_record_is_a_clear_error(stacks):
    (stacks / "trl" / "pins.json").write_text('{"stack": "trl"}')
    result = runner("pin", "--check", "--stack", "trl", stacks=stacks)
    assert result.returncode == 2 and "pins.json" in result.stderr and "Traceback" not in result.stderr


def test_the_gpu_environment_is_pinned_and_checked_on_its_own(stacks):
    result = runner("pin", "--check", "--json", stacks=stacks)
    assert json.loads(result.stdout)["drift"]["lightning-verl (gpu)"] == []
    lock = stacks / "lightning-verl" / "requirements-gpu.lock"
    lock.write_text(lock.read_text().replace("vllm==0.24.0", "vllm==0.23.0"))
    result = runner("pin", "--check", "--stack", "lightning-verl", "--json", stacks=stacks)
    drift = json.loads(result.stdout)["drift"]
    assert result.returncode == 1 and drift["lightning-verl"] == []  # the CPU environment is untouched
    assert any("requirements-gpu.lock: sha256" in p and "runner pin --stack lightning-verl --gpu" in p
               for p in drift["lightning-verl (gpu)"]), drift


def test_gpu_pinning_a_stack_without_a_gpu_environment_is_a_clear_error(stacks):
    result = runner("pin", "--stack", "trl", "--gpu", stacks=stacks)
    assert result.returncode == 2 and "stack trl has no GPU environment" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_gpu_table_without_its_lock_is_a_clear_error(stacks):
    manifest = stacks / "lightning-verl" / "stack.toml"
    manifest.write_text(manifest.read_text().replace('lock = "requirements-gpu.lock"\n', ""))
    result = runner("pin", "--check", stacks=stacks)
    assert result.returncode == 2 and "field gpu.lock: Object missing required field `lock`" in result.stderr
    assert str(manifest) in result.stderr and "Traceback" not in result.stderr


def test_a_lock_without_hashes_is_drift_naming_its_first_unhashed_line(stacks):
    lock = stacks / "trl" / "requirements.lock"
    lines = lock.read_text().splitlines()
    lines[3] = lines[3].split(" --hash", 1)[0]
    lock.write_text("\n".join(lines) + "\n")
    problems = drift_of(stacks, "trl")
    assert any(f"requirements.lock:4: 1 of {len(parse_lock(lock))} pins have no --hash=sha256" in p
               and "runner pin --stack trl" in p for p in problems), problems


def test_locks_with_hashes_parse(tmp_path):
    lock = tmp_path / "requirements.lock"
    lock.write_text("# comment\nmsgspec==0.23.0 --hash=sha256:" + "a" * 64 + "\nPyYAML==6.0.4\n")
    assert parse_lock(lock) == {"msgspec": "0.23.0", "pyyaml": "6.0.4"}


def mini_stack(root: Path, requirement: str, lock: str) -> Path:
    stack = root / "stacks" / "mini"
    (stack / "adapter").mkdir(parents=True)
    (stack / "requirements.lock").write_text(lock)
    (stack / "requirements.in").write_text(requirement + "\n")
    (stack / "stack.toml").write_text('name = "mini"\ndescription = "one requirement"\npython = "3.11"\n'
                                      'lock = "requirements.lock"\nadapter = "mini:run"\nadapter_package = "adapter"\n'
                                      'stages = ["probe"]\n[upstream]\nname = "msgspec"\nversion = "0.22.0"\n')
    return stack


@pytest.mark.slow
def test_pin_hashes_a_lock_as_it_is_and_a_resolve_keeps_its_versions_unless_upgraded(tmp_path):
    """--no-resolve adds the sha256 of each pin (comments, order and versions kept); a resolve keeps the
    lock's versions as constraints (msgspec 0.22.0, though the index has 0.23.0); --upgrade takes the newest."""
    stack = mini_stack(tmp_path, "msgspec>=0.22", "# pinned by hand: see the notes\nmsgspec==0.22.0\n")
    stacks = tmp_path / "stacks"
    assert runner("pin", "--stack", "mini", "--no-resolve", stacks=stacks).returncode == 0
    lines = (stack / "requirements.lock").read_text().splitlines()
    assert lines[0] == "# pinned by hand: see the notes" and lines[1].startswith("msgspec==0.22.0 --hash=sha256:")
    assert runner("pin", "--check", "--stack", "mini", stacks=stacks).returncode == 0
    assert runner("pin", "--stack", "mini", stacks=stacks).returncode == 0
    assert parse_lock(stack / "requirements.lock") == {"msgspec": "0.22.0"}
    result = runner("pin", "--stack", "mini", "--upgrade", stacks=stacks)
    assert result.returncode == 0, result.stderr[-2000:]
    assert parse_lock(stack / "requirements.lock") == {"msgspec": "0.23.0"}


@pytest.mark.slow
def test_pin_resolves_a_lock_with_hashes_and_a_pin_record(tmp_path):
    """A real resolution (pip --dry-run --report on the stack's Python) of a one-requirement stack."""
    stack = tmp_path / "stacks" / "mini"
    (stack / "adapter").mkdir(parents=True)
    (stack / "requirements.lock").write_text("")
    (stack / "requirements.in").write_text("msgspec==0.23.0\n")
    (stack / "stack.toml").write_text('name = "mini"\ndescription = "one requirement"\npython = "3.11"\n'
                                      'lock = "requirements.lock"\nadapter = "mini:run"\nadapter_package = "adapter"\n'
                                      'stages = ["probe"]\n[upstream]\nname = "msgspec"\nversion = "0.23.0"\n')
    result = runner("pin", "--stack", "mini", "--json", stacks=tmp_path / "stacks")
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads(result.stdout)
    lines = [line for line in (stack / "requirements.lock").read_text().splitlines() if not line.startswith("#")]
    assert len(lines) == 1 and lines[0].startswith("msgspec==0.23.0 --hash=sha256:")
    assert record["version"] == "0.23.0" and record["resolver"].startswith("pip ")
    assert runner("pin", "--check", "--stack", "mini", stacks=tmp_path / "stacks").returncode == 0


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                          env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org",
                               "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.org"}).stdout.strip()


@pytest.mark.slow
def test_an_upstream_pinned_to_a_git_commit_is_locked_recorded_and_installed(tmp_path, monkeypatch):
    """The upstream is a local git repository (no forge is reachable here) at two commits; requirements.in
    names the first by a branch, `runner pin` locks the commit it resolved, pins.json records it with its
    source, and the local engine installs exactly that commit (pip's hash-checking mode for the rest)."""
    repo = tmp_path / "upstream"
    (repo / "miniupstream").mkdir(parents=True)
    (repo / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = '
                                         '"setuptools.build_meta"\n[project]\nname = "miniupstream"\nversion = "0.1.0"\n')
    (repo / "miniupstream" / "__init__.py").write_text("GENERATION = 1\n")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "first")
    first = git(repo, "rev-parse", "HEAD")
    git(repo, "branch", "release")
    (repo / "miniupstream" / "__init__.py").write_text("GENERATION = 2\n")
    git(repo, "commit", "-qam", "second")
    # file://localhost/...: pip 23.2's requirement parser refuses git+file:/// (no host) as an invalid URL
    stack = mini_stack(tmp_path, f"miniupstream @ git+file://localhost{repo}@release\nmsgspec==0.23.0\n"
                       "setuptools>=70.1", "")  # setuptools: the environment builds our local packages
    (stack / "stack.toml").write_text((stack / "stack.toml").read_text()
                                      .replace('name = "msgspec"\nversion = "0.22.0"', 'name = "miniupstream"\nversion = "0.1.0"'))
    (stack / "adapter" / "pyproject.toml").write_text('[project]\nname = "runner-stack-mini"\nversion = "0"\n'
                                                      '[tool.setuptools]\npy-modules = []\n')
    stacks = tmp_path / "stacks"
    result = runner("pin", "--stack", "mini", "--json", stacks=stacks)
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads(result.stdout)
    assert record["git_revision"] == first and record["git_revision_source"].startswith("requirements.lock: VCS pin git+file://localhost/")
    lock = (stack / "requirements.lock").read_text()
    assert f"miniupstream @ git+file://localhost{repo}@{first}  # version: 0.1.0" in lock
    assert "msgspec==0.23.0 --hash=sha256:" in lock
    assert runner("pin", "--check", "--stack", "mini", stacks=stacks).returncode == 0
    assert {k: v for k, v in parse_lock(stack / "requirements.lock").items() if k != "setuptools"} == {
        "miniupstream": "0.1.0", "msgspec": "0.23.0"}

    monkeypatch.setenv("RUNNER_STACKS_DIR", str(stacks))
    monkeypatch.setenv("RUNNER_CACHE_DIR", str(tmp_path / "cache"))
    from runner._engines.local import LocalEngine
    from runner._stacks import get_stack

    env = LocalEngine().prepare(get_stack("mini"))
    installed = subprocess.run([str(env.path / "bin" / "python"), "-c", "import miniupstream, msgspec; "
                                "print(miniupstream.GENERATION, msgspec.__version__)"], capture_output=True, text=True)
    assert installed.stdout.split() == ["1", "0.23.0"], installed.stderr

    manifest = stack / "stack.toml"
    manifest.write_text(manifest.read_text().replace('version = "0.1.0"', f'version = "0.1.0"\ngit_revision = "{"0" * 40}"'))
    problems = json.loads(runner("pin", "--check", "--stack", "mini", "--json", stacks=stacks).stdout)["drift"]["mini"]
    assert any(f"miniupstream is pinned to commit {first[:12]}, stack.toml's git_revision is 000000000000" in p
               for p in problems), problems


def test_a_stack_at_another_upstream_release_is_its_pin_set(stacks, monkeypatch):
    """trl@1.15.0 is the trl stack with the lock in stacks/trl/pins/1.15.0 (committed: the release before
    the pinned one); trl@1.16.0 is the stack itself; a release without a pin set says how to write one."""
    monkeypatch.setenv("RUNNER_STACKS_DIR", str(stacks))
    from runner.api import get_stack

    older = get_stack("trl@1.15.0")
    assert (older.name, older.upstream.version, older.base) == ("trl@1.15.0", "1.15.0", "trl")
    assert older.locked_packages()["trl"] == "1.15.0" and older.image_name == "trl-1.15.0"
    assert get_stack("trl@1.16.0").lock == get_stack("trl").lock
    with pytest.raises(UserError, match=r"stack trl has no pin set for trl 1.14.0 .*pin sets: 1.15.0.*"
                                        r"runner pin --stack trl --upstream trl==1.14.0"):
        get_stack("trl@1.14.0")
    assert drift_of(stacks, "trl") == []
    lock = stacks / "trl" / "pins" / "1.15.0" / "requirements.lock"
    lock.write_text(lock.read_text().replace("trl==1.15.0", "trl==1.14.0"))
    result = json.loads(runner("pin", "--check", "--stack", "trl", "--json", stacks=stacks).stdout)["drift"]
    assert any("trl==1.14.0, stack.toml pins 1.15.0" in p or "sha256" in p for p in result["trl@1.15.0"])


@pytest.mark.parametrize(("upstream", "message"), [
    ("transformers==5.0.0", "--upstream 'transformers==5.0.0': expected trl==<version>"),
    ("trl==1.16.0", "that is the stack's own pin"),
])
def test_a_pin_set_names_another_release_of_the_stacks_own_upstream(stacks, upstream, message):
    result = runner("pin", "--stack", "trl", "--upstream", upstream, stacks=stacks)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_the_comparison_of_two_pins_says_what_changed(tmp_path):
    from runner._compare import pin_changes, pin_lines

    def trajectories(stack: str, tokens: list[list[int]]) -> None:
        folder = tmp_path / "arms" / stack / "stages" / "rollout"
        folder.mkdir(parents=True)
        folder.joinpath("trajectories.jsonl").write_text("".join(
            json.dumps({"episode_id": f"e{i}", "segments": [{"token_ids": t}]}) + "\n" for i, t in enumerate(tokens)))

    trajectories("trl@1.15.0", [[1, 2], [3, 4], [5, 6]])
    trajectories("trl", [[1, 2], [3, 9], [5, 6]])
    arms = [{"stack": "trl@1.15.0", "final_weights_sha256": "a" * 64}, {"stack": "trl", "final_weights_sha256": "b" * 64},
            {"stack": "openenv", "final_weights_sha256": None}]
    (change,) = pin_changes(tmp_path, arms)
    assert change["lock_changes"] == {"trl": ["1.15.0", "1.16.0"]}
    assert (change["rollout_episodes"], change["rollout_token_identical"], change["first_differing_episode"]) == (3, 2, "e1")
    assert change["final_weights_identical"] is False
    text = "\n".join(pin_lines([change]))
    assert "## What changed between trl@1.15.0 and trl" in text and "- lock: trl 1.15.0 → 1.16.0" in text
    assert "2 of 3 episodes sampled the same tokens (first difference: e1)" in text
