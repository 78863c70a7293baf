"""`runner validate`: schema plus per-record consistency for contract files, streamed line by line, in
memory that does not grow with the file."""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from qualification.gates import SeenIds, map_in_order

from runner_contracts import (
    RECORD_TYPES,
    EvalRecord,
    Evidence,
    Plan,
    Record,
    RecordError,
    ServiceCase,
    TrainingRow,
    Trajectory,
    decode_line,
    line_ranges,
    read_record,
)

MAX_ERRORS_PER_FILE = 20
PARALLEL_FROM_BYTES = 4 << 20  # smaller files take longer to hand to workers than to check here
CHUNK_BYTES = 16 << 20
MIN_CHUNK_BYTES = 1 << 20
MAX_WORKERS = 8
_BY_NAME = {"trajectories": Trajectory, "training": TrainingRow, "service": ServiceCase, "eval": EvalRecord,
            "evidence": Evidence, "plan": Plan}


@dataclass
class FileReport:
    path: str
    contract: str | None
    records: int = 0
    errors: list[RecordError] = field(default_factory=list)
    truncated_errors: bool = False

    @property
    def ok(self) -> bool:
        return not self.errors


class _Contract(msgspec.Struct):
    contract: str | None = None


def detect_type(path: Path) -> type[Record] | None:
    """The record type a file's first record names (its `contract`), else the one its name says."""
    try:
        with open(path, "rb") as handle:
            first = handle.readline() if path.suffix == ".jsonl" or ".jsonl" in path.name else handle.read()
        name = msgspec.json.decode(first, type=_Contract).contract
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        name = None
    return RECORD_TYPES.get(name or "") or _BY_NAME.get(path.name.split(".", 1)[0])


def _check_trajectory(t: Trajectory) -> list[tuple[str, str]]:
    problems = []
    if not math.isfinite(t.reward):
        problems.append(("reward", f"must be finite, got {t.reward}"))
    for name, value in t.reward_components.items():
        if not math.isfinite(value):
            problems.append((f"reward_components.{name}", f"must be finite, got {value}"))
    for index, segment in enumerate(t.segments):
        logprobs = segment.logprobs
        if segment.source == "policy":
            if logprobs is not None and len(logprobs) == len(segment.token_ids) and math.isfinite(sum(logprobs)):
                continue  # the common case, checked in C; the branches below only name what is wrong
            where = f"segments[{index}]"
            if logprobs is None:
                problems.append((f"{where}.logprobs", "policy segments need one logprob per token, got none"))
            elif len(logprobs) != len(segment.token_ids):
                problems.append((f"{where}.logprobs", f"{len(logprobs)} logprobs for "
                                 f"{len(segment.token_ids)} tokens; expected one per token"))
            else:
                bad = next((i for i, lp in enumerate(logprobs) if not math.isfinite(lp)), None)
                if bad is not None:
                    problems.append((f"{where}.logprobs[{bad}]", "must be a finite number <= 0"))
        elif logprobs is not None:
            problems.append((f"segments[{index}].logprobs",
                             f"only policy segments carry logprobs, this one is {segment.source!r}"))
    return problems


def _check_row(row: TrainingRow) -> list[tuple[str, str]]:
    problems = []
    if len(row.loss_mask) != len(row.input_ids):
        problems.append(("loss_mask", f"{len(row.loss_mask)} entries for {len(row.input_ids)} input_ids"))
    if row.old_logprobs is not None:
        if len(row.old_logprobs) != len(row.input_ids):
            problems.append(("old_logprobs", f"{len(row.old_logprobs)} entries for {len(row.input_ids)} input_ids"))
        elif not math.isfinite(sum(row.old_logprobs)) and not all(map(math.isfinite, row.old_logprobs)):
            problems.append(("old_logprobs", "must be finite"))
    if not math.isfinite(row.advantage):
        problems.append(("advantage", f"must be finite, got {row.advantage}"))
    if not row.episode_ids:
        problems.append(("episode_ids", "a training row must name the episode(s) it came from"))
    return problems


@dataclass
class _Chunk:
    """What one byte range of a JSONL file held: its lines, records, errors (line numbers counted from the
    range's first line) and, for trajectories, each episode's key with its line, for the duplicate check
    across the whole file."""

    lines: int = 0
    records: int = 0
    errors: list[tuple[int, str, str]] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    key_lines: array = field(default_factory=lambda: array("q"))


