"""Streaming JSONL and atomic file writes. Readers hold one line at a time; writers finalise by
fsync + rename, so a reader never sees a half-written file under its final name."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

import msgspec

from .records import RECORD_TYPES, SUPPORTED_VERSION, Record

R = TypeVar("R", bound=Record)
PARTIAL_SUFFIX = ".partial"

_encoder = msgspec.json.Encoder()


class RecordError(ValueError):
    """A record that does not satisfy the contract, located by file, line and field."""

    def __init__(self, path: str | os.PathLike[str], line: int | None, field: str, message: str):
        self.path, self.line, self.field, self.message = str(path), line, field, message
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {field}: {message}")


class _Header(msgspec.Struct):
    contract: Any = None
    version: Any = None


_header_decoder = msgspec.json.Decoder(_Header)
_CONTRACT_NAMES = {record_type: name for name, record_type in RECORD_TYPES.items()}
_MSGSPEC_PATH = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


_NAMED_FIELD = re.compile(r"Object (?:missing required|contains unknown) field `(?P<name>[^`]+)`")


def explain_error(error: msgspec.DecodeError | msgspec.ValidationError) -> tuple[str, str]:
    """(field path like 'segments[1].logprobs', message) from a msgspec error; '(record)' if no field."""
    match = _MSGSPEC_PATH.match(str(error))
    assert match is not None
    path = (match.group("path") or "").lstrip(".")
    missing = _NAMED_FIELD.search(match.group("msg"))
    if missing:
        path = f"{path}.{missing.group('name')}" if path else missing.group("name")
    return (path or "(record)"), match.group("msg")


def decode_record(data: bytes, record_type: type[R], path: str | os.PathLike[str] = "<input>",
                  line: int | None = None, decoder: msgspec.json.Decoder | None = None) -> R:
    """Decodes one JSON record, refusing newer versions and naming the failing field."""
    decoder = decoder or msgspec.json.Decoder(record_type)
    try:
        record = decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        _raise_with_version_hint(data, record_type, path, line)
        field, message = explain_error(error)
        raise RecordError(path, line, field, message) from None
    version = getattr(record, "version", SUPPORTED_VERSION)
    if version > SUPPORTED_VERSION:
        raise RecordError(path, line, "version",
                          f"version {version} is newer than this reader supports ({SUPPORTED_VERSION}); upgrade runner")
    return record


def _raise_with_version_hint(data: bytes, record_type: type[Record], path, line) -> None:
    try:
        header = _header_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    expected = _CONTRACT_NAMES.get(record_type)
    if isinstance(header.version, int) and header.version > SUPPORTED_VERSION:
        raise RecordError(path, line, "version",
                          f"version {header.version} is newer than this reader supports ({SUPPORTED_VERSION}); "
                          "upgrade runner")
    if isinstance(header.contract, str) and isinstance(expected, str) and header.contract != expected:
        raise RecordError(path, line, "contract", f"expected {expected!r} record, got {header.contract!r}")


def iter_jsonl(path: str | os.PathLike[str], record_type: type[R], *, allow_truncated_tail: bool = False,
               start_line: int = 1, byte_range: tuple[int, int] | None = None) -> Iterator[tuple[int, R]]:
    """Yields (line number, record) from `start_line` on. A partial file's unterminated last line is
    skipped if allowed. With `byte_range` (one of line_ranges), only the lines in [start, end), numbered
    from the range's first line."""
    decoder = msgspec.json.Decoder(record_type)
    decode = decoder.decode
    versioned = "version" in getattr(record_type, "__struct_fields__", ())
    start, end = byte_range or (0, None)
    with open(path, "rb", buffering=1 << 20) as handle:
        handle.seek(start)
        left = math.inf if end is None else end - start
        for line_no, raw in enumerate(handle, 1):
            if left <= 0:
                return
            left -= len(raw)
            if line_no < start_line:
                continue
            if raw[-1] != 10:  # b"\n"
                if allow_truncated_tail:
                    return
                raise RecordError(path, line_no, "(line)", "truncated line: no newline at end of file")
            try:  # decode_line inline: the common case costs no call
                record = decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                record = None
            if record is None or (versioned and record.version > SUPPORTED_VERSION):
                record = _refused(raw, record_type, decoder, path, line_no)
            yield line_no, record


