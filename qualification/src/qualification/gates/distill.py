"""Distillation audit: the teacher's samples (teacher.jsonl) re-judged on the host. Every sample the plan
asks for is there once, the reference scorer gives each the verdict the stack wrote, and each kept or
dropped decision follows from the verdict, the finish, the evaluation splits and the earlier samples, in
that order; so the kept and dropped counts add up by construction, not by the stack's word."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable

import msgspec

from runner_contracts import GateResult, Plan, TeacherSample

from ..tasks import TaskItem, ToolCall, Transcript, get_family


def evaluation_questions(plan: Plan) -> set[str]:
    """The questions of the held-out and retention items, which no demonstration may teach."""
    questions = set()
    for spec in (plan.task.heldout, plan.task.retention):
        questions |= {item.question for item in
                      get_family(spec.family or plan.task.family).generate(spec.split, spec.n, spec.seed)}
    return questions


def expected_drop(sample: TeacherSample, success: bool, questions: set[str], seen: set[str]) -> str | None:
    """Why a sample is dropped (the first reason that applies), or None when it is kept. Adds it to `seen`."""
    key = json.dumps(sample.messages, sort_keys=True)
    duplicate = key in seen
    seen.add(key)
    if not success:
        return "rejected-by-scorer"
    if sample.finish_reason != "stop":
        return "truncated"
    if TaskItem.from_json(sample.item).question in questions:
        return "overlaps-evaluation"
    return "duplicate" if duplicate else None


def distill_gates(samples: Iterable[TeacherSample], plan: Plan) -> tuple[list[GateResult], dict]:
    assert plan.distill is not None
    split = plan.task.train
    items = get_family(split.family or plan.task.family).generate(split.split, split.n, split.seed)
    wanted = {(item.task_id, attempt) for item in items for attempt in range(plan.distill.samples_per_item)}
    questions, seen = evaluation_questions(plan), set()
    found, rescored_wrong, decided_wrong, evaluation_kept = Counter(), [], [], []
    reasons: Counter[str] = Counter()
    for sample in samples:
        found[(sample.task_id, sample.attempt)] += 1
        item = TaskItem.from_json(sample.item)
        transcript = Transcript(final_text=sample.final_text,
                                tool_calls=[ToolCall(name=c.name, arguments=c.arguments, result=c.result)
                                            for c in sample.tool_calls])
        success = get_family(sample.family).score(item, transcript).success
        if success != sample.success:
            rescored_wrong.append(f"{sample.task_id}/{sample.attempt}")
        dropped = expected_drop(sample, success, questions, seen)
        if (dropped, dropped is None) != (sample.dropped, sample.kept):
            decided_wrong.append(f"{sample.task_id}/{sample.attempt}: {sample.dropped or 'kept'}, not {dropped or 'kept'}")
        if sample.kept and item.question in questions:
            evaluation_kept.append(sample.task_id)
        reasons[dropped or "kept"] += 1
    missing = sorted(wanted - set(found))
    repeated = sorted(key for key, count in found.items() if count > 1)
    extra = sorted(set(found) - wanted)
    total = sum(found.values())
    gates = [
        GateResult(name="distill:every-sample-recorded", passed=not (missing or repeated or extra),
                   measured=total, threshold=len(wanted),
                   detail=(f"missing {missing[:3]}, repeated {repeated[:3]}, not asked for {extra[:3]}"
                           if missing or repeated or extra else
                           f"{len(items)} train items x {plan.distill.samples_per_item} samples")),
        GateResult(name="distill:verdicts-reproduce", passed=not rescored_wrong, measured=len(rescored_wrong),
                   threshold=0, detail=(f"the reference scorer disagrees on {rescored_wrong[:3]}" if rescored_wrong
                                        else "the host's reference scorer gives every sample the stack's verdict")),
        GateResult(name="distill:kept-as-filtered", passed=not decided_wrong, measured=len(decided_wrong), threshold=0,
                   detail="; ".join(decided_wrong[:3]) if decided_wrong else
                   "kept exactly the accepted, complete, new samples of no held-out or retention item"),
        GateResult(name="distill:no-evaluation-item-taught", passed=not evaluation_kept,
                   measured=len(evaluation_kept), threshold=0,
                   detail=f"kept samples of evaluation items: {evaluation_kept[:3]}" if evaluation_kept else ""),
        GateResult(name="distill:kept-some", passed=reasons["kept"] > 0, measured=reasons["kept"], threshold=">= 1",
                   detail="" if reasons["kept"] else "the teacher passed no sample: nothing to fine-tune the student on"),
    ]
    metrics = {"samples": total, "kept": reasons.pop("kept", 0), "dropped": dict(sorted(reasons.items())),
               "teacher_sha256": plan.distill.teacher.sha256, "teacher_revision": plan.distill.teacher.revision,
               "sampling": msgspec.to_builtins(plan.distill.sampling or plan.sampling),
               "scorer": f"{plan.reward.scorer} v{plan.reward.version}"}
    return gates, metrics
