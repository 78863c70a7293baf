"""Trace-fidelity audit over trajectories.jsonl and training.jsonl, computed on the host from files.

Nothing the adapter claims is taken on trust: tokens, masks, logprobs, groups and revisions are all
checked against each other. Episodes wait for their training rows in an SQLite file in a temporary
folder, so the audit's memory does not grow with the number of episodes; they are stored and looked up
BATCH records at a time (one statement per batch, not one per record).
"""

from __future__ import annotations

import math
import sqlite3
import tempfile
from array import array
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import compress, islice
from pathlib import Path

from runner_contracts import GateResult, TrainingRow, Trajectory

from .mismatch import MismatchPanel

MAX_EXAMPLES = 3
POLICY, OTHER = b"\x01", b"\x00"
BATCH = 512  # trajectories stored, or training rows checked, together
_IN_LIMIT = 500  # ids in one "IN (...)": well under SQLite's limit on parameters


class ScratchDatabase:
    """An SQLite file in a temporary folder that is deleted with this object: no journal, no fsync, one
    transaction left open (nothing is kept after the process); `db` is the connection, `schema` run on it."""

    def __init__(self, name: str, schema: str):
        self._folder = tempfile.TemporaryDirectory(prefix=f"runner-{name}-")
        self.db = sqlite3.connect(Path(self._folder.name) / f"{name}.sqlite", isolation_level=None)
        self.db.executescript(f"PRAGMA journal_mode = OFF; PRAGMA synchronous = OFF; {schema} BEGIN;")


