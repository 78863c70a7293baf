"""Engines: where a stack's adapter jobs run. local (per-stack virtualenvs, the embedded default),
docker and podman (stack images through the docker SDK), apptainer (stack SIFs on a cluster node).

Every engine meets the `Engine` protocol below; stages see nothing else. Engines are registered as lazy
`module:Class` strings, so running locally never imports the docker SDK."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from runner_contracts import StageRequest

from .._errors import UserError
from .._stacks import StackManifest
from .jobs import RunOutcome, StackEnvironment

ENGINE_CLASSES = {
    "local": "runner._engines.local:LocalEngine",
    "docker": "runner._engines.container:ContainerEngine",
    "podman": "runner._engines.container:ContainerEngine",
    "apptainer": "runner._engines.apptainer:ApptainerEngine",
}
ENGINES = tuple(ENGINE_CLASSES)
IMAGE_ENGINES = ("docker", "podman")  # engines that can run a given image as is (--image)


class Service(Protocol):
    """A running rollout service job: its url, its folder, whether it still runs, and how to stop it."""

    url: str
    out_dir: Path

    def alive(self) -> bool: ...

    def kill_processes(self, pids: list[int]) -> list[int]:
        """SIGKILLs those of `pids` (as the service sees them, in its own pid namespace) that are processes
        of this service, each with everything below it; returns the ones it killed. Any other pid is left
        alone: the host kills only what it started."""
        ...

    def stop(self, grace_s: float = 10.0) -> int | None: ...


class Engine(Protocol):
    """Lifecycle of a stack's jobs: `prepare` builds or finds the stack's environment once per arm; `run`
    runs one job to its end (killed on timeout or when `kill_when()` turns true), `start_service` starts a
    long-running one and returns once it is ready. A job started with `peer` shares that service's
    network (an environment arm's trainer job and its rollout service)."""

    name: str

    def prepare(self, manifest: StackManifest) -> StackEnvironment: ...

    def run(self, env: StackEnvironment, request: StageRequest, *, timeout_s: float,
            kill_when: Callable[[], bool] | None = None, peer: Service | None = None) -> RunOutcome: ...

    def start_service(self, env: StackEnvironment, request: StageRequest, *,
                      ready_timeout_s: float = 300.0) -> Service: ...


def check_engine(name: str, image: str | None = None) -> None:
    if name not in ENGINES:
        raise UserError(f"--engine {name!r}: available engines are {', '.join(ENGINES)}")
    if image and name not in IMAGE_ENGINES:
        raise UserError("--image needs --engine docker or podman (apptainer takes <RUNNER_SIF_DIR>/<stack>.sif)")


def make_engine(name: str, *, log: Callable[[str], None] = lambda message: None,
                images: dict[str, str] | None = None) -> Engine:
    """The engine called `name`; `images` maps a stack to an existing image to run as is (container engines)."""
    check_engine(name, next(iter((images or {}).values()), None))
    module, _, cls = ENGINE_CLASSES[name].partition(":")
    engine_class = getattr(importlib.import_module(module), cls)
    if name in IMAGE_ENGINES:
        return engine_class(name, log=log, images=images)
    return engine_class(log=log)
