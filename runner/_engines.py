"""Engines by name: local (per-stack virtualenvs), docker and podman (stack images via the docker SDK)."""

from __future__ import annotations

from collections.abc import Callable

from ._container_engine import ContainerEngine
from ._engine import LocalEngine
from ._errors import UserError

ENGINES = ("local", "docker", "podman")
Engine = LocalEngine | ContainerEngine


def make_engine(name: str, *, log: Callable[[str], None] = lambda message: None,
                images: dict[str, str] | None = None) -> Engine:
    """The engine called `name`; `images` maps a stack to an existing image to run as is (container engines)."""
    if name not in ENGINES:
        raise UserError(f"--engine {name!r}: available engines are {', '.join(ENGINES)}")
    if name == "local":
        if images:
            raise UserError("--image needs a container engine (--engine docker or podman)")
        return LocalEngine(log=log)
    return ContainerEngine(name, log=log, images=images)
