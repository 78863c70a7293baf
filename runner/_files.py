"""Reading the files a user hands runner: text that must exist and be UTF-8, TOML and YAML decoded into
typed records, every error one line naming the file, the line where known, and the field."""

from __future__ import annotations

import json

import math
import re
import tomllib
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import msgspec.inspect
import yaml

from runner_contracts.io import explain_error

from ._errors import UserError

T = TypeVar("T")


def read_text(path: Path, what: str = "file") -> str:
    """The file's text; refuses a missing or unreadable file and bytes that are not UTF-8."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise UserError(f"{path}: cannot read {what}: {error.strerror}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[:error.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[error.start]:02x})") from None


def toml_line(text: str, field: str) -> int | None:
    """The line that assigns `field` ('cpus', 'gpu.lock', 'stages[1]'), searched within its table (TOML
    parsers keep no positions); the table's header when the key is not there; None if neither is found."""
    *tables, key = re.sub(r"\[\d+\]", "", field).split(".")
    lines = text.splitlines()
    start, header = 0, None
    if tables:
        pattern = rf"\s*\[\s*{re.escape('.'.join(tables))}\s*\]"
        header = next((i for i, line in enumerate(lines) if re.match(pattern, line)), None)
        if header is None:
            return None
        start = header + 1
    for number in range(start, len(lines)):
        if re.match(r"\s*\[", lines[number]):
            break
        if re.match(rf"\s*{re.escape(key)}\s*=", lines[number]):
            return number + 1
    return None if header is None else header + 1


def load_toml(path: Path, what: str = "file") -> tuple[str, dict[str, Any]]:
    """The file's text and its TOML table; a syntax error names the line."""
    text = read_text(path, what)
    try:
        return text, tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        reason, _, position = str(error).partition(" (at line ")
        where = f"{path}:{position.split(',')[0]}" if position else str(path)
        raise UserError(f"{where}: not valid TOML: {reason}") from None


def read_toml(path: Path, record_type: type[T], what: str = "file") -> T:
    """The TOML file as `record_type` (a msgspec Struct or dataclass)."""
    text, data = load_toml(path, what)
    return convert(data, record_type, path, text)


def allowed_values(record_type: Any, field: str) -> tuple[Any, ...] | None:
    """The values a Literal field at `field` ('policy.tool_format', 'tools[0].type') admits, else None."""
    node: Any = msgspec.inspect.type_info(record_type)
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", field):
        while isinstance(node, msgspec.inspect.UnionType):  # Optional[...] and unions: the container member
            node = next((t for t in node.types if not isinstance(t, msgspec.inspect.NoneType)), None)
        if isinstance(node, (msgspec.inspect.ListType, msgspec.inspect.TupleType)) and part.startswith("["):
            node = node.item_type if hasattr(node, "item_type") else None
        elif isinstance(node, msgspec.inspect.DictType):
            node = node.value_type
        elif isinstance(node, msgspec.inspect.StructType):
            node = next((f.type for f in node.fields if f.encode_name == part), None)
        else:
            return None
    return tuple(node.values) if isinstance(node, msgspec.inspect.LiteralType) else None


def explain(error: msgspec.ValidationError, record_type: Any) -> tuple[str, str]:
    """(field path, reason) of a validation error; an enum error says which values the field takes."""
    field, message = explain_error(error)
    field = "" if field == "(record)" else field
    values = allowed_values(record_type, field) if field and message.startswith("Invalid enum value") else None
    if values:
        message += f"; expected one of {', '.join(map(str, values))}"
    return field, message


def convert(data: Any, record_type: type[T], path: Path, text: str) -> T:
    try:
        return msgspec.convert(data, record_type)
    except msgspec.ValidationError as error:
        field, message = explain(error, record_type)
        line = toml_line(text, field)
        where = f"{path}:{line}" if line else str(path)
        raise UserError(f"{where}: field {field or '(file)'}: {message}") from None


# --- YAML --------------------------------------------------------------------------------------------


def yaml_line(root: yaml.Node | None, field_path: str) -> int | None:
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


def _compose_and_load(text: str) -> tuple[yaml.Node | None, Any]:
    """The node tree (with line marks) and the data, from one pass of libyaml's parser where PyYAML has it."""
    loader = (yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader)(text)
    try:
        root = loader.get_single_node()
        return root, loader.construct_document(root) if root is not None else None
    finally:
        loader.dispose()


def parse_yaml(path: Path, what: str, shape: str) -> tuple[dict, yaml.Node]:
    """The YAML mapping in `path` and its node tree (for yaml_line); refuses bad YAML, a document that is
    not a mapping (`shape` says what it should be), a key given twice and a non-finite number."""
    text = read_text(path, what)
    try:
        root, data = _compose_and_load(text)
        # JSON is YAML, but YAML 1.1 reads JSON's 1e-06 as a string: a .json file is read as JSON
        data = json.loads(text) if path.suffix == ".json" else data
    except json.JSONDecodeError as error:
        raise UserError(f"{path}:{error.lineno}: not valid JSON: {error.msg}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise UserError(f"{where}: not valid YAML: {getattr(error, 'problem', error)}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}:1: {shape}")
    if duplicate := _duplicate_key(root):
        field, line, first = duplicate
        raise UserError(f"{path}:{line}: field {field}: given twice (first on line {first}); say it once")
    if field := _non_finite(data):
        raise UserError(f"{path}:{yaml_line(root, field)}: field {field}: not a finite number")
    return data, root


def read_yaml(path: Path, record_type: type[T], what: str, shape: str) -> T:
    """The YAML file as `record_type`; a field error names its line."""
    data, root = parse_yaml(path, what, shape)
    return convert_yaml(data, root, record_type, path)


def convert_yaml(data: Any, root: yaml.Node, record_type: type[T], path: Path, whole: str = "(file)") -> T:
    try:
        return msgspec.convert(data, record_type)
    except msgspec.ValidationError as error:
        field, reason = explain(error, record_type)
        line = yaml_line(root, field) if field else None
        raise UserError(f"{path}{f':{line}' if line else ''}: field {field or whole}: {reason}") from None
