"""Canonical JSON and sha256 helpers; plan ids are sha256 of the canonical plan without `plan_id`."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import msgspec

from .records import Plan


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8, finite floats only."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_path(path: str | os.PathLike[str]) -> str:
    """A file's sha256; for a folder (a dataset in its upstream's layout), the sha256 of its files' relative
    paths and sha256s, one "<path>\\0<sha256>\\n" line each in path order."""
    root = os.fspath(path)
    if not os.path.isdir(root):
        return sha256_file(root)
    lines = []
    for folder, _, files in os.walk(root):
        for name in files:
            full = os.path.join(folder, name)
            lines.append(f"{os.path.relpath(full, root).replace(os.sep, '/')}\0{sha256_file(full)}\n")
    return sha256_bytes("".join(sorted(lines)).encode())


def plan_id(plan: Plan) -> str:
    body = msgspec.to_builtins(plan)
    body.pop("plan_id", None)
    for late in ("release", "evaluation", "distill"):  # added after the first plans were frozen; absent, they change no id
        if body.get(late) is None:
            body.pop(late, None)
    if not body.get("harnesses", True):
        body.pop("harnesses")
    if body.get("budget", {}).get("episode_timeout_s", 0) is None:
        body["budget"].pop("episode_timeout_s")
    return sha256_bytes(canonical_json(body))


def freeze_plan(plan: Plan) -> Plan:
    """The plan with its plan_id set."""
    return msgspec.structs.replace(plan, plan_id=plan_id(plan))
