"""Trace-fidelity audit over trajectories.jsonl and training.jsonl, computed on the host from files.

Nothing the adapter claims is taken on trust: tokens, masks, logprobs, groups and revisions are all
checked against each other. The two files are read together: a training row is checked as soon as the
episodes it names have been read, against the episodes read last (WINDOW_TOKENS tokens of them), kept in
memory. So the audit's memory does not grow with the number of episodes, and in the usual file order nothing
touches the disk:
- an episode that leaves the window before a row trained it waits in an SQLite file in a temporary folder;
- a row that names an episode trained earlier and already dropped is checked in a second read of the
  trajectories, with the episodes such rows name.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain, compress, islice

import msgspec

from runner_contracts import GateResult, TrainingRow, Trajectory

from .mismatch import MismatchPanel
from .scratch import ScratchDatabase, SeenIds

MAX_EXAMPLES = 3
POLICY, OTHER = b"\x01", b"\x00"
WINDOW_TOKENS = 1 << 18  # tokens of the episodes kept in memory for the rows that name them (~10 MB at most)


class _Episode:
    """What a training row is checked against: the episode's tokens, provenance (one byte a token, 1 for the
    policy's) and policy logprobs, and whether a row trained it."""

    __slots__ = ("tokens", "provenance", "logprobs", "trained", "stored")

    def __init__(self, tokens: list[int], provenance: bytes, logprobs: list[float], trained: bool = False):
        self.tokens, self.provenance, self.logprobs, self.trained = tokens, provenance, logprobs, trained
        self.stored = False  # in the SQLite file, whose trained flag follows this one


class _Spilled:
    """Episodes that left the window untrained, and rows put off to the second read, in an SQLite file in a
    temporary folder that is deleted with this object."""

    def __init__(self) -> None:
        self._scratch = ScratchDatabase("audit", """
            CREATE TABLE episodes (id TEXT PRIMARY KEY, tokens BLOB, is_policy BLOB, logprobs BLOB, trained INTEGER);
            CREATE TABLE deferred (row BLOB);
            CREATE TABLE needed (id TEXT PRIMARY KEY) WITHOUT ROWID;""")
        self.db = self._scratch.db
        self.episodes = self.deferred = 0

    def put(self, episode_id: str, episode: _Episode) -> None:
        self.db.execute("INSERT OR IGNORE INTO episodes VALUES (?, ?, ?, ?, ?)",
                        (episode_id, array("q", episode.tokens).tobytes(), episode.provenance,
                         array("d", episode.logprobs).tobytes(), int(episode.trained)))
        episode.stored = True
        self.episodes += 1

    def get(self, episode_id: str) -> _Episode | None:
        found = self.db.execute("SELECT tokens, is_policy, logprobs, trained FROM episodes WHERE id = ?",
                                (episode_id,)).fetchone() if self.episodes else None
        if found is None:
            return None
        tokens, logprobs = array("q"), array("d")
        tokens.frombytes(found[0])
        logprobs.frombytes(found[2])
        episode = _Episode(tokens.tolist(), found[1], logprobs.tolist(), bool(found[3]))
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

    def is_needed(self, episode_id: str) -> bool:
        return self.db.execute("SELECT 1 FROM needed WHERE id = ?", (episode_id,)).fetchone() is not None

    def deferred_rows(self) -> Iterator[TrainingRow]:
        decoder = msgspec.json.Decoder(TrainingRow)
        for (raw,) in self.db.execute("SELECT row FROM deferred ORDER BY rowid").fetchall():
            yield decoder.decode(raw)


