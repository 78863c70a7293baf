"""Task packages: a plan's own task families, from a package outside this project (`task.packages`, local
paths). The host checks each package (a pyproject.toml naming runner.task_families entry points), hashes
its source into the plan (so the plan id covers it), builds it once per content hash into a folder under
the user cache (`pip install --no-deps --target`), and puts that folder on the path of the host and of
every job, under every engine (read-only; the same host path inside containers and SIFs). Stack
environments are never modified, so runs of different plans can share them at the same time."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec

from runner_contracts import Plan, TaskPackage

from ._engines.jobs import file_lock, tree_hash
from ._errors import EngineError, UserError
from ._files import read_toml
from ._paths import task_package_dir

ENTRY_POINT_GROUP = "runner.task_families"


def resolve(plan: Plan, plan_file: Path) -> Plan:
    """The plan with each task package's path made absolute (relative paths are the plan file's), its
    distribution name read and its source tree hashed; refuses a package that cannot provide families."""
    resolved = []
    for index, package in enumerate(plan.task.packages):
        path = (plan_file.parent / package.path).resolve()
        where = f"{plan_file}: field task.packages[{index}]"
        pyproject = path / "pyproject.toml"
        if not pyproject.is_file():
            raise UserError(f"{where}: {path} has no pyproject.toml; a task package is a Python project whose "
                            f"pyproject.toml registers families under [project.entry-points.\"{ENTRY_POINT_GROUP}\"]")
        project = read_toml(pyproject, dict).get("project", {})
        families = project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {})
        if not project.get("name") or not families:
            raise UserError(f"{pyproject}: needs [project] name and at least one family under "
                            f"[project.entry-points.\"{ENTRY_POINT_GROUP}\"]")
        resolved.append(TaskPackage(path=str(path), name=project["name"], sha256=tree_hash([path])))
    if not resolved:
        return plan
    return msgspec.structs.replace(plan, task=msgspec.structs.replace(plan.task, packages=resolved))


def build(plan: Plan, log=lambda message: None) -> Path | None:
    """Builds the plan's task packages into their folder unless it exists; returns the folder."""
    target = task_package_dir(plan)
    if target is None:
        return None
    with file_lock(target.with_name(target.name + ".lock")):
        if target.is_dir():
            return target
        log(f"building task packages {', '.join(p.name or p.path for p in plan.task.packages)} into {target}")
        with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as scratch:
            copies = [shutil.copytree(p.path, Path(scratch) / "src" / str(i),
                                      ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
                      for i, p in enumerate(plan.task.packages)]
            out = Path(scratch) / "out"
            result = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                                     "--disable-pip-version-check", "--no-cache-dir", "--target", str(out),
                                     *map(str, copies)], capture_output=True, text=True, check=False)
            if result.returncode != 0:
                tail = " | ".join(result.stderr.strip().splitlines()[-4:])
                raise EngineError(f"building task packages failed (pip exit {result.returncode}): {tail}")
            for root, dirs, files in os.walk(out):  # jobs run as other users in containers: world-readable
                os.chmod(root, 0o755)
                for name in files:
                    os.chmod(os.path.join(root, name), 0o644)
            out.rename(target)
    return target


def activate(plan: Plan, log=lambda message: None) -> None:
    """Builds the plan's task packages and makes their families visible to this (host) process."""
    target = build(plan, log)
    if target is None or str(target) in sys.path:
        return
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    from qualification.tasks import registry

    registry.reset()


