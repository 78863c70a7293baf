"""Reading the files a user hands runner (plans aside: runner._plan): text that must exist and be UTF-8, and
TOML decoded into a typed record, every error one line naming the file, the line where known, and the field."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, TypeVar

import msgspec

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


def convert(data: Any, record_type: type[T], path: Path, text: str) -> T:
    try:
        return msgspec.convert(data, record_type)
    except msgspec.ValidationError as error:
        field, message = explain_error(error)
        field = "" if field == "(record)" else field
        line = toml_line(text, field)
        where = f"{path}:{line}" if line else str(path)
        raise UserError(f"{where}: field {field or '(file)'}: {message}") from None
