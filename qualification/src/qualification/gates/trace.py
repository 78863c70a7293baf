"""Trace-fidelity audit over trajectories.jsonl and training.jsonl, computed on the host from files.

Nothing the adapter claims is taken on trust: tokens, masks, logprobs, groups and revisions are all
checked against each other.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from runner_contracts import GateResult, TrainingRow, Trajectory

from .mismatch import MismatchPanel

MAX_EXAMPLES = 3


@dataclass
class _Episode:
    """Compact per-episode index (typed arrays: ~5 bytes a token instead of ~40 for Python lists)."""

    step: int
    tokens: array
    policy_tokens: array
    policy_logprobs: array
    is_policy: bytes
    revision: str


@dataclass
class TraceAudit:
    """Streaming audit: feed trajectories, then training rows, then call gates()."""

    vocab_size: int
    group_size: int
    tolerance: float
    episodes: dict[str, _Episode] = field(default_factory=dict)
    problems: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    counts: Counter = field(default_factory=Counter)
    group_sizes: Counter = field(default_factory=Counter)
    group_rewards: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    step_rewards: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    trained_episodes: set[str] = field(default_factory=set)
    max_logprob_gap: float = 0.0
    mismatch: MismatchPanel = field(default_factory=MismatchPanel)
    advantages_nonzero: int = 0
    rows: int = 0

    def _problem(self, check: str, message: str) -> None:
        self.counts[f"problem:{check}"] += 1
        if len(self.problems[check]) < MAX_EXAMPLES:
            self.problems[check].append(message)

    def add_trajectories(self, trajectories: Iterable[Trajectory]) -> None:
        for t in trajectories:
            self.counts["episodes"] += 1
            if t.episode_id in self.episodes:
                self._problem("unique-episodes", f"episode {t.episode_id} appears twice")
            tokens, policy_tokens, policy_logprobs, is_policy = [], [], [], []
            tool_segments = 0
            for index, segment in enumerate(t.segments):
                bad = [i for i in segment.token_ids if i >= self.vocab_size]
                if bad:
                    self._problem("lengths-vocab", f"{t.episode_id} segment {index}: ids {bad[:3]} >= vocab "
                                                   f"{self.vocab_size}")
                policy = segment.source == "policy"
                if policy:
                    if segment.logprobs is None or len(segment.logprobs) != len(segment.token_ids):
                        got = None if segment.logprobs is None else len(segment.logprobs)
                        self._problem("lengths-vocab", f"{t.episode_id} segment {index}: {len(segment.token_ids)} "
                                                       f"tokens but {got} logprobs")
                    else:
                        policy_logprobs += segment.logprobs
                    policy_tokens += segment.token_ids
                elif segment.logprobs is not None:
                    self._problem("lengths-vocab", f"{t.episode_id} segment {index}: {segment.source} segment "
                                                   "carries logprobs")
                tool_segments += segment.source in ("tool", "env")
                tokens += segment.token_ids
                is_policy += [policy] * len(segment.token_ids)
            if not policy_tokens:
                self._problem("lengths-vocab", f"{t.episode_id}: no policy tokens")
            self.counts["policy_tokens"] += len(policy_tokens)
            self.counts["episodes_with_tool_calls"] += tool_segments > 0
            self.group_sizes[t.group_id] += 1
            self.group_rewards[t.group_id].append(t.reward)
            self.step_rewards[t.step].append(t.reward)
            self.episodes[t.episode_id] = _Episode(t.step, array("q", tokens), array("q", policy_tokens),
                                                   array("d", policy_logprobs), bytes(is_policy), t.policy_revision)

    def add_rows(self, rows: Iterable[TrainingRow]) -> None:
        for row in rows:
            self.rows += 1
            if abs(row.advantage) > 0:
                self.advantages_nonzero += 1
            lengths = {len(row.input_ids), len(row.loss_mask)}
            if row.old_logprobs is not None:
                lengths.add(len(row.old_logprobs))
            if len(lengths) != 1:
                self._problem("lengths-vocab", f"row {row.row_id}: input_ids/loss_mask/old_logprobs lengths differ")
                continue
            missing = [e for e in row.episode_ids if e not in self.episodes]
            if missing:
                self._problem("every-episode-trained", f"row {row.row_id} names unknown episode(s) {missing[:3]}")
                continue
            episodes = [self.episodes[e] for e in row.episode_ids]
            self.trained_episodes.update(row.episode_ids)
            tokens = array("q", row.input_ids[:0])
            for episode in episodes:
                tokens += episode.tokens
            provenance = b"".join(episode.is_policy for episode in episodes)
            if array("q", row.input_ids) != tokens:
                self._problem("mask-provenance", f"row {row.row_id}: input_ids differ from the episode's segment "
                                                 f"tokens (first difference at "
                                                 f"{_first_difference(row.input_ids, tokens.tolist())})")
                continue
            wrong = [i for i, (mask, policy) in enumerate(zip(row.loss_mask, provenance, strict=True))
                     if bool(mask) != policy]
            if wrong:
                self._problem("mask-provenance", f"row {row.row_id}: loss mask disagrees with provenance at "
                                                 f"positions {wrong[:5]}")
            trained = array("q", [token for token, mask in zip(row.input_ids, row.loss_mask, strict=True) if mask])
            sampled = array("q")
            for episode in episodes:
                sampled += episode.policy_tokens
            self.counts["trained_tokens"] += len(trained)
            if trained != sampled:
                self._problem("trained-equals-sampled", f"row {row.row_id}: {len(trained)} trained tokens vs "
                                                        f"{len(sampled)} sampled policy tokens")
            if row.old_logprobs is not None:
                sampled_lp = [lp for episode in episodes for lp in episode.policy_logprobs]
                recomputed = [lp for lp, mask in zip(row.old_logprobs, row.loss_mask, strict=True) if mask]
                for a, b in zip(recomputed, sampled_lp, strict=False):
                    gap = abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf
                    self.max_logprob_gap = max(self.max_logprob_gap, gap)
                self.counts["logprob_pairs"] += min(len(recomputed), len(sampled_lp))
                if len(recomputed) == len(sampled_lp) and all(map(math.isfinite, recomputed + sampled_lp)):
                    self.mismatch.add(row.step, recomputed, sampled_lp)

    def _result(self, name: str, check: str, *, measured=None, threshold=None, detail_ok: str = "") -> GateResult:
        problems = self.counts[f"problem:{check}"]
        detail = "; ".join(self.problems[check]) + (f" (+{problems - MAX_EXAMPLES} more)"
                                                     if problems > MAX_EXAMPLES else "")
        return GateResult(name=name, passed=problems == 0, measured=measured if measured is not None else problems,
                          threshold=threshold if threshold is not None else 0, detail=detail or detail_ok)

    def gates(self) -> list[GateResult]:
        incomplete = {g: n for g, n in self.group_sizes.items() if n != self.group_size}
        for group, size in list(incomplete.items())[:MAX_EXAMPLES]:
            self._problem("groups-complete", f"group {group} has {size} episodes, expected {self.group_size}")
        untrained = set(self.episodes) - self.trained_episodes
        if untrained:
            self._problem("every-episode-trained", f"{len(untrained)} episode(s) never reach a training row, "
                                                   f"e.g. {sorted(untrained)[:3]}")
        if self.counts["episodes"] == 0:
            self._problem("lengths-vocab", "no trajectories")
        gap_ok = self.max_logprob_gap <= self.tolerance and self.counts["logprob_pairs"] > 0
        return [
            self._result("trace:unique-episodes", "unique-episodes"),
            self._result("trace:lengths-vocab", "lengths-vocab",
                         detail_ok=f"{self.counts['episodes']} episodes, ids < {self.vocab_size}"),
            self._result("trace:groups-complete", "groups-complete",
                         detail_ok=f"{len(self.group_sizes)} groups of {self.group_size}"),
            self._result("trace:mask-provenance", "mask-provenance", detail_ok="loss mask = policy provenance"),
            self._result("trace:trained-equals-sampled", "trained-equals-sampled",
                         detail_ok=f"{self.counts['trained_tokens']} trained = sampled policy tokens, in order"),
            self._result("trace:every-episode-trained", "every-episode-trained",
                         detail_ok=f"{len(self.trained_episodes)} episodes in {self.rows} rows"),
            GateResult(name="trace:logprob-agreement", passed=gap_ok, measured=self.max_logprob_gap,
                       threshold=self.tolerance,
                       detail=f"max |trainer - sampling| logprob over {self.counts['logprob_pairs']} tokens"),
            self.mismatch.gate(),
        ]

    def reward_per_step(self) -> dict[int, float]:
        return {step: sum(r) / len(r) for step, r in sorted(self.step_rewards.items())}

    def degeneracy_gates(self, min_groups_with_variance: float, expects_tools: bool = True) -> list[GateResult]:
        """Rewards, advantages and tool use (for a family that has tools) must carry signal, or an update
        proves nothing."""
        episodes = self.counts["episodes"] or 1
        groups = len(self.group_rewards) or 1
        varied = sum(1 for rewards in self.group_rewards.values() if len(set(rewards)) > 1)
        tool_share = self.counts["episodes_with_tool_calls"] / episodes
        tools = [GateResult(name="signal:tool-calls", passed=self.counts["episodes_with_tool_calls"] > 0,
                            measured=round(tool_share, 4), threshold="> 0",
                            detail=f"{self.counts['episodes_with_tool_calls']}/{self.counts['episodes']} episodes "
                                   "called a tool")] if expects_tools else []
        return tools + [
            GateResult(name="signal:reward-variance", passed=varied / groups >= min_groups_with_variance and varied > 0,
                       measured=round(varied / groups, 4), threshold=min_groups_with_variance,
                       detail=f"{varied}/{len(self.group_rewards)} groups have reward variance"),
            GateResult(name="signal:advantages", passed=self.advantages_nonzero > 0,
                       measured=self.advantages_nonzero, threshold="> 0",
                       detail=f"{self.advantages_nonzero}/{self.rows} rows with non-zero advantage"),
        ]

    def revision_gate(self, initial_revision: str, checkpoint_revisions: dict[int, str]) -> GateResult:
        """Step s must be sampled by the weights of checkpoint s-1 (the initial policy for s = 1)."""
        wrong = []
        for episode_id, episode in self.episodes.items():
            expected = initial_revision if episode.step <= 1 else checkpoint_revisions.get(episode.step - 1)
            if expected is None or episode.revision != expected:
                wrong.append(episode_id)
        return GateResult(name="trace:policy-revision", passed=not wrong, measured=len(wrong), threshold=0,
                          detail=(f"{len(wrong)} episode(s) name a revision that is not the checkpoint before their "
                                  f"step, e.g. {wrong[:3]}") if wrong else
                          "each step sampled by the previous checkpoint's weights")


def _first_difference(a: list[int], b: list[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))
