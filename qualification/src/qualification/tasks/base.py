"""The task interface every arm calls into: items, tools, scoring, demonstrations."""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

SPLITS = ("train", "heldout", "retention")


@dataclass(frozen=True)
class ToolParam:
    name: str
    type: str  # JSON-schema type name: "string" | "integer" | "number"
    description: str


@dataclass(frozen=True)
class ToolSpec:
    """A tool the policy may call. Stacks render it in their native tool format."""

    name: str
    description: str
    params: tuple[ToolParam, ...]


@dataclass(frozen=True)
class TaskItem:
    family: str
    split: str
    task_id: str
    question: str
    reference: dict[str, Any]  # family-specific ground truth, JSON-serialisable

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TaskItem:
        return cls(**json.loads(text))


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    result: str


@dataclass
class Transcript:
    """What a policy did in one episode, as the scorer sees it."""

    final_text: str
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class Score:
    reward: float
    success: bool
    components: dict[str, float]
    outcome: str  # success | failure (truncation/error are decided by the caller)


class TaskFamily(Protocol):
    """What every family provides. `frozen_splits` names the splits the family offers with the (n, seed)
    its plans use (`runner tasks list` hashes them); a family without a held-out split (a retention
    probe) leaves it out, and the train/held-out disjointness check is not asked of it."""

    name: str
    scorer_version: int
    synthetic: bool
    system_prompt: str
    tools: tuple[ToolSpec, ...]
    frozen_splits: dict[str, tuple[int, int]]

    def generate(self, split: str, n: int, seed: int) -> list[TaskItem]: ...

    def initial_state(self, item: TaskItem) -> dict[str, Any]:
        """The episode's mutable world (CRM, calendar, ...); tools read and change it."""
        ...

    def call_tool(self, item: TaskItem, state: dict[str, Any], name: str, arguments: dict[str, Any]) -> str: ...

    def score(self, item: TaskItem, transcript: Transcript) -> Score: ...

    def demonstration(self, item: TaskItem) -> list[dict[str, Any]]: ...

    def scripted_cases(self, item: TaskItem) -> list[dict[str, Any]]: ...


def opening_messages(family: TaskFamily, item: TaskItem) -> list[dict[str, Any]]:
    """An episode's first messages: the system prompt (the family's `system_prompt_for(item)` where it
    has one, a dataset row's own say, else its `system_prompt`) and the item's question; a family whose
    items carry their own conversation (a native asset's rows) gives it through `messages_for(item)`."""
    own = getattr(family, "messages_for", None)
    if own is not None:
        return own(item)
    per_item = getattr(family, "system_prompt_for", None)
    system = per_item(item) if per_item is not None else family.system_prompt
    return [{"role": "system", "content": system}, {"role": "user", "content": item.question}]


def replay(family: TaskFamily, item: TaskItem, calls: list[ToolCall]) -> tuple[dict[str, Any], list[str]]:
    """Re-executes recorded tool calls on a fresh state: the final state and the reference results.
    Scorers judge final states this way, so a transcript alone determines the score."""
    state = family.initial_state(item)
    return state, [family.call_tool(item, state, call.name, call.arguments) for call in calls]


def split_rng(family: str, split: str, seed: int) -> random.Random:
    """A generator seeded by (family, split, seed); string seeds are stable across runs and platforms."""
    return random.Random(f"{family}/{split}/{seed}")


def hash_bucket(text: str, buckets: int = 5) -> int:
    """A stable bucket for a text; families put bucket 0 in held-out so splits never share an item."""
    return int(hashlib.sha256(text.encode()).hexdigest(), 16) % buckets


def split_hash(items: list[TaskItem]) -> str:
    """Content hash of a frozen split: sha256 over the items' canonical JSON lines."""
    digest = hashlib.sha256()
    for item in items:
        digest.update(item.to_json().encode())
        digest.update(b"\n")
    return digest.hexdigest()


FINAL_ANSWER = re.compile(r"^Antwort:\s*(-?\d+)\s*$")


def strict_final_answer(text: str) -> int | None:
    """The integer on the last non-empty line if it reads exactly 'Antwort: <int>', else None."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return None
    match = FINAL_ANSWER.match(lines[-1])
    return int(match.group(1)) if match else None


def ngram_overlap(train: list[TaskItem], heldout: list[TaskItem], n: int = 8) -> float:
    """Share of held-out items that share a word n-gram with any train item."""
    def grams(text: str) -> set[tuple[str, ...]]:
        words = text.lower().split()
        return {tuple(words[i : i + n]) for i in range(max(0, len(words) - n + 1))}

    train_grams: set[tuple[str, ...]] = set()
    for item in train:
        train_grams |= grams(item.question)
    if not heldout:
        return 0.0
    hits = sum(1 for item in heldout if grams(item.question) & train_grams)
    return hits / len(heldout)


def exact_overlap(train: list[TaskItem], heldout: list[TaskItem]) -> int:
    """Number of held-out items whose question also appears verbatim in the train split."""
    seen = {item.question for item in train}
    return sum(1 for item in heldout if item.question in seen)
