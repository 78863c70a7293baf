"""Plans: YAML in, a validated Plan record out, with errors located by file, line and field."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import yaml

from runner_contracts import Plan
from runner_contracts.io import explain_error

from . import _task_packages as task_packages
from ._errors import UserError
from ._files import read_text
from ._plan_checks import plan_problems


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


def _duplicate_key(node: yaml.Node, path: str = "") -> tuple[str, int, int] | None:
    """(field, line, first line) of the first mapping key given twice, anywhere in the document."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
            field = f"{path}.{key.value}" if path else str(key.value)
            if key.value in seen:
                return field, key.start_mark.line + 1, seen[key.value]
            seen[key.value] = key.start_mark.line + 1
            if found := _duplicate_key(value, field):
                return found
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            if found := _duplicate_key(item, f"{path}[{index}]"):
                return found
    return None


def _non_finite(data: Any, path: str = "") -> str | None:
    """The field path of the first NaN or infinity (YAML's .nan, .inf)."""
    if isinstance(data, float) and not math.isfinite(data):
        return path
    children = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in children:
        if found := _non_finite(value, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}".lstrip(".")):
            return found
    return None


def _parse(path: Path) -> tuple[dict, yaml.Node]:
    text = read_text(path, "plan")
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise UserError(f"{where}: not valid YAML: {getattr(error, 'problem', error)}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}:1: a plan is a mapping with name, task, policy, reward, sampling, budget")
    if duplicate := _duplicate_key(root):
        field, line, first = duplicate
        raise UserError(f"{path}:{line}: field {field}: given twice (first on line {first}); say it once")
    if field := _non_finite(data):
        raise UserError(f"{path}:{_line_of(root, field)}: field {field}: not a finite number")
    return data, root


def load_plan(path: Path, log: Callable[[str], None] = lambda message: None) -> Plan:
    """Reads and validates a plan file (YAML or JSON): its types, then, with its task packages built and
    active in this process, every name and cross-field limit in it (runner._plan_checks)."""
    data, root = _parse(path)
    task = data.get("task")
    if isinstance(task, dict) and isinstance(task.get("packages"), list):  # a bare path is {path: ...}
        task["packages"] = [{"path": p} if isinstance(p, str) else p for p in task["packages"]]
    policy = data.get("policy")
    if isinstance(policy, dict) and isinstance(policy.get("path"), str):  # relative to the plan file
        policy["path"] = str((path.parent / Path(policy["path"]).expanduser()).resolve())
    try:
        plan = msgspec.convert(data, Plan)
    except msgspec.ValidationError as error:
        field, reason = explain_error(error)
        field = "" if field == "(record)" else field
        line = _line_of(root, field) if field else None
        where = f"{path}:{line}" if line else str(path)
        raise UserError(f"{where}: field {field or '(plan)'}: {reason}") from None
    plan = task_packages.resolve(plan, path)
    task_packages.activate(plan, log)
    if problem := next(plan_problems(plan), None):
        field, reason = problem
        raise UserError(f"{path}:{_line_of(root, field)}: field {field}: {reason}")
    return plan
