"""A plan's task packages (task.packages): a family from outside the project, found on the host and in
every stack job through the runner.task_families entry point group. The example package is
examples/shop-tasks (docs/tasks.md)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from conftest import publish_to_local_index, stage_evidence

from runner.api import UserError, load_plan, parse_lock

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "shop-tasks"
RUNNER = str(Path(sys.executable).parent / "runner")


def copy_example(tmp_path: Path) -> Path:
    target = tmp_path / "shop-tasks"
    shutil.copytree(EXAMPLE, target, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    return target


def test_a_plan_names_its_task_package_by_path_and_its_hash_is_part_of_the_plan_id(tmp_path):
    example = copy_example(tmp_path)
    plan = load_plan(example / "plan.yaml")
    (package,) = plan.task.packages
    assert (package.path, package.name) == (str(example.resolve()), "shop-tasks") and len(package.sha256) == 64
    from runner_contracts import plan_id

    before = plan_id(plan)
    family = example / "src" / "shop_tasks" / "family.py"
    family.write_text(family.read_text().replace("scorer_version = 1", "scorer_version = 2"))
    assert plan_id(load_plan(example / "plan.yaml")) != before  # a changed package is a different plan
    calc = load_plan(ROOT / "qualification" / "plans" / "calc-tool-cpu.yaml")
    assert "packages" not in msgspec.to_builtins(calc.task)  # plans without packages keep their ids


@pytest.mark.parametrize(("change", "message"), [
    ("packages: [./missing]", "plan.yaml: field task.packages[0]: {dir}/missing has no pyproject.toml"),
    ("packages: [{{path: ., sha: 1}}]", "plan.yaml:8: field task.packages[0].sha: Object contains unknown field `sha`"),
])
def test_a_package_that_cannot_provide_families_is_one_line_naming_the_plan_field(tmp_path, change, message):
    example = copy_example(tmp_path)
    plan = example / "plan.yaml"
    plan.write_text(plan.read_text().replace("packages: [.]", change.format()))
    with pytest.raises(UserError) as raised:
        load_plan(plan)
    assert message.format(dir=example.resolve()) in str(raised.value)


def test_a_package_without_family_entry_points_is_refused(tmp_path):
    example = copy_example(tmp_path)
    pyproject = example / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().split('[project.entry-points."runner.task_families"]')[0])
    with pytest.raises(UserError, match=r"pyproject.toml: needs \[project\] name and at least one family"):
        load_plan(example / "plan.yaml")


def with_dependencies(example: Path, *dependencies: str) -> Path:
    pyproject = example / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace("dependencies = []", f"dependencies = {list(dependencies)!r}"
                                                       .replace("'", '"')))
    return pyproject


def test_a_packages_own_dependencies_are_pinned_with_hashes_in_its_lock(tmp_path):
    example = copy_example(tmp_path)
    pyproject = with_dependencies(example, "six==1.16.0")
    with pytest.raises(UserError, match=r"pyproject.toml: declares dependencies \(six==1.16.0\) but .*requirements.lock "
                                        r"is missing.*run `runner tasks lock"):
        load_plan(example / "plan.yaml")
    made = subprocess.run([RUNNER, "tasks", "lock", str(example)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    lock = example / "requirements.lock"
    (pin,) = [line for line in lock.read_text().splitlines() if not line.startswith("#")]
    assert pin.startswith("six==1.16.0 --hash=sha256:") and len(pin.split("sha256:")[1]) == 64
    assert load_plan(example / "plan.yaml").task.packages[0].name == "shop-tasks"
    pyproject.write_text(pyproject.read_text().replace("six==1.16.0", "six>=1.17"))
    with pytest.raises(UserError, match=r"requirements.lock: six>=1.17 is declared in pyproject.toml, the lock has 1.16.0"):
        load_plan(example / "plan.yaml")
    lock.write_text(lock.read_text().replace(pin, "six==1.16.0"))
    with pytest.raises(UserError, match=r"requirements.lock:3: a pin without --hash=sha256"):
        load_plan(example / "plan.yaml")


def test_a_compiled_dependency_is_refused_when_the_package_is_built(tmp_path):
    """One folder serves the host's and every stack's Python, so a wheel built for one of them is refused."""
    example = copy_example(tmp_path)
    with_dependencies(example, "msgspec")
    assert subprocess.run([RUNNER, "tasks", "lock", str(example)], capture_output=True, text=True).returncode == 0
    env = {**os.environ, "RUNNER_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "300"}
    result = subprocess.run([RUNNER, "tasks", "check", "shop-total", "--plan", str(example / "plan.yaml")],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 2, result.stderr
    assert "msgspec-" in result.stderr and "a compiled wheel (cp311-cp311-" in result.stderr
    assert "must be pure Python" in result.stderr and "Traceback" not in result.stderr
    assert not list((tmp_path / "cache" / "task-packages").glob("[0-9a-f]*[0-9a-f]"))  # nothing half-built kept


def test_tasks_check_builds_the_package_and_checks_its_family(tmp_path):
    env = {**os.environ, "RUNNER_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "200"}
    result = subprocess.run([RUNNER, "tasks", "check", "shop-total", "--plan", str(EXAMPLE / "plan.yaml"), "--json"],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert (found["problems"], found["version"]) == ([], "0.1.0") and found["checked"]["cases"] == 96  # 8 items x 2 splits x 6 cases
    built = list((tmp_path / "cache" / "task-packages").glob("*/shop_tasks-0.1.0.dist-info/entry_points.txt"))
    assert len(built) == 1 and "shop-total = shop_tasks.family:ShopTotal" in built[0].read_text()
    unknown = subprocess.run([RUNNER, "tasks", "check", "shop-total"], capture_output=True, text=True, env=env)
    assert unknown.returncode == 2 and "unknown task family 'shop-total'" in unknown.stderr  # only with its plan


@pytest.mark.slow
def test_stack_jobs_find_the_packages_family_and_score_its_scripted_cases(tmp_path):
    """The probe and service stages of an environment arm on the example plan: the family loads inside the
    jobs of both environments (verifiers' own, whose tool server lists every family, and its trl
    trainer's; the built package on their path, the environments untouched), the stack scores the family's
    scripted episodes as its reference scorer does, and neither lock gate counts the package."""
    stack = "verifiers"
    run_dir = tmp_path / stack
    example = copy_example(tmp_path)  # the suite's cached tiny policy: these stages use none, so build none
    plan = example / "plan.yaml"
    plan.write_text(plan.read_text().replace("tiny: {seed: 0, families: [shop-total, german-arith]}", "tiny: {seed: 0}"))
    result = subprocess.run([RUNNER, "qualify", "--stack", stack, "--plan", str(plan), "--stages",
                             "probe,service", "--run-dir", str(run_dir), "--json"], capture_output=True, text=True,
                            timeout=3600)
    summary = json.loads(result.stdout)
    assert result.returncode == 0, f"{summary['failed_gates']} {summary['errors']}\n{result.stderr[-3000:]}"
    service = stage_evidence(run_dir, "service")
    assert service["metrics"]["cases"] >= 12 and service["metrics"]["splits"]["train"]["family"] == "shop-total"
    probe = {g["name"]: g for g in stage_evidence(run_dir, "probe")["gates"]}
    assert probe["probe:lock-match"]["passed"] and probe["trainer:lock-match"]["passed"]


def test_a_package_from_the_index_is_named_by_a_pinned_requirement_and_its_lock(tmp_path, monkeypatch):
    """The package index here is a folder of wheels (PIP_FIND_LINKS), as a team's private index would be
    configured for pip; the wheel is the example package built under another name."""
    example = copy_example(tmp_path)
    publish_to_local_index(example, "runner-test-shop-tasks", tmp_path / "index", monkeypatch)
    monkeypatch.setenv("RUNNER_CACHE_DIR", str(tmp_path / "cache"))
    env = {**os.environ, "COLUMNS": "300"}
    plans = tmp_path / "plans"
    plans.mkdir()
    locked = subprocess.run([RUNNER, "tasks", "lock", "--requirement", "runner-test-shop-tasks==0.1.0", "--out",
                             str(plans / "shop.lock")], capture_output=True, text=True, env=env)
    assert locked.returncode == 0, locked.stderr
    assert "runner-test-shop-tasks==0.1.0 --hash=sha256:" in (plans / "shop.lock").read_text()
    plan = plans / "plan.yaml"
    text = (EXAMPLE / "plan.yaml").read_text()
    plan.write_text(text.replace("packages: [.]", "packages: [{requirement: runner-test-shop-tasks==0.1.0, lock: shop.lock}]"))
    checked = subprocess.run([RUNNER, "tasks", "check", "shop-total", "--plan", str(plan), "--json"],
                             capture_output=True, text=True, env=env)
    assert checked.returncode == 0, checked.stderr
    found = json.loads(checked.stdout)
    assert found["problems"] == [] and found["version"] == "0.1.0"
    loaded = load_plan(plan)
    (package,) = loaded.task.packages
    assert package.name == "runner-test-shop-tasks" and package.path is None and len(package.sha256) == 64
    for change, message in [
        ("packages: [{requirement: runner-test-shop-tasks==0.1.0}]", "field task.packages[0].lock: required with a requirement"),
        ("packages: [{requirement: runner-test-shop-tasks>=0.1, lock: shop.lock}]", "pin one version, name==version"),
        ("packages: [{requirement: runner-test-shop-tasks==0.2.0, lock: shop.lock}]",
         "shop.lock: pins runner-test-shop-tasks==0.1.0, the plan asks for runner-test-shop-tasks==0.2.0"),
        ("packages: [{path: ., requirement: runner-test-shop-tasks==0.1.0, lock: shop.lock}]",
         "give a path or a requirement, not both"),
    ]:
        plan.write_text(text.replace("packages: [.]", change))
        with pytest.raises(UserError, match=re.escape(message)):
            load_plan(plan)


def test_the_sudoku_example_wraps_a_third_party_library_with_its_own_lock(tmp_path, monkeypatch):
    """examples/sudoku-tasks: py-sudoku from the package index, pinned by the package's hashed lock, makes
    the puzzles and judges them; the family leaves the stack process's global random state as it was."""
    import random

    monkeypatch.setenv("RUNNER_CACHE_DIR", str(tmp_path / "cache"))
    example = ROOT / "examples" / "sudoku-tasks"
    result = subprocess.run([RUNNER, "tasks", "check", "sudoku-cell", "--plan", str(example / "plan.yaml"), "--json"],
                            capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["problems"] == []
    assert parse_lock(example / "requirements.lock") == {"py-sudoku": "2.0.0"}
    load_plan(example / "plan.yaml")
    from qualification.tasks import Transcript, get_family

    family = get_family("sudoku-cell")
    before = random.getstate()
    item = family.generate("heldout", 3, 2)[2]
    assert random.getstate() == before
    digit = item.reference["digit"]
    assert family.score(item, Transcript(final_text=f"Answer: {digit}")).success
    assert not family.score(item, Transcript(final_text="Answer: 7")).success  # py-sudoku alone would accept it


def test_the_dependencies_of_task_packages_and_a_native_asset_both_come_last(tmp_path):
    """Python imports the first sitecustomize on the path only: the one runner writes appends the dependencies
    of every runner folder on the path (task packages and a native asset), after the environment's own."""
    from runner._task_packages import DEPENDENCIES, SITECUSTOMIZE

    folders = []
    for name in ("task-packages", "native-asset"):
        folder = tmp_path / name
        (folder / DEPENDENCIES).mkdir(parents=True)
        (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
        (folder / DEPENDENCIES / f"{name.replace('-', '_')}_dependency.py").write_text("")
        folders.append(str(folder))
    probe = ("import json, sys, task_packages_dependency, native_asset_dependency; "
             "print(json.dumps([p for p in sys.path if p.endswith(('dependencies', 'site-packages'))]))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(folders)})
    assert result.returncode == 0, result.stderr
    order = json.loads(result.stdout)
    assert [Path(p).parent.name for p in order[-2:]] == ["task-packages", "native-asset"]
    assert order[0].endswith("site-packages")