def decode_line(raw: bytes, record_type: type[R], decoder: msgspec.json.Decoder, path: str | os.PathLike[str],
                line_no: int) -> R:
    """One JSONL line's record; a blank line, a bad record or a newer version raises RecordError."""
    try:
        record = decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        record = None
    if record is None or getattr(record, "version", SUPPORTED_VERSION) > SUPPORTED_VERSION:
        return _refused(raw, record_type, decoder, path, line_no)
    return record


def _refused(raw: bytes, record_type: type[R], decoder: msgspec.json.Decoder, path: str | os.PathLike[str],
             line_no: int) -> R:
    """Raises the RecordError that says why a decode refused `raw` (a blank line, the failing field, a newer
    version)."""
    if not raw.strip():
        raise RecordError(path, line_no, "(line)", "empty line")
    return decode_record(raw, record_type, path, line_no, decoder)


def line_ranges(path: str | os.PathLike[str], parts: int) -> list[tuple[int, int]]:
    """`parts` [start, end) byte ranges that cover the file in order, each of about the same size and each
    ending at a newline (or the file's end); a range is empty when one line spans several."""
    size = os.path.getsize(path)
    bounds = [0]
    with open(path, "rb") as handle:
        for part in range(1, parts):
            offset = size * part // parts
            if offset <= bounds[-1]:
                bounds.append(bounds[-1])
                continue
            handle.seek(offset - 1)  # a range that would start just after a newline starts there
            handle.readline()
            bounds.append(min(handle.tell(), size))
    bounds.append(size)
    return list(zip(bounds, bounds[1:]))


def read_jsonl(path: str | os.PathLike[str], record_type: type[R], **kwargs: Any) -> list[R]:
    return [record for _, record in iter_jsonl(path, record_type, **kwargs)]


def encode(record: Record) -> bytes:
    return _encoder.encode(record)


def read_record(path: str | os.PathLike[str], record_type: type[R]) -> R:
    return decode_record(Path(path).read_bytes(), record_type, path)


class JsonlWriter:
    """Appends records to `<path>.partial`; `close()` fsyncs and renames it to `path`.

    `flush()` makes every record written so far durable, so a killed writer leaves whole lines in the
    partial file. Used as a context manager, an exception leaves the partial file in place, marked.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.partial_path = self.path.with_name(self.path.name + PARTIAL_SUFFIX)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle: IO[bytes] | None = open(self.partial_path, "wb")
        self.count = 0

    def write(self, record: Record) -> None:
        assert self._handle is not None, "writer is closed"
        self._handle.write(_encoder.encode(record) + b"\n")
        self.count += 1

    def flush(self) -> None:
        assert self._handle is not None
        self._handle.flush()
        os.fsync(self._handle.fileno())

    def close(self) -> Path:
        if self._handle is not None:
            self.flush()
            self._handle.close()
            self._handle = None
            os.replace(self.partial_path, self.path)
            _fsync_dir(self.path.parent)
        return self.path

    def abandon(self) -> Path:
        """Closes without finalising: the data stays under the .partial name."""
        if self._handle is not None:
            self.flush()
            self._handle.close()
            self._handle = None
        return self.partial_path

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Writes bytes to a temp name in the same folder, fsyncs, renames."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. a full disk: the old file stays, no half-written twin
        raise
    _fsync_dir(path.parent)
    return path


def write_record(path: str | os.PathLike[str], record: Record) -> Path:
    """Writes one record as pretty JSON, atomically."""
    return write_atomic(path, msgspec.json.format(_encoder.encode(record), indent=2) + b"\n")
