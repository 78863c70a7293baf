"""Trace-fidelity audit over trajectories.jsonl and training.jsonl, computed on the host from files.

Nothing the adapter claims is taken on trust: tokens, masks, logprobs, groups and revisions are all
checked against each other. The two files are read together: a training row is checked as soon as the
episodes it names have been read, against the episodes read last (WINDOW_TOKENS tokens of them), kept in
memory. So the audit's memory does not grow with the number of episodes, and in the usual file order nothing
touches the disk:
- an episode that leaves the window before a row trained it waits in an SQLite file in a temporary folder;
- a row that names an episode trained earlier and already dropped is checked in a second read of the
  trajectories, with the episodes such rows name.

Large files are audited in parts (add_files): part k is the k-th of equal byte ranges of each file, audited on
a worker process as above; here the parts' figures are merged in order, episode ids are checked across parts,
and the rows a part could not check (their episodes lie in another part) are checked against the episodes no
part trained. The number of parts depends on the files' sizes alone, so the figures do too. A part reads a row's
input_ids and loss_mask as JSON text and compares it with the encoding of the episode's tokens and provenance
(the contracts' writer's, msgspec): a row written that way is not decoded into lists, one that differs is decoded
and checked as in a whole audit.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import multiprocessing
import os
import struct
from array import array
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain, compress, islice
from operator import itemgetter
from pathlib import Path

import msgspec

from runner_contracts import GateResult, RecordError, TrainingRow, Trajectory, decode_record, iter_jsonl, line_ranges

from .mismatch import DOUBLE, MismatchPanel
from .scratch import ScratchDatabase, SeenIds, map_in_order

MAX_EXAMPLES = 3
COUNTED = ("episodes", "policy_tokens", "episodes_with_tool_calls", "trained_tokens", "logprob_pairs")
POLICY, OTHER = b"\x01", b"\x00"
_ENVIRONMENT_SOURCES = frozenset(("tool", "env"))
WINDOW_TOKENS = 1 << 18  # tokens of the episodes kept in memory for the rows that name them (~10 MB at most)
PARALLEL_FROM_BYTES = 8 << 20  # both files together; smaller ones are audited in one part, in this process
PART_BYTES = 8 << 20  # of trajectories.jsonl per part
MAX_WORKERS = 8


class _Episode(msgspec.Struct, gc=False):  # a Struct: built in C, one for every trajectory read
    """What a training row is checked against: the episode's tokens, provenance (one byte a token, 1 for the
    policy's) and policy logprobs (packed doubles, as the mismatch panel takes them), and whether a row
    trained it."""

    tokens: list[int]
    provenance: bytes
    logprobs: bytes
    trained: bool = False
    stored: bool = False  # in the SQLite file, whose trained flag follows this one


def _with_raw_lists(record_type: type[msgspec.Struct], names: tuple[str, ...]) -> type[msgspec.Struct]:
    """`record_type` with the fields `names` read as JSON text (msgspec.Raw)."""
    fields = []
    for f in msgspec.structs.fields(record_type):
        kind = msgspec.Raw if f.name in names else f.type
        if f.required:
            fields.append((f.name, kind))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, kind, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, kind, f.default))
    return msgspec.defstruct(f"_RawLists{record_type.__name__}", fields, kw_only=True, forbid_unknown_fields=True,
                             gc=False)


# A TrainingRow as a part reads it: input_ids and loss_mask stay JSON text, compared with msgspec's encoding of the
# episode's tokens and provenance (the contracts' writer's); only a row that differs has them decoded and checked
# against the contract (`_decoded`). They are most of a row's decoding.
_RawListsRow = _with_raw_lists(TrainingRow, ("input_ids", "loss_mask"))


class _Spilled:
    """Episodes that left the window untrained, and rows put off to the second read, in an SQLite file in a
    temporary folder that is deleted with this object."""

    def __init__(self) -> None:
        self._scratch = ScratchDatabase("audit", """
            CREATE TABLE episodes (id TEXT PRIMARY KEY, tokens BLOB, is_policy BLOB, logprobs BLOB, trained INTEGER);
            CREATE TABLE deferred (row BLOB);
            CREATE TABLE left (row BLOB);
            CREATE TABLE needed (id TEXT PRIMARY KEY) WITHOUT ROWID;""")
        self.db = self._scratch.db
        self.episodes = self.deferred = self.left = 0

    def put(self, episode_id: str, episode: _Episode) -> None:
        self.db.execute("INSERT OR IGNORE INTO episodes VALUES (?, ?, ?, ?, ?)",
                        (episode_id, array("q", episode.tokens).tobytes(), episode.provenance,
                         episode.logprobs, int(episode.trained)))
        episode.stored = True
        self.episodes += 1

    def get(self, episode_id: str) -> _Episode | None:
        found = self.db.execute("SELECT tokens, is_policy, logprobs, trained FROM episodes WHERE id = ?",
                                (episode_id,)).fetchone() if self.episodes else None
        if found is None:
            return None
        tokens = array("q")
        tokens.frombytes(found[0])
        episode = _Episode(tokens.tolist(), found[1], found[2], bool(found[3]))
        episode.stored = True
        return episode

    def mark_trained(self, episode_id: str) -> None:
        self.db.execute("UPDATE episodes SET trained = 1 WHERE id = ?", (episode_id,))

    def untrained(self) -> tuple[int, list[str]]:
        count = self.db.execute("SELECT COUNT(*) FROM episodes WHERE trained = 0").fetchone()[0]
        return count, [r[0] for r in self.db.execute("SELECT id FROM episodes WHERE trained = 0 ORDER BY id LIMIT 3")]

    def defer(self, row: TrainingRow) -> None:
        self.db.execute("INSERT INTO deferred VALUES (?)", (msgspec.json.encode(row),))
        self.db.executemany("INSERT OR IGNORE INTO needed VALUES (?)", ((e,) for e in row.episode_ids))
        self.deferred += 1

    def leave(self, rows: list[bytes]) -> None:
        """Rows a part could not check, for the parent to check once every part's episodes are in."""
        self.db.executemany("INSERT INTO left VALUES (?)", ((row,) for row in rows))
        self.left += len(rows)

    def left_rows(self) -> Iterator[TrainingRow]:
        decoder = msgspec.json.Decoder(TrainingRow)
        for (raw,) in self.db.execute("SELECT row FROM left ORDER BY rowid").fetchall():
            yield decoder.decode(raw)

    def is_needed(self, episode_id: str) -> bool:
        return self.db.execute("SELECT 1 FROM needed WHERE id = ?", (episode_id,)).fetchone() is not None

    def deferred_rows(self) -> Iterator[TrainingRow]:
        decoder = msgspec.json.Decoder(TrainingRow)
        for (raw,) in self.db.execute("SELECT row FROM deferred ORDER BY rowid").fetchall():
            yield decoder.decode(raw)


