"""Training rows from captured policy calls by exact prefix continuity.

An episode's calls form one row while each call's prompt starts with the previous call's prompt + sampled
ids: the ids in between (tool results, template text) get loss mask 0, sampled ids mask 1. A call whose
prompt does not continue the row is a continuity break: it and later calls are not trained (a trainer
that takes one sequence per sample cannot start a second row), and both counts are reported.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol


class CapturedCall(Protocol):
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]


@dataclass
class ChainedRow:
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1 = sampled by the policy
    logprobs: list[float] = field(default_factory=list)  # sampling logprobs, 0.0 where mask is 0
    calls_used: int = 0
    breaks: int = 0
    untrained_calls: int = 0


def chain_calls(calls: list[CapturedCall]) -> ChainedRow | None:
    """One row from an episode's calls, in call order; None when there were none."""
    if not calls:
        return None
    first = calls[0]
    row = ChainedRow(prompt_ids=list(first.prompt_ids), completion_ids=list(first.completion_ids),
                     mask=[1] * len(first.completion_ids), logprobs=list(first.logprobs), calls_used=1)
    sequence = row.prompt_ids + row.completion_ids
    for index, call in enumerate(calls[1:], start=1):
        if call.prompt_ids[: len(sequence)] != sequence:
            row.breaks = 1
            row.untrained_calls = len(calls) - index
            break
        between = call.prompt_ids[len(sequence):]
        row.completion_ids += between + list(call.completion_ids)
        row.mask += [0] * len(between) + [1] * len(call.completion_ids)
        row.logprobs += [0.0] * len(between) + list(call.logprobs)
        row.calls_used += 1
        sequence = row.prompt_ids + row.completion_ids
    return row


def mask_runs(mask: list[int]) -> Iterator[tuple[int, int, bool]]:
    """(start, end, value) for the maximal runs of equal values: policy (1) and non-policy (0) segments."""
    start = 0
    for index in range(1, len(mask) + 1):
        if index == len(mask) or mask[index] != mask[start]:
            yield start, index, bool(mask[start])
            start = index
