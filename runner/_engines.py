"""Engines by name: local (per-stack virtualenvs), docker and podman (stack images via the docker SDK),
apptainer (stack SIFs on a cluster node)."""

from __future__ import annotations

from collections.abc import Callable

from ._apptainer import ApptainerEngine
from ._container_engine import ContainerEngine
from ._engine import LocalEngine
from ._errors import UserError

ENGINES = ("local", "docker", "podman", "apptainer")
Engine = LocalEngine | ContainerEngine | ApptainerEngine


def check_engine(name: str) -> None:
    if name not in ENGINES:
        raise UserError(f"--engine {name!r}: available engines are {', '.join(ENGINES)}")


def make_engine(name: str, *, log: Callable[[str], None] = lambda message: None,
                images: dict[str, str] | None = None) -> Engine:
    """The engine called `name`; `images` maps a stack to an existing image to run as is (container engines)."""
    check_engine(name)
    if name in ("local", "apptainer") and images:
        raise UserError("--image needs --engine docker or podman (apptainer takes <RUNNER_SIF_DIR>/<stack>.sif)")
    if name == "local":
        return LocalEngine(log=log)
    if name == "apptainer":
        return ApptainerEngine(log=log)
    return ContainerEngine(name, log=log, images=images)