def _check_range(path: Path, record_type: type[Record], start: int, end: int, last: bool) -> _Chunk:
    """Schema and per-record checks of the lines in [start, end), at most MAX_ERRORS_PER_FILE errors."""
    chunk = _Chunk()
    decoder = msgspec.json.Decoder(record_type)
    check = {Trajectory: _check_trajectory, TrainingRow: _check_row}.get(record_type)
    errors, size = chunk.errors, end - start
    with open(path, "rb", buffering=1 << 20) as handle:
        handle.seek(start)
        for raw in handle:
            if size <= 0:
                break  # the next range's first line
            chunk.lines += 1
            size -= len(raw)
            if last and not raw.endswith(b"\n"):
                errors.append((chunk.lines, "(line)", "truncated line: no newline at end of file"))
                break
            try:
                record = decode_line(raw, record_type, decoder, path, chunk.lines)
            except RecordError as error:
                errors.append((chunk.lines, error.field, error.message))
            else:
                chunk.records += 1
                if record_type is Trajectory:
                    chunk.keys.append(f"{record.stage}\0{record.episode_id}")
                    chunk.key_lines.append(chunk.lines)
                problems = check(record) if check is not None else None
                if problems:
                    errors.extend((chunk.lines, name, message) for name, message in problems)
            if len(errors) >= MAX_ERRORS_PER_FILE:
                break
    return chunk


def _ranges(path: Path, size: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """The non-empty ranges of lines, about `chunk_bytes` each."""
    return [(start, end) for start, end in line_ranges(path, -(-size // chunk_bytes)) if start < end]


def _workers() -> int:
    return min(len(os.sched_getaffinity(0)), MAX_WORKERS)


def validate_file(path: Path, workers: int | None = None) -> FileReport:
    """Validates one contract file. A JSONL file of PARALLEL_FROM_BYTES or more is checked in byte ranges on
    `workers` processes (default: the CPUs this process may use, up to MAX_WORKERS); episode ids are checked
    for duplicates across the whole file here, in memory that does not grow with it (SeenIds)."""
    record_type = detect_type(path)
    report = FileReport(path=str(path), contract=getattr(record_type, "__name__", None))
    if not path.is_file():
        report.errors.append(RecordError(path, None, "(file)", "no such file"))
        return report
    if record_type is None:
        report.errors.append(RecordError(path, 1, "contract", f"cannot tell the record type: name the file one of "
                             f"{', '.join(sorted(_BY_NAME))} (.jsonl/.json) or give records a known 'contract' field"))
        return report
    if not (path.suffix == ".jsonl" or ".jsonl" in path.name):
        try:
            read_record(path, record_type)
            report.records = 1
        except RecordError as error:
            report.errors.append(error)
        return report
    size = path.stat().st_size
    workers = workers or _workers()
    if workers > 1 and size >= PARALLEL_FROM_BYTES:
        ranges = _ranges(path, size, max(MIN_CHUNK_BYTES, min(CHUNK_BYTES, size // (4 * workers))))
    else:
        ranges, workers = [(0, size)], 1
    jobs = [(path, record_type, start, end, end == size) for start, end in ranges]
    seen = SeenIds()
    errors: list[RecordError] = []
    first_line = 0
    with contextlib.ExitStack() as stack:
        if workers > 1:
            pool = stack.enter_context(multiprocessing.get_context("fork").Pool(min(workers, len(jobs))))
            chunks = map_in_order(pool, _check_range_job, jobs, window=2 * workers)
        else:
            chunks = map(_check_range_job, jobs)
        for chunk in chunks:
            report.records += chunk.records
            errors.extend(RecordError(path, first_line + line, name, message) for line, name, message in chunk.errors)
            for index in seen.add_many(chunk.keys):
                stage, episode_id = chunk.keys[index].split("\0", 1)
                errors.append(RecordError(path, first_line + chunk.key_lines[index], "episode_id",
                                          f"duplicate episode id {episode_id!r} in stage {stage!r}"))
            first_line += chunk.lines
            if len(errors) >= MAX_ERRORS_PER_FILE:
                break  # the first errors in the file are in: later ranges can only add later lines
    errors.sort(key=lambda error: error.line or 0)
    report.errors = errors[:MAX_ERRORS_PER_FILE]
    report.truncated_errors = len(errors) > MAX_ERRORS_PER_FILE
    return report


def _check_range_job(job: tuple[Path, type[Record], int, int, bool]) -> _Chunk:
    return _check_range(*job)
