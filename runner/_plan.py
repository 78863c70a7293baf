"""Plans: YAML in, a validated Plan record out, with errors located by file, line and field."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import yaml

from runner_contracts import Plan
from runner_contracts.io import explain_error

from . import _task_packages as task_packages
from ._errors import UserError


def _line_of(root: yaml.Node | None, field_path: str) -> int | None:
    """1-based line of the YAML node at a msgspec path like 'budget.steps' or 'seeds[1]'."""
    node = root
    line = node.start_mark.line + 1 if node is not None else None
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", field_path):
        if isinstance(node, yaml.MappingNode):
            match = next((value for key, value in node.value if key.value == part), None)
            if match is None:
                return line
            line = next(key for key, value in node.value if key.value == part).start_mark.line + 1
            node = match
        elif isinstance(node, yaml.SequenceNode) and part.startswith("["):
            index = int(part[1:-1])
            if index >= len(node.value):
                return line
            node = node.value[index]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def load_plan(path: Path) -> Plan:
    """Reads and validates a plan file (YAML or JSON)."""
    try:
        text = path.read_text()
    except OSError as error:
        raise UserError(f"{path}: cannot read plan: {error.strerror}") from None
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise UserError(f"{where}: not valid YAML: {getattr(error, 'problem', error)}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}:1: a plan is a mapping with name, task, policy, reward, sampling, budget")
    task = data.get("task")
    if isinstance(task, dict) and isinstance(task.get("packages"), list):  # a bare path is {path: ...}
        task["packages"] = [{"path": p} if isinstance(p, str) else p for p in task["packages"]]
    try:
        plan = msgspec.convert(data, Plan)
    except msgspec.ValidationError as error:
        field, reason = explain_error(error)
        field = "" if field == "(record)" else field
        line = _line_of(root, field) if field else None
        where = f"{path}:{line}" if line else str(path)
        raise UserError(f"{where}: field {field or '(plan)'}: {reason}") from None
    return task_packages.resolve(plan, path)
