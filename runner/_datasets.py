"""A team's dataset file (JSONL, CSV or Parquet of prompts and reference answers) turned into a task
package: every row checked (file, line or row, column), splits taken from a column or by a stable hash of the prompt, the rows
normalised into the package's data.jsonl, a family (qualification.tasks.dataset.DatasetFamily)
registered under the runner.task_families entry point group. A plan then names the package in
task.packages, so its content hash, and so the data's, is part of the plan id."""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import inspect
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import msgspec

from qualification.tasks import FamilyError
from qualification.tasks.dataset import (MATH_LOCK, MATH_REQUIREMENT, SCORERS, letter, math_expression, number,
                                         run_tool, tool_row)
from qualification.tasks.native import parquet_rows
from runner_contracts import write_atomic

from ._errors import UserError
from ._files import convert_yaml, parse_yaml, yaml_line

SPLITS = ("train", "heldout", "retention")


@dataclass(frozen=True)
class Columns:
    id: str = "id"
    prompt: str = "prompt"
    answer: str = "answer"
    split: str | None = "split"
    pattern: str = "pattern"
    system: str = "system"  # optional: the row's own system prompt
    metadata: tuple[str, ...] = ()  # optional columns kept with the row (its reference's "metadata")
    calls: str = "calls"  # tool datasets: the tool calls of a correct episode (a JSON list)


class ToolParameter(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    type: Literal["string", "integer", "number"]
    description: str = ""


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    description: str
    parameters: list[ToolParameter] = []


class ToolsFile(msgspec.Struct, forbid_unknown_fields=True):
    """The sidecar a tool-using dataset declares its tools in (YAML)."""

    module: str  # a Python file beside the sidecar: initial_state(row) (optional) and one function per tool
    tools: list[Tool]
    require_tool_call: bool = True  # success needs a tool call that did not fail


@dataclass(frozen=True)
class DatasetTools:
    path: Path
    declared: ToolsFile
    module_path: Path
    module: ModuleType

    def initial_state(self, row: dict) -> dict:
        seen = tool_row(row)
        return self.module.initial_state(seen) if hasattr(self.module, "initial_state") else {"row": seen}


PYTHON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float)}


