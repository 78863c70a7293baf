"""Loading a team's native asset inside its stack's process: what a plan's `task.native` names, or one line
saying why it cannot be loaded (the stage fails with it, before any server waits for a dead child)."""

from __future__ import annotations

import importlib
from typing import Any


def import_asset_module(name: str) -> Any:
    """The module, imported here (a SkyRL env module registers its env id on import)."""
    try:
        return importlib.import_module(name)
    except Exception as error:
        raise RuntimeError(f"native asset: importing {name} failed: {type(error).__name__}: {error}") from None


def load_asset(reference: str, kind: str) -> Any:
    """The object `module:attribute` names (`kind` says what it should be: Class, function)."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise RuntimeError(f"native asset: env {reference!r} is not module:{kind}")
    module = import_asset_module(module_name)
    try:
        return getattr(module, attribute)
    except AttributeError as error:
        raise RuntimeError(f"native asset: importing {reference} failed: AttributeError: {error}") from None
