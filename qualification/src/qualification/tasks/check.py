"""Checks a task family on its own, before any run spends compute on it: its generator is deterministic
and its splits disjoint, its demonstrations succeed under its own scorer and tools, its scripted
known-good cases succeed and known-bad ones fail, and its rewards stay in [0, 1]."""

from __future__ import annotations

from typing import Any

from .base import Score, TaskFamily, TaskItem, ToolCall, Transcript, exact_overlap
from .registry import get_family


def service_cases(plan: Any, per_family: int = 3) -> list[tuple[str, TaskItem, dict[str, Any]]]:
    """(family, item, case) of every scripted episode the service stage runs for `plan`: `per_family` items
    of the train split's and of the retention split's family with each item's scripted cases, or a native
    asset's own answer key. The adapter that runs them and the host that expects them both call this."""
    cases = []
    for family_name, split in ((plan.task.family, plan.task.train),
                               (plan.task.retention.family or plan.task.family, plan.task.retention)):
        family = get_family(family_name)
        own = getattr(family, "service_cases", None)
        pairs = own() if own is not None else [(item, case) for item in family.generate(split.split, per_family, split.seed)
                                               for case in family.scripted_cases(item)]
        cases += [(family_name, item, case) for item, case in pairs]
    return cases


def play_scripted_case(family: TaskFamily, item: TaskItem, case: dict[str, Any]) -> Score:
    """A scripted case's turns through the family's own tools and scorer: a tool_call turn runs the tool
    on the episode's state, a text turn (or a malformed raw_tool_call) is the final answer."""
    state = family.initial_state(item)
    calls: list[ToolCall] = []
    final = ""
    for turn in case["turns"]:
        if "tool_call" in turn:
            call = turn["tool_call"]
            calls.append(ToolCall(call["name"], call["arguments"],
                                  family.call_tool(item, state, call["name"], call["arguments"])))
        elif "text" in turn:
            final = turn["text"]
        elif "raw_tool_call" in turn:
            final = turn["raw_tool_call"]
    return family.score(item, Transcript(final_text=final, tool_calls=calls))


def _play_demonstration(family: TaskFamily, item: TaskItem) -> Score:
    turns: list[dict[str, Any]] = []
    for message in family.demonstration(item):
        if message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or []:
            turns.append({"tool_call": {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}})
        if message.get("content"):
            turns.append({"text": message["content"]})
    return play_scripted_case(family, item, {"turns": turns})


def check_family(family: TaskFamily, n: int = 8, seed: int = 0) -> tuple[list[str], dict[str, int]]:
    """(problems found, counts checked) over `n` items of each split the family offers (frozen_splits)."""
    problems: list[str] = []
    counts = {"items": 0, "cases": 0, "demonstrations": 0}
    splits: dict[str, list[TaskItem]] = {}
    if "train" not in family.frozen_splits:
        problems.append(f"frozen_splits {sorted(family.frozen_splits)} has no train split")
    for split in family.frozen_splits:
        count = min(n, family.frozen_splits[split][0])  # a dataset's split may hold fewer rows than n
        try:
            items = family.generate(split, count, seed)
        except Exception as error:
            problems.append(f"generate({split!r}, {count}, {seed}) raised {type(error).__name__}: {error}")
            continue
        splits[split] = items
        if [i.to_json() for i in family.generate(split, count, seed)] != [i.to_json() for i in items]:
            problems.append(f"{split}: generate is not deterministic for seed {seed}")
        ids = [item.task_id for item in items]
        if len(set(ids)) != len(ids):
            problems.append(f"{split}: duplicate task ids")
        for item in items:
            counts["items"] += 1
            if item.family != family.name or item.split != split or not item.question.strip():
                problems.append(f"{item.task_id}: family/split must be {family.name}/{split} and the question "
                                "non-empty")
            try:
                demo = _play_demonstration(family, item)
                counts["demonstrations"] += 1
                if not demo.success:
                    problems.append(f"{item.task_id}: its demonstration does not succeed under the scorer "
                                    f"(components {demo.components})")
                cases = family.scripted_cases(item)
                if not any(c["expected_success"] for c in cases) or all(c["expected_success"] for c in cases):
                    problems.append(f"{item.task_id}: scripted cases need a known-good and a known-bad case")
                for case in cases:
                    counts["cases"] += 1
                    score = play_scripted_case(family, item, case)
                    if score.success != case["expected_success"]:
                        problems.append(f"{item.task_id}/{case['case']}: scored success={score.success}, "
                                        f"labelled {case['expected_success']}")
                    if not 0.0 <= score.reward <= 1.0:
                        problems.append(f"{item.task_id}/{case['case']}: reward {score.reward} outside [0, 1]")
            except Exception as error:
                problems.append(f"{item.task_id}: {type(error).__name__}: {error}")
    if "train" in splits and "heldout" in splits and exact_overlap(splits["train"], splits["heldout"]):
        problems.append(f"train and heldout share {exact_overlap(splits['train'], splits['heldout'])} question(s)")
    return problems, counts