def read_tools(path: Path) -> DatasetTools:
    """The sidecar and its module, checked: every tool has a function taking (state, **its parameters)."""
    shape = "a tools file is a mapping with module (a .py file beside it) and tools (name, description, parameters)"
    data, root = parse_yaml(path, "tools file", shape)
    declared = convert_yaml(data, root, ToolsFile, path)
    if not declared.tools:
        raise UserError(f"{path}:{yaml_line(root, 'tools')}: field tools: empty; declare at least one tool")
    names = [tool.name for tool in declared.tools]
    for index, tool in enumerate(declared.tools):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", tool.name) or names.index(tool.name) != index:
            raise UserError(f"{path}:{yaml_line(root, f'tools[{index}].name')}: field tools[{index}].name: "
                            f"{tool.name!r} is not a unique Python identifier")
    module_path = (path.parent / declared.module).resolve()
    if module_path.suffix != ".py" or not module_path.is_file():
        raise UserError(f"{path}:{yaml_line(root, 'module')}: field module: {module_path} is not a Python file")
    spec = importlib.util.spec_from_file_location(f"runner_dataset_tools_{abs(hash(module_path))}", module_path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # the team's module: any failure is a bad input
        raise UserError(f"{module_path}: importing it failed: {type(error).__name__}: {error}") from None
    for index, tool in enumerate(declared.tools):
        where = f"{path}:{yaml_line(root, f'tools[{index}]')}: field tools[{index}]"
        function = getattr(module, tool.name, None)
        if not callable(function):
            raise UserError(f"{where}: {module_path.name} has no function {tool.name}(state, ...)")
        try:
            inspect.signature(function).bind({}, **{p.name: None for p in tool.parameters})
        except TypeError as error:
            raise UserError(f"{where}: {module_path.name}:{tool.name} cannot be called as {tool.name}(state, "
                            f"{', '.join(p.name for p in tool.parameters)}) ({error})") from None
    return DatasetTools(path, declared, module_path, module)


def _calls(where: str, column: str, raw: Any, tools: DatasetTools, row: dict) -> list[dict]:
    """A row's reference tool calls, checked against the declared tools and replayed without an error."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as error:
            raise UserError(f"{where}: column {column!r}: not valid JSON ({error.msg})") from None
    if not isinstance(raw, list) or not all(isinstance(c, dict) for c in raw):
        raise UserError(f"{where}: column {column!r}: expected a JSON list of {{\"name\", \"arguments\"}} calls")
    declared = {tool.name: {p.name: p.type for p in tool.parameters} for tool in tools.declared.tools}
    state, calls = tools.initial_state(row), []
    for index, call in enumerate(raw, 1):
        name, arguments = call.get("name"), call.get("arguments", {})
        if name not in declared:
            raise UserError(f"{where}: column {column!r}: call {index} names {name!r}; {tools.path.name} declares "
                            f"{', '.join(declared)}")
        if not isinstance(arguments, dict) or set(arguments) != set(declared[name]):
            raise UserError(f"{where}: column {column!r}: call {index} {name}: arguments must be exactly "
                            f"{', '.join(declared[name]) or 'none'}")
        for key, value in arguments.items():
            kind = declared[name][key]
            if isinstance(value, bool) or not isinstance(value, PYTHON_TYPES[kind]):
                raise UserError(f"{where}: column {column!r}: call {index} {name}: argument {key} is not a {kind}")
        result = run_tool(tools.module, state, name, arguments)
        if result.startswith("error:"):
            raise UserError(f"{where}: column {column!r}: call {index} {name} returned {result!r}")
        calls.append({"name": name, "arguments": arguments})
    return calls


def _records(path: Path) -> list[tuple[str, str, dict]]:
    """(where, place, record) for each row: `where` names the file and the row's line (JSONL, CSV) or row
    number (Parquet), `place` the line or row alone; refuses what is not such a file of objects."""
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    if path.suffix == ".jsonl":
        found = []
        for line_number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise UserError(f"{path}:{line_number}: not valid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise UserError(f"{path}:{line_number}: expected a JSON object per line")
            found.append((f"{path}:{line_number}", f"line {line_number}", record))
        return found
    if path.suffix == ".csv":
        with open(path, newline="") as handle:  # line 1 is the header
            return [(f"{path}:{index + 2}", f"line {index + 2}", row) for index, row in enumerate(csv.DictReader(handle))]
    if path.suffix == ".parquet":
        try:
            table = parquet_rows(path)
        except FamilyError as error:
            raise UserError(str(error)) from None
        return [(f"{path}: row {index + 1}", f"row {index + 1}", row) for index, row in enumerate(table)]
    raise UserError(f"{path}: expected a .jsonl, .csv or .parquet file")


def _math_library() -> None:
    """Makes math-verify importable here, from the scorer's lock built under the user cache if needed."""
    try:
        import math_verify  # noqa: F401
    except ImportError:
        from ._task_packages import scorer_library

        sys.path.insert(0, str(scorer_library(MATH_LOCK)))


def read_dataset(path: Path, scorer: str, columns: Columns = Columns(), heldout_share: float = 0.25,
                 tools: DatasetTools | None = None) -> list[dict]:
    """Normalised rows {"id", "prompt", "answer", "split"[, "pattern", "system", "metadata", "calls"]}; every
    problem is one UserError naming the file, line (or row) and column."""
    if scorer not in SCORERS:
        raise UserError(f"--scorer {scorer!r}: scorers are {', '.join(SCORERS)}")
    rows, seen_ids, prompts = [], {}, {}
    records = _records(path)
    if not records:
        raise UserError(f"{path}: no rows")
    if scorer == "math":
        _math_library()
    for where, place, record in records:
        def value(column: str | None, required: bool = True) -> str:
            text = "" if column is None or record.get(column) is None else str(record[column]).strip()
            if required and not text:
                raise UserError(f"{where}: column {column!r}: missing or empty (columns here: "
                                f"{', '.join(sorted(record))})")
            return text

        row_id, prompt, answer = value(columns.id), value(columns.prompt), value(columns.answer)
        if row_id in seen_ids:
            raise UserError(f"{where}: column {columns.id!r}: duplicate id {row_id!r} (first on "
                            f"{seen_ids[row_id]})")
        seen_ids[row_id] = place
        split = value(columns.split, required=False) if columns.split and columns.split in record else ""
        if split and split not in SPLITS:
            raise UserError(f"{where}: column {columns.split!r}: {split!r} is not one of {', '.join(SPLITS)}")
        if not split:
            bucket = int(hashlib.sha256(prompt.encode()).hexdigest(), 16) % 10_000 / 10_000
            split = "heldout" if bucket < heldout_share else "train"
        if scorer == "numeric" and number(answer) is None:
            raise UserError(f"{where}: column {columns.answer!r}: {answer!r} is not a number (scorer numeric)")
        if scorer == "choice" and letter(answer) is None:
            raise UserError(f"{where}: column {columns.answer!r}: {answer!r} is not an option letter "
                            "(scorer choice)")
        if scorer == "math" and math_expression(answer) is None:
            raise UserError(f"{where}: column {columns.answer!r}: {answer!r} is not an expression math-verify "
                            "can read (scorer math)")
        row = {"id": re.sub(r"[^A-Za-z0-9_.-]", "_", row_id), "prompt": prompt, "answer": answer, "split": split}
        if scorer == "regex":
            pattern = value(columns.pattern)
            try:
                re.compile(pattern)
            except re.error as error:
                raise UserError(f"{where}: column {columns.pattern!r}: not a regular expression ({error})") \
                    from None
            if not re.fullmatch(pattern, answer):
                raise UserError(f"{where}: column {columns.pattern!r}: does not match the row's own answer")
            row["pattern"] = pattern
        if value(columns.system, required=False):
            row["system"] = value(columns.system)
        if columns.metadata:
            missing = [column for column in columns.metadata if column not in record]
            if missing:
                raise UserError(f"{where}: column {missing[0]!r}: missing (a --metadata-column; columns here: "
                                f"{', '.join(sorted(record))})")
            row["metadata"] = {column: json.loads(json.dumps(record[column], default=str))  # Parquet dates, bytes
                               for column in columns.metadata}
        if tools is not None:
            raw = record.get(columns.calls)
            if raw in (None, "", []):
                if tools.declared.require_tool_call:
                    raise UserError(f"{where}: column {columns.calls!r}: missing; {tools.path.name} sets "
                                    "require_tool_call, so every row needs the tool calls of a correct episode")
            else:
                row["calls"] = _calls(where, columns.calls, raw, tools, row)
        key = " ".join(prompt.casefold().split())
        earlier = prompts.get(key)
        if earlier and {earlier[1], split} == {"train", "heldout"}:
            raise UserError(f"{where}: column {columns.prompt!r}: the same prompt is in train and heldout "
                            f"({earlier[0]})")
        prompts.setdefault(key, (place, split))
        rows.append(row)
    if not any(row["split"] == "train" for row in rows):
        raise UserError(f"{path}: no train rows (split column {columns.split!r}, or --heldout-share below 1)")
    return rows


def write_package(out: Path, name: str, rows: list[dict], scorer: str, *, tolerance: float,
                  system_prompt: str, tools: DatasetTools | None = None) -> Path:
    """A task package in `out` holding the rows and a family named `name` (with a tool dataset's tools.json
    and its module as the package's `tools` module); returns `out`."""
    if not re.fullmatch(r"[a-z][a-z0-9-]*", name):
        raise UserError(f"--name {name!r}: lower-case letters, digits and dashes, starting with a letter")
    module = "dataset_" + name.replace("-", "_")
    source = out / "src" / module
    source.mkdir(parents=True, exist_ok=True)
    write_atomic(source / "data.jsonl", "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode())
    tool_arguments, data_files = "", ["data.jsonl"]
    if tools is not None:
        write_atomic(source / "tools.json", json.dumps(msgspec.to_builtins(tools.declared), indent=1).encode())
        write_atomic(source / "tools.py", tools.module_path.read_bytes())
        tool_arguments = ", tools=Path(__file__).with_name('tools.json'), implementation=__name__ + '.tools'"
        data_files.append("tools.json")
    write_atomic(source / "__init__.py", (
        f'"""Task family {name!r}, generated by `runner tasks from-dataset` from {len(rows)} rows."""\n\n'
        "from pathlib import Path\n\nfrom qualification.tasks.dataset import DatasetFamily\n\n"
        f"FAMILY = DatasetFamily({name!r}, Path(__file__).with_name('data.jsonl'), {scorer!r}, "
        f"tolerance={tolerance!r}, system_prompt={system_prompt!r}{tool_arguments})\n").encode())
    dependencies = f'dependencies = ["{MATH_REQUIREMENT}"]\n' if scorer == "math" else ""
    write_atomic(out / "pyproject.toml", (
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "{module.replace("_", "-")}"\nversion = "1.0.0"\nrequires-python = ">=3.10"\n'
        f'{dependencies}\n[tool.setuptools.packages.find]\nwhere = ["src"]\n\n'
        f'[tool.setuptools.package-data]\n{module} = {json.dumps(data_files)}\n\n'
        f'[project.entry-points."runner.task_families"]\n{name} = "{module}:FAMILY"\n').encode())
    if scorer == "math":  # the scorer's library, pinned with hashes (installed into the package's folder)
        write_atomic(out / "requirements.lock", MATH_LOCK.read_bytes())
    return out
