"""Where things live: the repository's stacks and plans, the user cache, run directories."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from runner_contracts import AnyPlan, DomainPlan

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def stacks_dir() -> Path:
    return Path(os.environ.get("RUNNER_STACKS_DIR", PROJECT_ROOT / "stacks"))


def cache_dir() -> Path:
    """RUNNER_CACHE_DIR, else $XDG_CACHE_HOME/runner, else ~/.cache/runner."""
    if "RUNNER_CACHE_DIR" in os.environ:
        return Path(os.environ["RUNNER_CACHE_DIR"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "runner"


def task_package_dir(plan: AnyPlan) -> Path | None:
    """Where a plan's task packages are built (one folder per set of package contents), or None."""
    if isinstance(plan, DomainPlan) or not plan.task.packages:
        return None
    digest = hashlib.sha256("\0".join(p.sha256 or "" for p in plan.task.packages).encode()).hexdigest()[:16]
    return cache_dir() / "task-packages" / digest


def native_asset_dir(plan: AnyPlan) -> Path | None:
    """Where a plan's native asset is built (one folder per package content), or None."""
    native = None if isinstance(plan, DomainPlan) else plan.task.native
    return cache_dir() / "native-assets" / (native.sha256 or "")[:16] if native is not None else None


def job_paths(plan: AnyPlan, stack: str) -> list[Path]:
    """What goes on a job's PYTHONPATH: the plan's task packages, and its native asset for the asset's own
    stack's jobs only (the trainer's and the host's processes never import it)."""
    paths = [task_package_dir(plan)]
    if native_asset_dir(plan) is not None and plan.task.native.stack == stack:
        paths.insert(0, native_asset_dir(plan))
    return [path for path in paths if path is not None]


def local_packages() -> dict[str, Path]:
    """Our own small distributions installed into every stack environment, by name."""
    return {
        "runner-contracts": PROJECT_ROOT / "contracts",
        "runner-qualification": PROJECT_ROOT / "qualification",
        "runner-kit": PROJECT_ROOT / "kit",
    }
