"""Task packages: a plan's own task families, from a package outside this project (`task.packages`, local
paths). The host checks each package (a pyproject.toml naming runner.task_families entry points), hashes
its source into the plan (so the plan id covers it), builds it once per content hash into a folder under
the user cache (`pip install --no-deps --target`), and puts that folder on the path of the host and of
every job, under every engine (read-only; the same host path inside containers and SIFs). Stack
environments are never modified, so runs of different plans can share them at the same time.

A package's own dependencies (`[project] dependencies`, a scorer library say) are pinned with sha256
hashes in requirements.lock beside its pyproject.toml (`runner tasks lock DIR` writes it) and installed
in pip's hash-checking mode into the folder's `dependencies/`, which the folder's sitecustomize.py puts
at the END of the path of every process that has the folder on PYTHONPATH: a stack's own version of a
distribution wins, the dependencies only fill in what an environment lacks, so a task package never
changes what a stack imports. They must be pure-Python wheels: one folder serves the host and every
stack's Python."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec

from qualification.tasks import FamilyError, use_plan
from qualification.tasks.native import NATIVE_DATA, dataset_rows
from runner_contracts import NativeAsset, Plan, TaskPackage, write_atomic

from ._engines.jobs import file_lock, tree_hash
from ._errors import EngineError, UserError
from ._files import read_toml
from ._paths import cache_dir, native_asset_dir, task_package_dir
from ._stacks import normalise, parse_lock

ENTRY_POINT_GROUP = "runner.task_families"
LOCK_NAME = "requirements.lock"
DEPENDENCIES = "dependencies"
SITECUSTOMIZE = f'''"""Written by runner: the plan's task-package dependencies go after this environment's own packages,
so a stack's own version of a distribution wins and they only fill in what it lacks. Python imports the first
sitecustomize on the path only, so this one appends the dependencies of every runner folder on the path (a
plan's task packages and its native asset each have one)."""
import os
import sys

for _entry in list(sys.path):
    _dependencies = os.path.join(_entry, "{DEPENDENCIES}")
    if (_dependencies not in sys.path and os.path.isdir(_dependencies)
            and os.path.isfile(os.path.join(_entry, "sitecustomize.py"))):
        sys.path.append(_dependencies)
'''


def resolve(plan: Plan, plan_file: Path) -> Plan:
    """The plan with each task package's path (or lock) made absolute (relative paths are the plan
    file's), its distribution name read and its content hashed; refuses a package that cannot provide
    families. A native asset's package is resolved and hashed the same way."""
    resolved = [_resolve_requirement(package, plan_file, f"{plan_file}: field task.packages[{index}]")
                if package.requirement is not None
                else _resolve_path(package, plan_file, index) for index, package in enumerate(plan.task.packages)]
    merged_pins(resolved)  # refuses two packages pinning one distribution differently
    task = plan.task
    if resolved:
        task = msgspec.structs.replace(task, packages=resolved)
    if task.native is not None:
        task = msgspec.structs.replace(task, native=_resolve_native(task.native, plan_file))
    return plan if task is plan.task else msgspec.structs.replace(plan, task=task)


def _resolve_native(native: NativeAsset, plan_file: Path) -> NativeAsset:
    where = f"{plan_file}: field task.native"
    if native.requirement is not None:
        return _resolve_native_requirement(native, plan_file)
    if native.package is None:
        raise UserError(f"{where}: give the asset's package (a path) or its requirement (name==version) and lock")
    if native.lock is not None:
        raise UserError(f"{where}.lock: belongs to a requirement; a package by path keeps its lock in {LOCK_NAME} "
                        "beside its pyproject.toml")
    path = (plan_file.parent / Path(native.package).expanduser()).resolve()
    pyproject = path / "pyproject.toml"
    if not pyproject.is_file():
        raise UserError(f"{where}.package: {path} has no pyproject.toml; a native asset is the Python project "
                        f"that holds the team's environment (installed into the {native.stack} stack's jobs)")
    project = read_toml(pyproject, dict).get("project", {})
    if not project.get("name"):
        raise UserError(f"{pyproject}: needs [project] name")
    check_lock(path, project.get("dependencies", []))
    for field in ("dataset", "cases"):
        relative = getattr(native, field)
        if relative is not None and not (path / relative).is_file():
            raise UserError(f"{where}.{field}: {path / relative}: no such file (the path is the package's)")
    return msgspec.structs.replace(native, package=str(path), name=project["name"], sha256=tree_hash([path]))


def _resolve_native_requirement(native: NativeAsset, plan_file: Path) -> NativeAsset:
    """A native asset from the package index: its pinned requirement and hashed lock; its dataset and answer
    key are files beside the plan. The sha256 covers the lock and those files."""
    where = f"{plan_file}: field task.native"
    if native.package is not None:
        raise UserError(f"{where}: give a package (a path) or a requirement, not both")
    package = _resolve_requirement(TaskPackage(requirement=native.requirement, lock=native.lock), plan_file, where)
    folder = plan_file.parent.resolve()
    digest = hashlib.sha256(bytes.fromhex(package.sha256))
    for field in ("dataset", "cases"):
        relative = getattr(native, field)
        if relative is None:
            continue
        if not (folder / relative).is_file():
            raise UserError(f"{where}.{field}: {folder / relative}: no such file (with a requirement, the path is "
                            "the plan's)")
        digest.update(f"{field}\0".encode() + (folder / relative).read_bytes())
    return msgspec.structs.replace(native, lock=package.lock, name=package.name, data_dir=str(folder),
                                   sha256=digest.hexdigest())


def native_package(native: NativeAsset) -> TaskPackage:
    """The native asset as the task package it is installed as (by path, or by requirement and lock)."""
    if native.requirement is not None:
        return TaskPackage(requirement=native.requirement, lock=native.lock, name=native.name, sha256=native.sha256)
    return TaskPackage(path=native.package, name=native.name, sha256=native.sha256)


def _resolve_path(package: TaskPackage, plan_file: Path, index: int) -> TaskPackage:
    where = f"{plan_file}: field task.packages[{index}]"
    if package.path is None:
        raise UserError(f"{where}: give the package's path, or a requirement (name==version) and its lock")
    if package.lock is not None:
        raise UserError(f"{where}.lock: belongs to a requirement; a package by path keeps its lock in "
                        f"{LOCK_NAME} beside its pyproject.toml")
    path = (plan_file.parent / package.path).resolve()
    pyproject = path / "pyproject.toml"
    if not pyproject.is_file():
        raise UserError(f"{where}: {path} has no pyproject.toml; a task package is a Python project whose "
                        f"pyproject.toml registers families under [project.entry-points.\"{ENTRY_POINT_GROUP}\"]")
    project = read_toml(pyproject, dict).get("project", {})
    families = project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {})
    if not project.get("name") or not families:
        raise UserError(f"{pyproject}: needs [project] name and at least one family under "
                        f"[project.entry-points.\"{ENTRY_POINT_GROUP}\"]")
    check_lock(path, project.get("dependencies", []))
    return TaskPackage(path=str(path), name=project["name"], sha256=tree_hash([path]))


def _resolve_requirement(package: TaskPackage, plan_file: Path, where: str) -> TaskPackage:
    from packaging.requirements import InvalidRequirement, Requirement  # 12 ms: only task packages need it

    if package.path is not None:
        raise UserError(f"{where}: give a path or a requirement, not both")
    try:
        requirement = Requirement(package.requirement)
    except InvalidRequirement as error:
        raise UserError(f"{where}.requirement: {package.requirement!r} is not a requirement ({error})") from None
    pinned = [spec.version for spec in requirement.specifier if spec.operator == "=="]
    if len(requirement.specifier) != 1 or not pinned or requirement.url:
        raise UserError(f"{where}.requirement: {package.requirement!r}: pin one version, name==version")
    if package.lock is None:
        raise UserError(f"{where}.lock: required with a requirement: the lock pins it and its dependencies with "
                        f"sha256 hashes (`runner tasks lock --requirement '{package.requirement}' --out FILE`)")
    lock = (plan_file.parent / package.lock).resolve()
    if not lock.is_file():
        raise UserError(f"{where}.lock: {lock}: no such file")
    _require_hashes(lock)
    have = parse_lock(lock).get(normalise(requirement.name))
    if have != pinned[0]:
        raise UserError(f"{lock}: pins {requirement.name}=={have}, the plan asks for {package.requirement}"
                        if have else f"{lock}: does not pin {requirement.name}, which the plan asks for")
    return TaskPackage(requirement=package.requirement, lock=str(lock), name=requirement.name,
                       sha256=hashlib.sha256(lock.read_bytes()).hexdigest())


def build(plan: Plan, log=lambda message: None) -> Path | None:
    """Builds the plan's task packages into their folder unless it exists; returns the folder."""
    return _build(plan.task.packages, task_package_dir(plan), "task packages", log)


def build_native(plan: Plan, log=lambda message: None) -> Path | None:
    """Builds the plan's native asset (its package and locked dependencies) into its folder, with a copy of
    its dataset and answer key under native-data/ (every job reads them there); returns the folder."""
    native = plan.task.native
    if native is None:
        return None
    data = [relative for relative in (native.dataset, native.cases) if relative is not None]
    return _build([native_package(native)], native_asset_dir(plan), f"the {native.stack} native asset", log,
                  data_from=Path(native.data_dir or native.package), data=data)


def _build(packages: list[TaskPackage], target: Path | None, what: str, log, *, data_from: Path | None = None,
           data: tuple[str, ...] | list[str] = ()) -> Path | None:
    """Installs `packages` into `target` unless it exists; `data` (paths under `data_from`) are copied into
    its native-data/ folder."""
    if target is None:
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.with_name(target.name + ".lock")):
        if target.is_dir():
            return target
        log(f"building {what} {', '.join(p.name or p.path or '' for p in packages)} into {target}")
        with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as scratch:
            copies = [shutil.copytree(p.path, Path(scratch) / "src" / str(i),
                                      ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
                      for i, p in enumerate(packages) if p.path is not None]
            out = Path(scratch) / "out"
            out.mkdir()
            pins = merged_pins(packages)
            if pins:  # requirement packages come in with their locks, after the environment's own packages
                install_locked(pins, out / DEPENDENCIES, Path(scratch))
                (out / "sitecustomize.py").write_text(SITECUSTOMIZE)
            if copies:
                _pip(["install", "--no-deps", "--no-build-isolation", "--no-cache-dir", "--target", str(out),
                      *map(str, copies)], f"building {what}")
            for relative in data:
                copy = out / NATIVE_DATA / relative
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(data_from / relative, copy)
                if copy.suffix == ".parquet":  # a job reads rows as JSON: no stack needs pyarrow for them
                    copy.with_name(copy.name + ".jsonl").write_text("".join(_json_rows(data_from / relative)))
            for root, dirs, files in os.walk(out):  # jobs run as other users in containers: world-readable
                os.chmod(root, 0o755)
                for name in files:
                    os.chmod(os.path.join(root, name), 0o644)
            out.rename(target)
    return target


def _json_rows(dataset: Path) -> list[str]:
    """The dataset's rows as JSON lines; a file or row that cannot be read as JSON is the plan's error."""
    try:
        rows = dataset_rows(dataset)
    except FamilyError as error:
        raise UserError(f"field task.native.dataset: {error}") from None
    lines = []
    for where, _, row in rows:
        try:
            lines.append(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n")
        except (TypeError, ValueError) as error:
            raise UserError(f"field task.native.dataset: {where}: not a JSON value ({error})") from None
    return lines


def write_lock(package: Path, log=lambda message: None) -> Path:
    """Locks the package's `[project] dependencies` into its requirements.lock (lock_requirements)."""
    pyproject = package / "pyproject.toml"
    if not pyproject.is_file():
        raise UserError(f"{package}: no pyproject.toml; `runner tasks lock` takes a task package's folder")
    dependencies = read_toml(pyproject, dict).get("project", {}).get("dependencies", [])
    if not dependencies:
        raise UserError(f"{pyproject}: field project.dependencies: empty; nothing to lock")
    target = lock_requirements(dependencies, package / LOCK_NAME, f"the dependencies of the task package "
                               f"{package.name} (pyproject.toml)", log)
    check_lock(package, dependencies)
    return target


def lock_requirements(requirements: list[str], target: Path, what: str, log=lambda message: None) -> Path:
    """Resolves `requirements` with pip (on this Python, nothing installed, wheels only) and writes them,
    with every transitive dependency and its sha256, to `target`."""
    from ._pins import hashed_pins, pip_report

    log(f"resolving {', '.join(requirements)}")
    installs, pip_version = pip_report(Path(sys.executable), ["--only-binary=:all:"],
                                       requirements="".join(f"{r}\n" for r in requirements),
                                       what=f"resolving {what}")
    header = [f"# Lock of {what}: written by `runner tasks lock` (pip {pip_version}, Python "
              f"{sys.version.split()[0]}). Do not edit by hand.",
              "# Installed with: pip install --no-deps --require-hashes --only-binary=:all: --target ..."]
    write_atomic(target, ("\n".join(header + hashed_pins(installs)) + "\n").encode())
    return target


def check_lock(package: Path, dependencies: list[str]) -> None:
    """Refuses a package whose declared dependencies are not all pinned, hashed, in its requirements.lock."""
    if not dependencies:
        return
    from packaging.requirements import InvalidRequirement, Requirement  # 12 ms: only task packages need it

    pyproject, lock = package / "pyproject.toml", package / LOCK_NAME
    fix = f"run `runner tasks lock {package}`"
    if not lock.is_file():
        raise UserError(f"{pyproject}: declares dependencies ({', '.join(dependencies)}) but {lock} is missing: a "
                        f"task package pins them there with sha256 hashes; {fix}")
    _require_hashes(lock, f"; {fix}")
    locked = parse_lock(lock)
    for text in dependencies:
        try:
            requirement = Requirement(text)
        except InvalidRequirement as error:
            raise UserError(f"{pyproject}: field project.dependencies: {text!r} is not a requirement ({error})") \
                from None
        have = locked.get(normalise(requirement.name))
        if have is None or not requirement.specifier.contains(have, prereleases=True):
            found = f"the lock has {have}" if have else "it is not in the lock"
            raise UserError(f"{lock}: {text} is declared in {pyproject.name}, {found}; {fix}")


def _lock_of(package: TaskPackage) -> Path | None:
    if package.lock is not None:
        return Path(package.lock)
    lock = Path(package.path or "") / LOCK_NAME
    return lock if package.path is not None and lock.is_file() else None


def _require_hashes(lock: Path, hint: str = "") -> None:
    from ._pins import unhashed_lines

    if unhashed := unhashed_lines(lock):
        raise UserError(f"{lock}:{unhashed[0]}: a pin without --hash=sha256 (installed in hash-checking mode){hint}")


def merged_pins(packages: list[TaskPackage]) -> list[str]:
    """The pinned lines of every package's lock, once each; refuses one distribution at two versions."""
    lines: dict[str, tuple[str, str, Path]] = {}
    for lock in filter(None, map(_lock_of, packages)):
        for raw in lock.read_text().splitlines():
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            name, _, rest = line.partition("==")
            version = rest.split()[0]
            earlier = lines.get(normalise(name))
            if earlier and earlier[0] != version:
                raise UserError(f"{lock}: {name}=={version}, but {earlier[2]} pins {earlier[0]}; task packages of "
                                "one plan share one folder and must agree")
            lines.setdefault(normalise(name), (version, line, lock))
    return [line for _, line, _ in lines.values()]


def task_dependencies(plan: Plan) -> tuple[str, ...]:
    """The distribution names the plan's task packages' locks bring, and its native asset's (normalised);
    the probe's lock gate does not count them, as it does not count the packages."""
    native = plan.task.native
    pins = merged_pins(plan.task.packages) + (merged_pins([native_package(native)]) if native is not None else [])
    return tuple(normalise(line.partition("==")[0]) for line in pins)


def install_locked(pins: list[str], target: Path, scratch: Path) -> None:
    """Installs hashed pins into `target` (pip's hash-checking mode, wheels only) and refuses any that is
    not a pure-Python wheel."""
    requirements = scratch / "dependencies.lock"
    requirements.write_text("\n".join(pins) + "\n")
    _pip(["install", "--no-deps", "--require-hashes", "--only-binary=:all:", "--target", str(target),
          "-r", str(requirements)], "installing the task packages' locked dependencies")
    for wheel in target.glob("*.dist-info/WHEEL"):
        tags = [line.split(":", 1)[1].strip() for line in wheel.read_text().splitlines() if line.startswith("Tag:")]
        if tags and not any(tag.endswith("-none-any") for tag in tags):
            raise UserError(f"{wheel.parent.name.removesuffix('.dist-info')}: a compiled wheel ({tags[0]}); a task "
                            "package's dependencies must be pure Python, since one folder serves the host and every "
                            "stack's Python")


def scorer_library(lock: Path) -> Path:
    """A folder holding a lock's pure-Python distributions, built once per lock content under the user
    cache (what the host imports a scorer library from before any package exists)."""
    target = cache_dir() / "scorer-libraries" / hashlib.sha256(lock.read_bytes()).hexdigest()[:16]
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.with_name(target.name + ".lock")):
        if not target.is_dir():
            with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as scratch:
                pins = [line for line in lock.read_text().splitlines() if line.split("#", 1)[0].strip()]
                install_locked(pins, Path(scratch) / "out", Path(scratch))
                (Path(scratch) / "out").rename(target)
    return target


def _pip(args: list[str], what: str) -> None:
    result = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = " | ".join(result.stderr.strip().splitlines()[-4:])
        raise EngineError(f"{what} failed (pip exit {result.returncode}): {tail}")


def activate(plan: Plan, log=lambda message: None) -> None:
    """Builds the plan's task packages and makes their families visible to this (host) process; builds its
    native asset (for its stack's jobs: the host never imports it) and registers the asset's task."""
    build_native(plan, log)
    use_plan(plan)
    target = build(plan, log)
    if target is None or str(target) in sys.path:
        return
    sys.path.insert(0, str(target))
    if (target / DEPENDENCIES).is_dir():
        sys.path.append(str(target / DEPENDENCIES))
    importlib.invalidate_caches()
    from qualification.tasks import registry

    registry.reset()


