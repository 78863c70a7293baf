"""Distillation: the teacher samples episodes on the train split through TRL's own tool loop, and the ones
the task's reference scorer accepts become the student's SFT demonstrations (teacher.jsonl, every sample
with its verdict; the host re-scores them and checks the accounting)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import msgspec

from qualification.tasks import TaskItem, get_family
from runner_contracts import TEACHER_FILE, JsonlWriter, StageRequest, TeacherSample, ToolCallRecord, iter_jsonl

from .environment import environment_class, tool_methods
from .policy import conversation_ids, training_chat_template


def _held_out_questions(plan) -> set[str]:
    return {item.question for spec in (plan.task.heldout, plan.task.retention)
            for item in get_family(spec.family or plan.task.family).generate(spec.split, spec.n, spec.seed)}


def _plain(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """TRL's completion messages as JSON (tool-call arguments stay dicts)."""
    return json.loads(json.dumps(messages, default=str))


def sample_teacher(request: StageRequest) -> dict[str, Any]:
    """`samples_per_item` sampled episodes of the teacher per train item, each kept or dropped for a reason."""
    import torch

    from .grpo import build_trainer, run_episodes, task_rows

    plan, spec = request.plan, request.plan.distill
    teacher = msgspec.structs.replace(plan, policy=spec.teacher)  # the teacher renders and parses its own format
    split = plan.task.train
    rows = task_rows(split.family or plan.task.family, split.split, split.n, split.seed)
    out = Path(request.out_dir)
    trainer = build_trainer(teacher, Path(request.options["teacher_policy"]), out / "scratch", steps=1,
                            recorder=None, train_items=rows)
    questions, seen = _held_out_questions(plan), set()
    counts = {"samples": 0, "kept": 0}
    with JsonlWriter(out / TEACHER_FILE) as writer:
        for attempt in range(spec.samples_per_item):
            torch.manual_seed(plan.sampling.seed * 7919 + attempt)
            for row, env, transcript, finish, completion in run_episodes(trainer, rows,
                                                                         sampling=spec.sampling or plan.sampling):
                item = TaskItem.from_json(row["item"])
                success = env.family.score(item, transcript).success
                sample = TeacherSample(
                    task_id=item.task_id, family=item.family, item=row["item"], attempt=attempt,
                    messages=_plain(row["prompt"] + completion), final_text=transcript.final_text,
                    finish_reason=finish, success=success, kept=False,
                    tool_calls=[ToolCallRecord(name=c.name, arguments=c.arguments, result=c.result)
                                for c in transcript.tool_calls])
                key = json.dumps(sample.messages, sort_keys=True)
                dropped = ("rejected-by-scorer" if not success else "truncated" if finish != "stop"
                           else "overlaps-evaluation" if item.question in questions
                           else "duplicate" if key in seen else None)
                seen.add(key)
                counts["samples"] += 1
                counts[dropped or "kept"] = counts.get(dropped or "kept", 0) + 1
                writer.write(msgspec.structs.replace(sample, kept=dropped is None, dropped=dropped))
    shutil.rmtree(out / "scratch", ignore_errors=True)
    return counts


def teacher_demonstrations(tokenizer, path: Path) -> list[tuple[str, list[int], list[int]]]:
    """(task_id, ids, assistant mask) of every kept teacher sample, rendered by the student's template."""
    template = training_chat_template(tokenizer)
    demonstrations = []
    for _, sample in iter_jsonl(path, TeacherSample):
        if sample.kept:
            tools = tool_methods(environment_class(sample.family)()) or None
            demonstrations.append((f"{sample.task_id}/attempt-{sample.attempt}",
                                   *conversation_ids(tokenizer, sample.messages, tools, template)))
    return demonstrations
