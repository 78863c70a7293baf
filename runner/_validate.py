"""`runner validate`: schema plus per-record consistency for contract files, streamed line by line, in
memory that does not grow with the file."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from qualification.gates import ScratchDatabase

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
    iter_jsonl,
    read_record,
)

MAX_ERRORS_PER_FILE = 20
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


class SeenIds:
    """Episode keys met so far: a set, moved into an SQLite file in a temporary folder once it holds `spill_at`
    keys, so a file of any size is checked for duplicates in bounded memory."""

    def __init__(self, spill_at: int = 400_000):
        self.spill_at = spill_at
        self._keys: set[str] = set()
        self._scratch: ScratchDatabase | None = None

    def add(self, key: str) -> bool:
        """True when `key` is new."""
        if self._scratch is not None:
            return self._scratch.db.execute("INSERT OR IGNORE INTO seen VALUES (?)", (key,)).rowcount == 1
        if key in self._keys:
            return False
        self._keys.add(key)
        if len(self._keys) >= self.spill_at:
            self._scratch = ScratchDatabase("validate", "CREATE TABLE seen (key TEXT PRIMARY KEY) WITHOUT ROWID;")
            self._scratch.db.executemany("INSERT INTO seen VALUES (?)", ((k,) for k in self._keys))
            self._keys = set()
        return True


def _check_trajectory(t: Trajectory, seen: SeenIds) -> list[tuple[str, str]]:
    problems = []
    if not seen.add(f"{t.stage}\0{t.episode_id}"):
        problems.append(("episode_id", f"duplicate episode id {t.episode_id!r} in stage {t.stage!r}"))
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


def validate_file(path: Path) -> FileReport:
    record_type = detect_type(path)
    report = FileReport(path=str(path), contract=getattr(record_type, "__name__", None))

    def add(error: RecordError) -> bool:
        if len(report.errors) >= MAX_ERRORS_PER_FILE:
            report.truncated_errors = True
            return False
        report.errors.append(error)
        return True

    if not path.is_file():
        add(RecordError(path, None, "(file)", "no such file"))
        return report
    if record_type is None:
        add(RecordError(path, 1, "contract", f"cannot tell the record type: name the file one of "
                        f"{', '.join(sorted(_BY_NAME))} (.jsonl/.json) or give records a known 'contract' field"))
        return report
    if not (path.suffix == ".jsonl" or ".jsonl" in path.name):
        try:
            read_record(path, record_type)
            report.records = 1
        except RecordError as error:
            add(error)
        return report
    seen = SeenIds()
    start_line = 1
    while True:
        try:
            for line_no, record in iter_jsonl(path, record_type, start_line=start_line):
                report.records += 1
                checks = (_check_trajectory(record, seen) if isinstance(record, Trajectory)
                          else _check_row(record) if isinstance(record, TrainingRow) else [])
                for field_name, message in checks:
                    if not add(RecordError(path, line_no, field_name, message)):
                        return report
            return report
        except RecordError as error:
            # Keep going after a bad line so one run reports every error in the file (up to the cap).
            if not add(error) or error.line is None:
                return report
            start_line = error.line + 1