class _EpisodeStore:
    """Each episode's tokens, provenance (one byte a token, 1 for the policy's) and policy logprobs (typed arrays
    as blobs) by episode id, and every trajectory's group and reward, in an SQLite file that is deleted with
    the store."""

    def __init__(self) -> None:
        self._scratch = ScratchDatabase("audit", """
            CREATE TABLE episodes (id TEXT PRIMARY KEY, step INTEGER, revision TEXT, group_id TEXT, reward REAL,
                                   tokens BLOB, is_policy BLOB, policy_logprobs BLOB, trained INTEGER);
            CREATE TABLE duplicates (group_id TEXT, reward REAL);""")
        self.db = self._scratch.db

    def add(self, episodes: list[tuple]) -> list[bool]:
        """Stores episodes given as (id, step, revision, group id, reward, tokens, is_policy, policy logprobs),
        the last three as bytes; for each, False when its id was stored already (the first is kept, the group
        counts both)."""
        known = {row[0] for cursor in self._in_parts("SELECT id FROM episodes WHERE id IN ({})",
                                                     [episode[0] for episode in episodes]) for row in cursor}
        stored, fresh = [], []
        for episode in episodes:
            new = episode[0] not in known
            known.add(episode[0])
            stored.append(new)
            if new:
                fresh.append(episode)
            else:
                self.db.execute("INSERT INTO duplicates VALUES (?, ?)", (episode[3], episode[4]))
        self.db.executemany("INSERT INTO episodes VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0)", fresh)
        return stored

    def get(self, episode_ids: set[str]) -> dict[str, tuple[bytes, bytes, bytes]]:
        """Each stored episode's (tokens, is_policy, policy logprobs) by id."""
        return {row[0]: row[1:] for cursor in self._in_parts(
            "SELECT id, tokens, is_policy, policy_logprobs FROM episodes WHERE id IN ({})",
            list(episode_ids)) for row in cursor}

    def mark_trained(self, episode_ids: set[str]) -> None:
        for cursor in self._in_parts("UPDATE episodes SET trained = 1 WHERE id IN ({})", list(episode_ids)):
            cursor.close()

    def _in_parts(self, statement: str, ids: list[str]) -> Iterator[sqlite3.Cursor]:
        """`statement` run on each part of `ids` small enough for one "IN ({})" list."""
        for start in range(0, len(ids), _IN_LIMIT):
            part = ids[start:start + _IN_LIMIT]
            yield self.db.execute(statement.format(", ".join("?" * len(part))), part)

    def groups(self) -> Iterable[tuple[str, int, int]]:
        """(group id, trajectories, distinct rewards) per group."""
        return self.db.execute("SELECT group_id, COUNT(*), COUNT(DISTINCT reward) FROM (SELECT group_id, reward FROM "
                               "episodes UNION ALL SELECT group_id, reward FROM duplicates) GROUP BY group_id")

    def untrained(self) -> tuple[int, list[str]]:
        count = self.db.execute("SELECT COUNT(*) FROM episodes WHERE trained = 0").fetchone()[0]
        examples = [r[0] for r in self.db.execute("SELECT id FROM episodes WHERE trained = 0 ORDER BY id LIMIT 3")]
        return count, examples

    def trained(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM episodes WHERE trained = 1").fetchone()[0]

    def revisions(self) -> Iterable[tuple[str, int, str]]:
        return self.db.execute("SELECT id, step, revision FROM episodes ORDER BY rowid")


@dataclass
class TraceAudit:
    """Streaming audit: feed trajectories, then training rows, then call gates()."""

    vocab_size: int
    group_size: int
    tolerance: float
    problems: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    counts: Counter = field(default_factory=Counter)
    step_rewards: dict[int, list[float]] = field(default_factory=dict)  # step -> [sum, count]
    max_logprob_gap: float = 0.0
    mismatch: MismatchPanel = field(default_factory=MismatchPanel)
    advantages_nonzero: int = 0
    rows: int = 0
    _store: _EpisodeStore = field(default_factory=_EpisodeStore, repr=False)

    def _problem(self, check: str, message: str) -> None:
        self.counts[f"problem:{check}"] += 1
        if len(self.problems[check]) < MAX_EXAMPLES:
            self.problems[check].append(message)

    def add_trajectories(self, trajectories: Iterable[Trajectory]) -> None:
        for batch in _batches(map(self._episode, trajectories)):
            for episode, stored in zip(batch, self._store.add(batch), strict=True):
                if not stored:
                    self._problem("unique-episodes", f"episode {episode[0]} appears twice")

    def _episode(self, t: Trajectory) -> tuple:
        """Checks one trajectory and counts it; the row the store keeps of it."""
        self.counts["episodes"] += 1
        tokens, policy_logprobs, is_policy = array("q"), array("d"), bytearray()
        tool_segments = policy_tokens = 0
        for index, segment in enumerate(t.segments):
            ids = segment.token_ids
            if ids and max(ids) >= self.vocab_size:
                bad = [i for i in ids if i >= self.vocab_size]
                self._problem("lengths-vocab", f"{t.episode_id} segment {index}: ids {bad[:3]} >= vocab "
                                               f"{self.vocab_size}")
            policy = segment.source == "policy"
            if policy:
                if segment.logprobs is None or len(segment.logprobs) != len(ids):
                    got = None if segment.logprobs is None else len(segment.logprobs)
                    self._problem("lengths-vocab", f"{t.episode_id} segment {index}: {len(ids)} "
                                                   f"tokens but {got} logprobs")
                else:
                    policy_logprobs.extend(segment.logprobs)
                policy_tokens += len(ids)
            elif segment.logprobs is not None:
                self._problem("lengths-vocab", f"{t.episode_id} segment {index}: {segment.source} segment "
                                               "carries logprobs")
            tool_segments += segment.source in ("tool", "env")
            tokens.extend(ids)
            is_policy += (POLICY if policy else OTHER) * len(ids)
        if not policy_tokens:
            self._problem("lengths-vocab", f"{t.episode_id}: no policy tokens")
        self.counts["policy_tokens"] += policy_tokens
        self.counts["episodes_with_tool_calls"] += tool_segments > 0
        step = self.step_rewards.setdefault(t.step, [0.0, 0])
        step[0] += t.reward
        step[1] += 1
        return (t.episode_id, t.step, t.policy_revision, t.group_id, t.reward, tokens.tobytes(),
                bytes(is_policy), policy_logprobs.tobytes())

    def add_rows(self, rows: Iterable[TrainingRow]) -> None:
        for batch in _batches(rows):
            self._check_rows(batch)

    def _check_rows(self, batch: list[TrainingRow]) -> None:
        known = self._store.get({episode for row in batch for episode in row.episode_ids})
        trained_ids: set[str] = set()
        for row in batch:
            self.rows += 1
            if abs(row.advantage) > 0:
                self.advantages_nonzero += 1
            lengths = {len(row.input_ids), len(row.loss_mask)}
            if row.old_logprobs is not None:
                lengths.add(len(row.old_logprobs))
            if len(lengths) != 1:
                self._problem("lengths-vocab", f"row {row.row_id}: input_ids/loss_mask/old_logprobs lengths differ")
                continue
            episodes = [known.get(e) for e in row.episode_ids]
            missing = [e for e, found in zip(row.episode_ids, episodes, strict=True) if found is None]
            if missing:
                self._problem("every-episode-trained", f"row {row.row_id} names unknown episode(s) {missing[:3]}")
                continue
            trained_ids.update(row.episode_ids)
            tokens = b"".join(episode[0] for episode in episodes)
            provenance = b"".join(episode[1] for episode in episodes)
            input_ids = array("q", row.input_ids)
            if input_ids.tobytes() != tokens:
                stored = array("q")
                stored.frombytes(tokens)
                self._problem("mask-provenance", f"row {row.row_id}: input_ids differ from the episode's segment "
                                                 f"tokens (first difference at "
                                                 f"{_first_difference(row.input_ids, stored.tolist())})")
                continue
            if _mask_bytes(row.loss_mask) == provenance:
                # input_ids are the segment tokens and the mask is their provenance, so the trained tokens are
                # the sampled policy tokens, in order: count them
                self.counts["trained_tokens"] += provenance.count(POLICY)
            else:
                wrong = [i for i, (mask, policy) in enumerate(zip(row.loss_mask, provenance, strict=True))
                         if bool(mask) != bool(policy)]
                if wrong:
                    self._problem("mask-provenance", f"row {row.row_id}: loss mask disagrees with provenance at "
                                                     f"positions {wrong[:5]}")
                trained = array("q", compress(row.input_ids, row.loss_mask))
                sampled = array("q", compress(input_ids, provenance))
                self.counts["trained_tokens"] += len(trained)
                if trained != sampled:
                    self._problem("trained-equals-sampled", f"row {row.row_id}: {len(trained)} trained tokens vs "
                                                            f"{len(sampled)} sampled policy tokens")
            if row.old_logprobs is not None:
                sampled_lp = array("d")
                sampled_lp.frombytes(b"".join(episode[2] for episode in episodes))
                recomputed = array("d", compress(row.old_logprobs, row.loss_mask))
                self.counts["logprob_pairs"] += min(len(recomputed), len(sampled_lp))
                if len(recomputed) == len(sampled_lp):
                    try:  # the panel keeps max |trainer - sampler|: the gap, read in gates()
                        self.mismatch.add(row.step, recomputed, sampled_lp)
                        continue
                    except ValueError:  # a logprob is not finite
                        pass
                gaps = (abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf
                        for a, b in zip(recomputed, sampled_lp, strict=False))
                self.max_logprob_gap = max(self.max_logprob_gap, max(gaps, default=0.0))
        self._store.mark_trained(trained_ids)

    def _result(self, name: str, check: str, *, measured=None, threshold=None, detail_ok: str = "") -> GateResult:
        problems = self.counts[f"problem:{check}"]
        detail = "; ".join(self.problems[check]) + (f" (+{problems - MAX_EXAMPLES} more)"
                                                     if problems > MAX_EXAMPLES else "")
        return GateResult(name=name, passed=problems == 0, measured=measured if measured is not None else problems,
                          threshold=threshold if threshold is not None else 0, detail=detail or detail_ok)

    def gates(self) -> list[GateResult]:
        self.max_logprob_gap = max(self.max_logprob_gap, self.mismatch.max_abs_diff())
        groups = 0
        for group, size, _ in self._store.groups():
            groups += 1
            if size != self.group_size:
                self._problem("groups-complete", f"group {group} has {size} episodes, expected {self.group_size}")
        untrained, examples = self._store.untrained()
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
                         detail_ok=f"{self._store.trained()} episodes in {self.rows} rows"),
            GateResult(name="trace:logprob-agreement", passed=gap_ok, measured=self.max_logprob_gap,
                       threshold=self.tolerance,
                       detail=f"max |trainer - sampling| logprob over {self.counts['logprob_pairs']} tokens"),
            self.mismatch.gate(),
        ]

    def reward_per_step(self) -> dict[int, float]:
        return {step: total / count for step, (total, count) in sorted(self.step_rewards.items())}

    def groups_with_variance(self) -> tuple[int, int]:
        """(groups, groups whose rewards are not all equal)."""
        distinct = [rewards for _, _, rewards in self._store.groups()]
        return len(distinct), sum(1 for rewards in distinct if rewards > 1)

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
        wrong = []
        for episode_id, step, revision in self._store.revisions():
            expected = initial_revision if step <= 1 else checkpoint_revisions.get(step - 1)
            if expected is None or revision != expected:
                wrong.append(episode_id)
        return GateResult(name="trace:policy-revision", passed=not wrong, measured=len(wrong), threshold=0,
                          detail=(f"{len(wrong)} episode(s) name a revision that is not the checkpoint before their "
                                  f"step, e.g. {wrong[:3]}") if wrong else
                          "each step sampled by the previous checkpoint's weights")


def _batches(records: Iterable) -> Iterator[list]:
    """`records` in lists of BATCH (the last one shorter)."""
    iterator = iter(records)
    while batch := list(islice(iterator, BATCH)):
        yield batch


def _first_difference(a: list[int], b: list[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def _mask_bytes(mask: list[int]) -> bytes:
    """The loss mask as one byte a position (0/1), as provenance is stored; b"" when it holds other values."""
    try:
        return bytes(mask)
    except (ValueError, TypeError):
        return b""