class _Groups:
    """Every trajectory's group (duplicates too): how many trajectories it has, its first reward and whether
    another differs. A dict, moved into an SQLite file in a temporary folder once it holds SPILL_AT groups."""

    SPILL_AT = 200_000
    BATCH = 4096

    def __init__(self) -> None:
        self.groups: dict[str, list] = {}  # group id -> [trajectories, first reward, rewards differ]
        self._scratch: ScratchDatabase | None = None
        self._waiting: list[tuple[str, int, float, bool]] = []

    def add(self, group_id: str, reward: float) -> None:
        if self._scratch is not None:
            self._wait((group_id, 1, reward, False))
            return
        group = self.groups.get(group_id)
        if group is None:
            self.groups[group_id] = [1, reward, False]
            if len(self.groups) >= self.SPILL_AT:
                self._spill()
        else:
            group[0] += 1
            if reward != group[1]:
                group[2] = True

    def merge(self, groups: dict[str, list]) -> None:
        """Adds another part's groups."""
        for group_id, (size, first, differ) in groups.items():
            if self._scratch is not None:
                self._wait((group_id, size, first, differ))
                continue
            group = self.groups.get(group_id)
            if group is None:
                self.groups[group_id] = [size, first, differ]
                if len(self.groups) >= self.SPILL_AT:
                    self._spill()
            else:
                group[0] += size
                group[2] = group[2] or differ or first != group[1]

    def _spill(self) -> None:
        self._scratch = ScratchDatabase("groups", "CREATE TABLE groups (id TEXT PRIMARY KEY, size INTEGER, "
                                                  "first REAL, differ INTEGER) WITHOUT ROWID;")
        self._waiting = [(group_id, *group) for group_id, group in self.groups.items()]
        self.groups = {}
        self._flush()

    def _wait(self, group: tuple[str, int, float, bool]) -> None:
        self._waiting.append(group)
        if len(self._waiting) >= self.BATCH:
            self._flush()

    def _flush(self) -> None:
        self._scratch.db.executemany(
            "INSERT INTO groups VALUES (?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET size = size + excluded.size, "
            "differ = differ OR excluded.differ OR first IS NOT excluded.first", self._waiting)
        self._waiting = []

    def sizes(self) -> Iterator[tuple[str, int, bool]]:
        """(group id, trajectories, whether their rewards differ) per group."""
        if self._scratch is None:
            for group_id in sorted(self.groups):
                size, _, differ = self.groups[group_id]
                yield group_id, size, differ
            return
        self._flush()
        for group_id, size, differ in self._scratch.db.execute("SELECT id, size, differ FROM groups ORDER BY id"):
            yield group_id, size, bool(differ)


