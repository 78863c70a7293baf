"""Where things live: the repository's stacks and plans, the user cache, run directories."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from runner_contracts import Plan

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def stacks_dir() -> Path:
    return Path(os.environ.get("RUNNER_STACKS_DIR", PROJECT_ROOT / "stacks"))


def cache_dir() -> Path:
    """RUNNER_CACHE_DIR, else $XDG_CACHE_HOME/runner, else ~/.cache/runner."""
    if "RUNNER_CACHE_DIR" in os.environ:
        return Path(os.environ["RUNNER_CACHE_DIR"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "runner"


def task_package_dir(plan: Plan) -> Path | None:
    """Where a plan's task packages are built (one folder per set of package contents), or None."""
    if not plan.task.packages:
        return None
    digest = hashlib.sha256("\0".join(p.sha256 or "" for p in plan.task.packages).encode()).hexdigest()[:16]
    return cache_dir() / "task-packages" / digest


def local_packages() -> dict[str, Path]:
    """Our own small distributions installed into every stack environment, by name."""
    return {
        "runner-contracts": PROJECT_ROOT / "contracts",
        "runner-qualification": PROJECT_ROOT / "qualification",
        "runner-kit": PROJECT_ROOT / "kit",
    }