class _Groups:
    """Every trajectory's group and reward (duplicates too), appended to an SQLite table BATCH at a time."""

    BATCH = 4096

    def __init__(self) -> None:
        self._scratch = ScratchDatabase("groups", "CREATE TABLE members (group_id TEXT, reward REAL);")
        self._waiting: list[tuple[str, float]] = []

    def add(self, group_id: str, reward: float) -> None:
        self._waiting.append((group_id, reward))
        if len(self._waiting) >= self.BATCH:
            self._flush()

    def _flush(self) -> None:
        self._scratch.db.executemany("INSERT INTO members VALUES (?, ?)", self._waiting)
        self._waiting = []

    def sizes(self) -> list[tuple[str, int, int]]:
        """(group id, trajectories, distinct rewards) per group."""
        self._flush()
        return self._scratch.db.execute("SELECT group_id, COUNT(*), COUNT(DISTINCT reward) FROM members "
                                        "GROUP BY group_id").fetchall()


@dataclass
class TraceAudit:
    """Streaming audit: add() the trajectories and the training rows, then call gates()."""

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
    trained: int = 0  # distinct episodes a row trained
    _window: dict[str, _Episode] = field(default_factory=dict, repr=False)
    _window_order: deque[str] = field(default_factory=deque, repr=False)
    _window_tokens: int = field(default=0, repr=False)
    _seen: SeenIds = field(default_factory=SeenIds, repr=False)
    _spilled: _Spilled | None = field(default=None, repr=False)
    _groups: _Groups = field(default_factory=_Groups, repr=False)
    _revisions: dict[tuple[int, str], list] = field(default_factory=dict, repr=False)  # -> [count, first ids]

    def _problem(self, check: str, message: str) -> None:
        self.counts[f"problem:{check}"] += 1
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

    def _episodes_of(self, row: TrainingRow, unread: Iterator[Trajectory]) -> list[_Episode | None] | None:
        """The episodes `row` names, reading trajectories until each is met (None for one never met); None
        when the row waits for the second read."""
        episodes = []
        for episode_id in row.episode_ids:
            episode = self._window.get(episode_id)
            if episode is None and episode_id in self._seen:
                episode = self._spilled.get(episode_id) if self._spilled is not None else None
                if episode is None:  # trained by an earlier row and dropped since
                    self._spill().defer(row)
                    return None
            elif episode is None:
                episode = self._read_until(episode_id, unread)
            episodes.append(episode)
        return episodes

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
        if not self._seen.add(t.episode_id):
            self._problem("unique-episodes", f"episode {t.episode_id} appears twice")
            return
        revision = self._revisions.get((t.step, t.policy_revision))
        if revision is None:
            revision = self._revisions[(t.step, t.policy_revision)] = [0, []]
        revision[0] += 1
        if len(revision[1]) < MAX_EXAMPLES:
            revision[1].append(t.episode_id)
        self._window[t.episode_id] = episode
        self._window_order.append(t.episode_id)
        self._window_tokens += len(episode.tokens)
        while self._window_tokens > WINDOW_TOKENS and len(self._window) > 1:
            oldest = self._window_order.popleft()
            left = self._window.pop(oldest)
            self._window_tokens -= len(left.tokens)
            if not left.trained:
                self._spill().put(oldest, left)

    def _episode(self, t: Trajectory, *, first_read: bool = True) -> _Episode:
        """Checks one trajectory and counts it (both only on the first read)."""
        problem = self._problem if first_read else _ignore
        tokens: list[int] = []
        policy_logprobs: list[float] = []
        is_policy = bytearray()
        tool_segments = policy_tokens = 0
        for index, segment in enumerate(t.segments):
            ids = segment.token_ids
            if ids and max(ids) >= self.vocab_size:
                bad = [i for i in ids if i >= self.vocab_size]
                problem("lengths-vocab", f"{t.episode_id} segment {index}: ids {bad[:3]} >= vocab {self.vocab_size}")
            policy = segment.source == "policy"
            if policy:
                if segment.logprobs is None or len(segment.logprobs) != len(ids):
                    got = None if segment.logprobs is None else len(segment.logprobs)
                    problem("lengths-vocab", f"{t.episode_id} segment {index}: {len(ids)} tokens but {got} logprobs")
                else:
                    policy_logprobs += segment.logprobs
                policy_tokens += len(ids)
            elif segment.logprobs is not None:
                problem("lengths-vocab", f"{t.episode_id} segment {index}: {segment.source} segment "
                                         "carries logprobs")
            tool_segments += segment.source in ("tool", "env")
            tokens += ids
            is_policy += (POLICY if policy else OTHER) * len(ids)
        if not policy_tokens:
            problem("lengths-vocab", f"{t.episode_id}: no policy tokens")
        if first_read:
            self.counts["episodes"] += 1
            self.counts["policy_tokens"] += policy_tokens
            self.counts["episodes_with_tool_calls"] += tool_segments > 0
            step = self.step_rewards.setdefault(t.step, [0.0, 0])
            step[0] += t.reward
            step[1] += 1
        return _Episode(tokens, bytes(is_policy), policy_logprobs)

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

    def _check_row(self, row: TrainingRow, episodes: list[_Episode | None]) -> None:
        self.rows += 1
        if abs(row.advantage) > 0:
            self.advantages_nonzero += 1
        lengths = {len(row.input_ids), len(row.loss_mask)}
        if row.old_logprobs is not None:
            lengths.add(len(row.old_logprobs))
        if len(lengths) != 1:
            self._problem("lengths-vocab", f"row {row.row_id}: input_ids/loss_mask/old_logprobs lengths differ")
            return
        missing = [e for e, found in zip(row.episode_ids, episodes, strict=True) if found is None]
        if missing:
            self._problem("every-episode-trained", f"row {row.row_id} names unknown episode(s) {missing[:3]}")
            return
        self._trained(row, episodes)
        if len(episodes) == 1:
            tokens, provenance, sampled_logprobs = episodes[0].tokens, episodes[0].provenance, episodes[0].logprobs
        else:
            tokens = [token for episode in episodes for token in episode.tokens]
            provenance = b"".join(episode.provenance for episode in episodes)
            sampled_logprobs = [logprob for episode in episodes for logprob in episode.logprobs]
        if row.input_ids != tokens:
            self._problem("mask-provenance", f"row {row.row_id}: input_ids differ from the episode's segment "
                                             f"tokens (first difference at {_first_difference(row.input_ids, tokens)})")
            return
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
            trained = list(compress(row.input_ids, row.loss_mask))
            sampled = list(compress(tokens, provenance))
            self.counts["trained_tokens"] += len(trained)
            if trained != sampled:
                self._problem("trained-equals-sampled", f"row {row.row_id}: {len(trained)} trained tokens vs "
                                                        f"{len(sampled)} sampled policy tokens")
        if row.old_logprobs is not None:
            recomputed = list(compress(row.old_logprobs, row.loss_mask))
            self.counts["logprob_pairs"] += min(len(recomputed), len(sampled_logprobs))
            if len(recomputed) == len(sampled_logprobs):
                try:  # the panel keeps max |trainer - sampler|: the gap, read in gates()
                    self.mismatch.add(row.step, recomputed, sampled_logprobs)
                    return
                except ValueError:  # a logprob is not finite
                    pass
            gaps = (abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf
                    for a, b in zip(recomputed, sampled_logprobs, strict=False))
            self.max_logprob_gap = max(self.max_logprob_gap, max(gaps, default=0.0))

    def _result(self, name: str, check: str, *, measured=None, threshold=None, detail_ok: str = "") -> GateResult:
        problems = self.counts[f"problem:{check}"]
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
                       detail=f"max |trainer - sampling| logprob over {self.counts['logprob_pairs']} tokens"),
            self.mismatch.gate(),
        ]

    def reward_per_step(self) -> dict[int, float]:
        return {step: total / count for step, (total, count) in sorted(self.step_rewards.items())}

    def groups_with_variance(self) -> tuple[int, int]:
        """(groups, groups whose rewards are not all equal)."""
        distinct = [rewards for _, _, rewards in self._groups.sizes()]
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


def _ignore(check: str, message: str) -> None:
    """Where a trajectory read a second time reports its problems: it did on the first read."""


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