@dataclass
class TraceAudit:
    """Streaming audit: add() the trajectories and the training rows, then call gates()."""

    vocab_size: int
    group_size: int
    tolerance: float
    problems: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTED, 0))  # and problem:<check>
    step_rewards: dict[int, list[float]] = field(default_factory=dict)  # step -> [sum, count]
    max_logprob_gap: float = 0.0
    mismatch: MismatchPanel = field(default_factory=MismatchPanel)
    advantages_nonzero: int = 0
    rows: int = 0
    trained: int = 0  # distinct episodes a row trained
    processes: int = 0  # worker processes add_files audited on (0: this one alone)
    _window: dict[str, _Episode] = field(default_factory=dict, repr=False)
    _window_order: deque[str] = field(default_factory=deque, repr=False)
    _window_tokens: int = field(default=0, repr=False)
    _seen: SeenIds = field(default_factory=SeenIds, repr=False)
    _spilled: _Spilled | None = field(default=None, repr=False)
    _groups: _Groups = field(default_factory=_Groups, repr=False)
    _revisions: dict[tuple[int, str], list] = field(default_factory=dict, repr=False)  # -> [count, first ids]
    _window_limit: float | None = field(default=None, repr=False)  # tokens; None: WINDOW_TOKENS
    _left_rows: list[bytes] | None = field(default=None, repr=False)  # in a part: rows it cannot check

    def _problem(self, check: str, message: str) -> None:
        key = f"problem:{check}"
        self.counts[key] = self.counts.get(key, 0) + 1
        if len(self.problems[check]) < MAX_EXAMPLES:
            self.problems[check].append(message)

    def add(self, trajectories: Callable[[], Iterable[Trajectory]], rows: Iterable[TrainingRow]) -> None:
        """Audits the trajectories `trajectories()` yields and the training rows; `trajectories` is called a
        second time only when a row names an episode that was trained and dropped from memory before it."""
        unread = iter(trajectories())
        # the first trajectory is read before any row, so unreadable trajectories fail the audit first
        unread = chain(list(islice(unread, 1)), unread)
        for row in rows:
            episodes = self._episodes_of(row, unread)
            if episodes is not None:
                self._check_row(row, episodes)
        for trajectory in unread:
            self._admit(trajectory)
        if self._spilled is not None and self._spilled.deferred:
            self._second_read(trajectories)

    def add_files(self, trajectories: Path, training: Path, *, workers: int | None = None) -> None:
        """add() for the two files, on a fresh audit. Files of PARALLEL_FROM_BYTES or more are audited in
        parts on up to `workers` processes (default: the CPUs this process may use, at most MAX_WORKERS); the
        figures are the same whatever the number of processes."""
        try:
            size = trajectories.stat().st_size + training.stat().st_size
        except OSError:
            size = 0  # add() says which file is missing, or what is wrong before that
        with _gc_paused():  # nothing here makes cycles, and the collector's passes over the window cost ~15%
            if size < PARALLEL_FROM_BYTES:
                self._add_whole(trajectories, training)
            elif not self._add_parts(trajectories, training, workers):
                vars(self).update(vars(TraceAudit(self.vocab_size, self.group_size, self.tolerance)))
                self._add_whole(trajectories, training)  # raises the RecordError, naming its line

    def _add_whole(self, trajectories: Path, training: Path) -> None:
        self.add(lambda: _records(trajectories, Trajectory), _records(training, TrainingRow))

    def _add_parts(self, trajectories: Path, training: Path, workers: int | None) -> bool:
        """Audits the files in parts and merges them here; False, with a half-merged audit, when a part
        cannot read a record."""
        parts = max(2, -(-trajectories.stat().st_size // PART_BYTES))
        jobs = [(trajectories, trajectory_range, training, training_range, self.vocab_size, self.group_size,
                 self.tolerance) for trajectory_range, training_range in zip(line_ranges(trajectories, parts),
                                                                             line_ranges(training, parts), strict=True)]
        workers = min(workers or len(os.sched_getaffinity(0)), MAX_WORKERS, parts)
        import numpy  # noqa: F401  (the mismatch panel's, imported once here rather than in every worker)

        with contextlib.ExitStack() as stack:
            if workers > 1:
                # workers stay for the next part: a fresh process per part would skip freeing the part's
                # episodes (~7% of its CPU) but fault in all of its memory again, which costs more
                pool = stack.enter_context(multiprocessing.get_context("fork").Pool(workers))
                self.processes = workers
                results = map_in_order(pool, _audit_part, jobs, window=2 * workers)
            else:
                results = map(_audit_part, jobs)
            for result in results:
                if result is None:
                    return False
                self._merge(result)
        if self._spilled is not None:
            for row in self._spilled.left_rows():
                episodes = self._episodes_of(row, iter(()))
                if episodes is not None:
                    self._check_row(row, episodes)
            if self._spilled.deferred:
                self._second_read(lambda: _records(trajectories, Trajectory))
        return True

    def _merge(self, part: _Part) -> None:
        """Adds what a part found; its untrained episodes wait for the rows other parts could not check."""
        for key, count in part.counts.items():
            self.counts[key] = self.counts.get(key, 0) + count
        for check, examples in part.problems.items():
            kept = self.problems[check]
            kept += examples[:MAX_EXAMPLES - len(kept)]
        for step, (total, count) in part.step_rewards.items():
            mine = self.step_rewards.setdefault(step, [0.0, 0])
            mine[0] += total
            mine[1] += count
        for key, (count, first) in part.revisions.items():
            mine = self._revisions.setdefault(key, [0, []])
            mine[0] += count
            mine[1] += first[:MAX_EXAMPLES - len(mine[1])]
        self.max_logprob_gap = max(self.max_logprob_gap, part.max_logprob_gap)
        self.mismatch.merge(part.mismatch)
        self.advantages_nonzero += part.advantages_nonzero
        self.rows += part.rows
        self.trained += part.trained
        self._groups.merge(part.groups)
        repeats = [part.episode_ids[index] for index in self._seen.add_many(part.episode_ids)]
        repeated = set(repeats)
        untrained = {episode_id for episode_id, *_ in part.untrained} if repeats else set()
        for episode_id in repeats:
            self._problem("unique-episodes", f"episode {episode_id} appears twice")
            if episode_id not in untrained:  # the part trained its copy: as a whole audit trains the first
                first = self._window.get(episode_id) or (self._spilled.get(episode_id) if self._spilled else None)
                if first is not None and not first.trained:
                    first.trained = True
                    if first.stored:
                        self._spilled.mark_trained(episode_id)
        for episode_id, tokens, provenance, logprobs in part.untrained:
            if episode_id not in repeated:  # rows are checked against the first copy
                self._hold(episode_id, _Episode(tokens, provenance, logprobs))
        if part.left_rows:
            self._spill().leave(part.left_rows)

    def _episodes_of(self, row: TrainingRow, unread: Iterator[Trajectory]) -> list[_Episode | None] | None:
        """The episodes `row` names, reading trajectories until each is met (None for one never met); None
        when the row waits for the second read."""
        episodes = []
        for episode_id in row.episode_ids:
            episode = self._window.get(episode_id)
            if episode is None and episode_id in self._seen:
                episode = self._spilled.get(episode_id) if self._spilled is not None else None
                if episode is None:  # trained by an earlier row and dropped since
                    self._defer(row)
                    return None
            elif episode is None:
                episode = self._read_until(episode_id, unread)
                if episode is None and self._left_rows is not None:
                    self._defer(row)  # in another part, or nowhere: the parent knows
                    return None
            episodes.append(episode)
        return episodes

    def _defer(self, row: TrainingRow | _RawListsRow) -> None:
        """Puts off a row to the second read, or in a part to the parent."""
        if self._left_rows is not None:
            self._left_rows.append(msgspec.json.encode(_decoded(row)))  # the parent takes it as the contract's
        else:
            self._spill().defer(row)

    def _trained(self, row: TrainingRow, episodes: list[_Episode]) -> None:
        for episode_id, episode in zip(row.episode_ids, episodes, strict=True):
            if not episode.trained:
                episode.trained = True
                self.trained += 1
                if episode.stored:
                    self._spilled.mark_trained(episode_id)

    def _read_until(self, episode_id: str, unread: Iterator[Trajectory]) -> _Episode | None:
        for trajectory in unread:
            self._admit(trajectory)
            if trajectory.episode_id == episode_id:
                return self._window.get(episode_id)
        return None

    def _spill(self) -> _Spilled:
        if self._spilled is None:
            self._spilled = _Spilled()
        return self._spilled

    def _admit(self, t: Trajectory) -> None:
        """Checks and counts one trajectory; its episode joins the window (the oldest leaves it)."""
        episode = self._episode(t)
        self._groups.add(t.group_id, t.reward)
        revision = self._revisions.get((t.step, t.policy_revision))
        if revision is None:
            revision = self._revisions[(t.step, t.policy_revision)] = [0, []]
        revision[0] += 1
        if len(revision[1]) < MAX_EXAMPLES:
            revision[1].append(t.episode_id)
        if not self._seen.add(t.episode_id):
            self._problem("unique-episodes", f"episode {t.episode_id} appears twice")
            return  # rows are checked against the first copy
        self._hold(t.episode_id, episode)

    def _hold(self, episode_id: str, episode: _Episode) -> None:
        """The episode joins the window; the oldest leave it, to the SQLite file if no row trained them."""
        self._window[episode_id] = episode
        self._window_order.append(episode_id)
        self._window_tokens += len(episode.tokens)
        limit = WINDOW_TOKENS if self._window_limit is None else self._window_limit
        while self._window_tokens > limit and len(self._window) > 1:
            oldest = self._window_order.popleft()
            left = self._window.pop(oldest)
            self._window_tokens -= len(left.tokens)
            if not left.trained:
                self._spill().put(oldest, left)

    def _episode(self, t: Trajectory, *, first_read: bool = True) -> _Episode:
        """Checks one trajectory and counts it (both only on the first read)."""
        tokens: list[int] = []
        provenance, policy_logprobs = [], []
        tool_segments = policy_tokens = 0
        wrong = False  # some segment's logprobs are not one per policy token, or not a policy segment's
        for segment in t.segments:
            ids, logprobs = segment.token_ids, segment.logprobs
            tokens += ids
            if segment.source == "policy":
                if logprobs is not None and len(logprobs) == len(ids):
                    policy_logprobs.append(struct.pack(f"{len(ids)}d", *logprobs))
                else:
                    wrong = True
                policy_tokens += len(ids)
                provenance.append(POLICY * len(ids))
            else:
                wrong = wrong or logprobs is not None
                tool_segments += segment.source in _ENVIRONMENT_SOURCES
                provenance.append(OTHER * len(ids))
        if first_read:
            if wrong or (tokens and max(tokens) >= self.vocab_size):
                self._segment_problems(t)
            if not policy_tokens:
                self._problem("lengths-vocab", f"{t.episode_id}: no policy tokens")
            counts = self.counts
            counts["episodes"] += 1
            counts["policy_tokens"] += policy_tokens
            counts["episodes_with_tool_calls"] += tool_segments > 0
            step = self.step_rewards.get(t.step)
            if step is None:
                step = self.step_rewards[t.step] = [0.0, 0]
            step[0] += t.reward
            step[1] += 1
        return _Episode(tokens, b"".join(provenance), b"".join(policy_logprobs))

    def _segment_problems(self, t: Trajectory) -> None:
        """Names each segment's ids over the vocabulary and its logprobs that are not one per policy token."""
        vocab_size = self.vocab_size
        for index, segment in enumerate(t.segments):
            ids, logprobs, where = segment.token_ids, segment.logprobs, f"{t.episode_id} segment {index}"
            if ids and max(ids) >= vocab_size:
                bad = [i for i in ids if i >= vocab_size]
                self._problem("lengths-vocab", f"{where}: ids {bad[:3]} >= vocab {vocab_size}")
            if segment.source == "policy" and (logprobs is None or len(logprobs) != len(ids)):
                self._problem("lengths-vocab", f"{where}: {len(ids)} tokens but "
                                               f"{None if logprobs is None else len(logprobs)} logprobs")
            elif segment.source != "policy" and logprobs is not None:
                self._problem("lengths-vocab", f"{where}: {segment.source} segment carries logprobs")

    def _second_read(self, trajectories: Callable[[], Iterable[Trajectory]]) -> None:
        """Checks the rows put off, against the episodes they name that are neither in the window nor on disk
        (trained and dropped before): read again from the start."""
        spilled = self._spilled
        for t in trajectories():
            if (spilled.is_needed(t.episode_id) and t.episode_id not in self._window
                    and spilled.get(t.episode_id) is None):
                episode = self._episode(t, first_read=False)
                episode.trained = True
                spilled.put(t.episode_id, episode)
        for row in spilled.deferred_rows():
            self._check_row(row, [self._window.get(episode_id) or spilled.get(episode_id)
                                  for episode_id in row.episode_ids])

    def _check_row(self, row: TrainingRow | _RawListsRow, episodes: list[_Episode | None]) -> None:
        self.rows += 1
        if row.advantage > 0 or row.advantage < 0:
            self.advantages_nonzero += 1
        if len(episodes) == 1 and episodes[0] is not None:
            tokens, provenance, sampled_logprobs = episodes[0].tokens, episodes[0].provenance, episodes[0].logprobs
        elif None not in episodes:
            tokens = [token for episode in episodes for token in episode.tokens]
            provenance = b"".join(episode.provenance for episode in episodes)
            sampled_logprobs = b"".join(episode.logprobs for episode in episodes)
        if type(row) is _RawListsRow:
            if (None not in episodes and (row.old_logprobs is None or len(row.old_logprobs) == len(tokens))
                    and bytes(row.loss_mask) == _mask_json(provenance) and bytes(row.input_ids) == _encode(tokens)):
                self._trained(row, episodes)  # input_ids are the tokens, the mask their provenance
                self._check_logprobs(row, provenance, sampled_logprobs, provenance.count(POLICY), True)
                return
            row = _decoded(row)
        length = len(row.input_ids)
        if len(row.loss_mask) != length or (row.old_logprobs is not None and len(row.old_logprobs) != length):
            self._problem("lengths-vocab", f"row {row.row_id}: input_ids/loss_mask/old_logprobs lengths differ")
            return
        if None in episodes:
            missing = [e for e, found in zip(row.episode_ids, episodes, strict=True) if found is None]
            self._problem("every-episode-trained", f"row {row.row_id} names unknown episode(s) {missing[:3]}")
            return
        self._trained(row, episodes)
        if row.input_ids != tokens:
            self._problem("mask-provenance", f"row {row.row_id}: input_ids differ from the episode's segment "
                                             f"tokens (first difference at {_first_difference(row.input_ids, tokens)})")
            return
        mask_is_provenance = _mask_bytes(row.loss_mask) == provenance
        if mask_is_provenance:
            # input_ids are the segment tokens and the mask is their provenance, so the trained tokens are
            # the sampled policy tokens, in order: count them
            trained_count = provenance.count(POLICY)
        else:
            wrong = [i for i, (mask, policy) in enumerate(zip(row.loss_mask, provenance, strict=True))
                     if bool(mask) != bool(policy)]
            if wrong:
                self._problem("mask-provenance", f"row {row.row_id}: loss mask disagrees with provenance at "
                                                 f"positions {wrong[:5]}")
            trained = list(compress(row.input_ids, row.loss_mask))
            sampled = list(compress(tokens, provenance))
            trained_count = len(trained)
            if trained != sampled:
                self._problem("trained-equals-sampled", f"row {row.row_id}: {len(trained)} trained tokens vs "
                                                        f"{len(sampled)} sampled policy tokens")
        self._check_logprobs(row, provenance, sampled_logprobs, trained_count, mask_is_provenance)

    def _check_logprobs(self, row: TrainingRow | _RawListsRow, provenance: bytes, sampled_logprobs: bytes,
                        trained_count: int, mask_is_provenance: bool) -> None:
        """Counts the row's trained tokens; its trainer logprobs against the sampler's go to the mismatch panel."""
        self.counts["trained_tokens"] += trained_count
        if row.old_logprobs is not None:
            sampled_count = len(sampled_logprobs) // DOUBLE
            self.counts["logprob_pairs"] += min(trained_count, sampled_count)
            recomputed = (_policy_values(row.old_logprobs, provenance) if mask_is_provenance  # one per trained token
                          else compress(row.old_logprobs, row.loss_mask))
            if trained_count == sampled_count:  # the panel keeps max |trainer - sampler|: the gap, read in gates()
                self.mismatch.add_packed(row.step, struct.pack(f"{trained_count}d", *recomputed), sampled_logprobs,
                                         row.row_id)
            else:
                gaps = (abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf
                        for a, b in zip(recomputed, array("d", sampled_logprobs), strict=False))
                self.max_logprob_gap = max(self.max_logprob_gap, max(gaps, default=0.0))

    def _result(self, name: str, check: str, *, measured=None, threshold=None, detail_ok: str = "") -> GateResult:
        problems = self.counts.get(f"problem:{check}", 0)
        detail = "; ".join(self.problems[check]) + (f" (+{problems - MAX_EXAMPLES} more)"
                                                     if problems > MAX_EXAMPLES else "")
        return GateResult(name=name, passed=problems == 0, measured=measured if measured is not None else problems,
                          threshold=threshold if threshold is not None else 0, detail=detail or detail_ok)

    def _untrained(self) -> tuple[int, list[str]]:
        """(episodes no row trained, the first few of their ids in order)."""
        waiting = sorted(episode_id for episode_id, episode in self._window.items() if not episode.trained)
        count, spilled = self._spilled.untrained() if self._spilled is not None else (0, [])
        return len(waiting) + count, sorted(waiting[:MAX_EXAMPLES] + spilled)[:MAX_EXAMPLES]

    def gates(self) -> list[GateResult]:
        self.max_logprob_gap = max(self.max_logprob_gap, self.mismatch.max_abs_diff())
        groups = 0
        for group, size, _ in self._groups.sizes():
            groups += 1
            if size != self.group_size:
                self._problem("groups-complete", f"group {group} has {size} episodes, expected {self.group_size}")
        untrained, examples = self._untrained()
        if untrained:
            self._problem("every-episode-trained", f"{untrained} episode(s) never reach a training row, "
                                                   f"e.g. {examples}")
        if self.counts["episodes"] == 0:
            self._problem("lengths-vocab", "no trajectories")
        gap_ok = self.max_logprob_gap <= self.tolerance and self.counts["logprob_pairs"] > 0
        return [
            self._result("trace:unique-episodes", "unique-episodes"),
            self._result("trace:lengths-vocab", "lengths-vocab",
                         detail_ok=f"{self.counts['episodes']} episodes, ids < {self.vocab_size}"),
            self._result("trace:groups-complete", "groups-complete",
                         detail_ok=f"{groups} groups of {self.group_size}"),
            self._result("trace:mask-provenance", "mask-provenance", detail_ok="loss mask = policy provenance"),
            self._result("trace:trained-equals-sampled", "trained-equals-sampled",
                         detail_ok=f"{self.counts['trained_tokens']} trained = sampled policy tokens, in order"),
            self._result("trace:every-episode-trained", "every-episode-trained",
                         detail_ok=f"{self.trained} episodes in {self.rows} rows"),
            GateResult(name="trace:logprob-agreement", passed=gap_ok, measured=self.max_logprob_gap,
                       threshold=self.tolerance,
                       detail=f"max |trainer - sampling| logprob over {self.counts['logprob_pairs']} tokens"
                              + ("" if gap_ok else self._largest_gap())),
            self.mismatch.gate(),
        ]

    def _largest_gap(self) -> str:
        """Where the largest gap is, when the mismatch panel holds it (a row whose counts differ does not go there)."""
        largest = self.mismatch.largest
        if largest is None or largest.gap != self.max_logprob_gap:
            return ""
        return (f"; the largest in training row {largest.sequence}, at its trained token {largest.index} (from 0): "
                f"trainer {largest.trainer:.7g}, sampling {largest.sampler:.7g}")

    def reward_per_step(self) -> dict[int, float]:
        return {step: total / count for step, (total, count) in sorted(self.step_rewards.items())}

    def groups_with_variance(self) -> tuple[int, int]:
        """(groups, groups whose rewards are not all equal)."""
        differ = [differ for _, _, differ in self._groups.sizes()]
        return len(differ), sum(differ)

    def degeneracy_gates(self, min_groups_with_variance: float, expects_tools: bool = True) -> list[GateResult]:
        """Rewards, advantages and tool use (for a family that has tools) must carry signal, or an update
        proves nothing."""
        episodes = self.counts["episodes"] or 1
        counted, varied = self.groups_with_variance()
        groups = counted or 1
        tool_share = self.counts["episodes_with_tool_calls"] / episodes
        tools = [GateResult(name="signal:tool-calls", passed=self.counts["episodes_with_tool_calls"] > 0,
                            measured=round(tool_share, 4), threshold="> 0",
                            detail=f"{self.counts['episodes_with_tool_calls']}/{self.counts['episodes']} episodes "
                                   "called a tool")] if expects_tools else []
        return tools + [
            GateResult(name="signal:reward-variance", passed=varied / groups >= min_groups_with_variance and varied > 0,
                       measured=round(varied / groups, 4), threshold=min_groups_with_variance,
                       detail=f"{varied}/{counted} groups have reward variance"),
            GateResult(name="signal:advantages", passed=self.advantages_nonzero > 0,
                       measured=self.advantages_nonzero, threshold="> 0",
                       detail=f"{self.advantages_nonzero}/{self.rows} rows with non-zero advantage"),
        ]

    def revision_gate(self, initial_revision: str, checkpoint_revisions: dict[int, str]) -> GateResult:
        """Step s must be sampled by the weights of checkpoint s-1 (the initial policy for s = 1)."""
        wrong, examples = 0, []
        for (step, revision), (count, first) in self._revisions.items():
            expected = initial_revision if step <= 1 else checkpoint_revisions.get(step - 1)
            if expected is None or revision != expected:
                wrong += count
                examples += first
        return GateResult(name="trace:policy-revision", passed=not wrong, measured=wrong, threshold=0,
                          detail=(f"{wrong} episode(s) name a revision that is not the checkpoint before their "
                                  f"step, e.g. {examples[:MAX_EXAMPLES]}") if wrong else
                          "each step sampled by the previous checkpoint's weights")


@dataclass
class _Part:
    """What the audit of one part found, for the parent to merge (pickled from a worker process)."""

    counts: dict[str, int]
    problems: dict[str, list[str]]
    step_rewards: dict[int, list[float]]
    revisions: dict[tuple[int, str], list]
    max_logprob_gap: float
    mismatch: MismatchPanel
    advantages_nonzero: int
    rows: int
    trained: int
    groups: dict[str, list]  # as _Groups.groups
    episode_ids: list[str]  # in file order, each once (a repeat within the part is already a problem)
    untrained: list[tuple[str, list[int], bytes, bytes]]  # episodes no row of the part trained, as _Episode
    left_rows: list[bytes]  # rows naming an episode outside the part (or nowhere), encoded


class _IdsInOrder(dict):
    """A part's episode ids in the order met, each once: the parent checks them across parts."""

    def add(self, key: str) -> bool:
        if key in self:
            return False
        self[key] = None
        return True


def _audit_part(job: tuple) -> _Part | None:
    """Audits one part: the trajectories and rows of its two byte ranges (a worker's job). None when a record
    cannot be read: the parent then audits the files whole, which names the line."""
    trajectories, trajectory_range, training, training_range, vocab_size, group_size, tolerance = job
    # a part keeps all its episodes (PART_BYTES bounds them): a row naming one from another part reads its
    # range to the end, and finds the rest of its rows' episodes in memory
    audit = TraceAudit(vocab_size, group_size, tolerance, _seen=_IdsInOrder(), _window_limit=math.inf,
                       _left_rows=[])
    try:
        audit.add(lambda: _records(trajectories, Trajectory, trajectory_range),
                  _records(training, _RawListsRow, training_range))
    except RecordError:
        return None
    audit.mismatch.max_abs_diff()  # reduces the pairs still waiting
    return _Part(counts=audit.counts, problems=dict(audit.problems), step_rewards=audit.step_rewards,
                 revisions=audit._revisions, max_logprob_gap=audit.max_logprob_gap, mismatch=audit.mismatch,
                 advantages_nonzero=audit.advantages_nonzero, rows=audit.rows, trained=audit.trained,
                 groups=audit._groups.groups, episode_ids=list(audit._seen), left_rows=audit._left_rows,
                 untrained=[(episode_id, e.tokens, e.provenance, e.logprobs)
                            for episode_id, e in audit._window.items() if not e.trained])


def _records(path: Path, record_type: type, byte_range: tuple[int, int] | None = None) -> Iterator:
    """The file's records (those of the lines in `byte_range`); a bad one raises RecordError."""
    return map(itemgetter(1), iter_jsonl(path, record_type, byte_range=byte_range))


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_encode = msgspec.json.Encoder().encode


@functools.lru_cache(maxsize=4096)  # rows of one shape share a mask
def _mask_json(provenance: bytes) -> bytes:
    """The JSON of the loss mask equal to `provenance`."""
    return _encode(list(provenance))


def _decoded(row: TrainingRow | _RawListsRow) -> TrainingRow:
    """The contract's record of a row; RecordError when its JSON-text lists are not the contract's (in a part,
    whose failure sends the files to a whole audit that names the line)."""
    return decode_record(_encode(row), TrainingRow) if type(row) is _RawListsRow else row


def _first_difference(a: list[int], b: list[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def _policy_values(values: list[float], provenance: bytes) -> list[float]:
    """The values at the policy's positions: a slice when they are one run (a completion), which costs a
    fraction of compress() over every position."""
    start = provenance.find(POLICY)
    if start == -1:
        return []
    end = provenance.find(OTHER, start)
    if end == -1:
        return values[start:]
    if provenance.find(POLICY, end) == -1:
        return values[start:end]
    return list(compress(values, provenance))


def _mask_bytes(mask: list[int]) -> bytes:
    """The loss mask as one byte a position (0/1), as provenance is stored; b"" when it holds other values."""
    try:
        return bytes(mask)
    except (ValueError, TypeError):
        return b""
