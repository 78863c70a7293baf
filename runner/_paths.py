"""Where things live: the repository's stacks and plans, the user cache, run directories."""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def stacks_dir() -> Path:
    return Path(os.environ.get("RUNNER_STACKS_DIR", PROJECT_ROOT / "stacks"))


def cache_dir() -> Path:
    """RUNNER_CACHE_DIR, else $XDG_CACHE_HOME/runner, else ~/.cache/runner."""
    if "RUNNER_CACHE_DIR" in os.environ:
        return Path(os.environ["RUNNER_CACHE_DIR"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "runner"


def local_packages() -> dict[str, Path]:
    """Our own small distributions installed into every stack environment, by name."""
    return {
        "runner-contracts": PROJECT_ROOT / "contracts",
        "runner-qualification": PROJECT_ROOT / "qualification",
        "runner-kit": PROJECT_ROOT / "kit",
    }
