"""Policy-server audits for environment-stack arms: every call attributed to an episode of the stage, and
every trajectory's policy tokens exactly the ids the server sampled for that episode."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from runner_contracts import GateResult, PolicyCall, Trajectory


def call_gates(calls: list[PolicyCall], trajectories: list[Trajectory]) -> tuple[list[GateResult], dict[str, Any]]:
    episodes = {t.episode_id for t in trajectories}
    unattributed = [c.call_id for c in calls if c.episode_id is None]
    foreign = sorted({c.episode_id for c in calls if c.episode_id is not None and c.episode_id not in episodes})
    by_episode: dict[str, list[PolicyCall]] = defaultdict(list)
    last_attempt: dict[str, int] = {}
    for call in calls:
        if call.episode_id is not None:
            last_attempt[call.episode_id] = max(call.attempt, last_attempt.get(call.episode_id, 1))
    for call in calls:  # a trajectory holds the tokens of its episode's last attempt only
        if call.episode_id is not None and call.attempt == last_attempt[call.episode_id]:
            by_episode[call.episode_id].append(call)
    abandoned = sum(1 for call in calls if call.episode_id is not None and call.attempt < last_attempt[call.episode_id])
    mismatched = []
    breaks = untrained = without_calls = 0
    for trajectory in trajectories:
        policy = [token for s in trajectory.segments if s.source == "policy" for token in s.token_ids]
        captured: list[int] = []
        prefixes = [list(captured)]
        for call in sorted(by_episode.get(trajectory.episode_id, []), key=lambda c: c.index_in_episode):
            captured += call.completion_ids
            prefixes.append(list(captured))
        without_calls += len(prefixes) == 1
        # The row may stop at a continuity break, never elsewhere; a first call cannot break, so a completed
        # episode that called the policy trains at least its first call.
        if policy not in prefixes or (not policy and len(prefixes) > 1 and trajectory.outcome != "error"):
            mismatched.append(trajectory.episode_id)
        elif trajectory.outcome != "error" and (left := len(prefixes) - 1 - prefixes.index(policy)):
            breaks, untrained = breaks + 1, untrained + left
    channels = sorted({c.channel for c in calls})
    gates = [
        GateResult(name="calls:attributed", passed=not unattributed and not foreign,
                   measured=len(unattributed) + len(foreign), threshold=0,
                   detail=(f"{len(unattributed)} unattributed, {len(foreign)} naming no episode of this stage "
                           f"{foreign[:3]}" if unattributed or foreign else
                           f"{len(calls)} calls, each attributed to one of {len(episodes)} episodes (via {', '.join(channels)})")),
        GateResult(name="calls:policy-tokens-captured", passed=not mismatched and bool(trajectories),
                   measured=len(mismatched), threshold=0,
                   detail=(f"policy tokens differ from the server's sampled ids: {mismatched[:3]}" if mismatched else
                           "every trajectory's policy tokens are the policy server's sampled ids, in call order")),
    ]
    metrics = {"policy_calls": len(calls), "unattributed_calls": len(unattributed), "attribution_channels": channels,
               "calls_per_episode": round(len(calls) / max(1, len(episodes)), 3),
               "calls_of_abandoned_attempts": abandoned, "continuity_breaks": breaks, "untrained_calls": untrained,
               "episodes_without_calls": without_calls,
               "failed_episodes": sum(1 for t in trajectories if t.outcome == "error"),
               "retried_episodes": len({c.episode_id for c in calls if c.attempt > 1 and c.episode_id is not None})}
    return gates, metrics
