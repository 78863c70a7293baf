"""Where task families come from: the `runner.task_families` entry point group. This package registers its
own four there; a team's package registers its families the same way, and once it is installed (on the
host and in every stack environment) a plan names them like any other. Families load lazily, once per
process. Families are found by name only: episodes, items and stack processes all carry the name."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import threading
from dataclasses import dataclass

from .base import TaskFamily

GROUP = "runner.task_families"
REQUIRED = ("name", "scorer_version", "synthetic", "system_prompt", "tools", "frozen_splits", "generate",
            "initial_state", "call_tool", "score", "demonstration", "scripted_cases")


class FamilyError(KeyError):
    """A family that cannot be found or loaded; the message says which and why."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class FamilySource:
    """Where a family was found: its entry point's module:Class, distribution and version."""

    name: str
    reference: str  # module:Class
    distribution: str | None
    version: str | None

    def describe(self) -> str:
        return f"{self.distribution} {self.version}" if self.distribution else self.reference


@functools.cache
def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for point in importlib.metadata.entry_points(group=GROUP):
        found.setdefault(point.name, point)  # the first installed distribution wins, as importlib orders them
    return found


def _source(name: str, point: importlib.metadata.EntryPoint) -> FamilySource:
    return FamilySource(name=name, reference=point.value, distribution=point.dist.name if point.dist else None,
                        version=point.dist.version if point.dist else None)


def sources() -> dict[str, FamilySource]:
    """Every family registered in this environment, by name."""
    return {name: _source(name, point) for name, point in sorted(_entry_points().items())}


_registered: dict[str, TaskFamily] = {}
# Episode threads ask for their family all at once when a batch starts; the first loads it (reading every
# distribution's entry points, ~0.1 s of CPU), the others wait for it instead of each doing the same.
_loading = threading.RLock()


def register(family: TaskFamily) -> None:
    """Makes `family` known by its name in this process, ahead of the entry points (a plan's native task)."""
    _registered[family.name] = family


def source_of(name: str) -> FamilySource:
    if name in _registered:
        native = getattr(_registered[name], "native", None)
        where = f"{native.stack} native asset {native.env} ({native.package or native.requirement})" if native else "registered"
        return FamilySource(name=name, reference=where, distribution=None, version=None)
    points = _entry_points()
    if name not in points:
        raise FamilyError(f"unknown task family {name!r}; known: {', '.join(sorted(points))} (a family from "
                          f"another package is registered under the {GROUP!r} entry point group)")
    return _source(name, points[name])


def get_family(name: str) -> TaskFamily:
    """The family registered under `name`, instantiated once."""
    if name in _registered:
        return _registered[name]
    with _loading:
        return _load_family(name)


@functools.cache
def _load_family(name: str) -> TaskFamily:
    reference = source_of(name).reference
    module_name, _, attribute = reference.partition(":")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise FamilyError(f"task family {name!r}: cannot load {reference} ({error})") from None
    family = target() if isinstance(target, type) else target
    missing = [attr for attr in REQUIRED if not hasattr(family, attr)]
    if missing:
        raise FamilyError(f"task family {name!r} ({reference}) lacks {', '.join(missing)} of the TaskFamily "
                          "interface (qualification.tasks.TaskFamily)")
    if family.name != name:
        raise FamilyError(f"task family {name!r} ({reference}) calls itself {family.name!r}; the entry point "
                          "name and the family's name must agree")
    return family


def reset() -> None:
    """Forget what was found, so families on a path added since are seen (a plan's task packages)."""
    with _loading:
        _entry_points.cache_clear()
        _load_family.cache_clear()


def families() -> dict[str, TaskFamily]:
    """Every registered family, loaded."""
    return {name: get_family(name) for name in sources()}
