"""Distillation's host audit on constructed teacher samples: the accounting, the host's own re-scoring,
the kept/dropped decision and the evaluation overlap, each caught when a stack's file lies; the plan
checks of recipe: distill; and (slow) a small distill plan through `runner qualify`."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from conftest import stage_evidence

from qualification.gates import distill_gates
from qualification.tasks import get_family
from runner.api import UserError, load_plan
from runner_contracts import TeacherSample, ToolCallRecord

PLAN_FILE = Path(__file__).resolve().parents[1] / "qualification" / "plans" / "calc-tool-distill-cpu.yaml"


def plan(samples_per_item: int = 2, n: int = 3):
    loaded = load_plan(PLAN_FILE)
    task = msgspec.structs.replace(loaded.task, train=msgspec.structs.replace(loaded.task.train, n=n))
    return msgspec.structs.replace(loaded, task=task, distill=msgspec.structs.replace(
        loaded.distill, samples_per_item=samples_per_item))


def sample(item, attempt: int, *, correct: bool = True, finish: str = "stop", **fields) -> TeacherSample:
    expression, answer = item.reference["expression"], item.reference["answer"]
    answer = answer if correct else answer + 1
    messages = [{"role": "user", "content": item.question}, {"role": "assistant", "content": f"Antwort: {answer}"},
                {"role": "assistant", "content": f"attempt {attempt}"}]
    record = TeacherSample(task_id=item.task_id, family="calc-tool", item=item.to_json(), attempt=attempt,
                           messages=messages, final_text=f"Antwort: {answer}", finish_reason=finish,
                           tool_calls=[ToolCallRecord(name="rechner", arguments={"ausdruck": expression},
                                                      result=str(item.reference["answer"]))],
                           success=correct, kept=correct and finish == "stop",
                           dropped=None if correct and finish == "stop" else
                           "rejected-by-scorer" if not correct else "truncated")
    return msgspec.structs.replace(record, **fields)


def items(the_plan):
    split = the_plan.task.train
    return get_family("calc-tool").generate(split.split, split.n, split.seed)


def gates_of(samples, the_plan):
    gates, metrics = distill_gates(samples, the_plan)
    return {g.name: g for g in gates}, metrics


def test_an_honest_file_passes_and_its_counts_add_up():
    the_plan = plan()
    first, second, third = items(the_plan)
    samples = [sample(first, 0), sample(second, 0, correct=False), sample(third, 0, finish="length"),
               sample(first, 1), sample(second, 1), sample(third, 1)]
    # A repeat of an earlier episode, token for token, is dropped as a duplicate.
    samples[5] = msgspec.structs.replace(samples[5], messages=samples[2].messages, kept=False, dropped="duplicate")
    gates, metrics = gates_of(samples, the_plan)
    assert all(g.passed for g in gates.values()), {n: g.detail for n, g in gates.items() if not g.passed}
    assert metrics["samples"] == 6 and metrics["kept"] == 3
    assert metrics["dropped"] == {"duplicate": 1, "rejected-by-scorer": 1, "truncated": 1}
    assert metrics["kept"] + sum(metrics["dropped"].values()) == metrics["samples"]


def test_a_missing_or_repeated_sample_fails_the_accounting():
    the_plan = plan()
    first, second, third = items(the_plan)
    samples = [sample(first, 0), sample(second, 0), sample(third, 0), sample(first, 1), sample(second, 1)]
    gates, _ = gates_of(samples, the_plan)
    assert not gates["distill:every-sample-recorded"].passed
    assert "missing [(" in gates["distill:every-sample-recorded"].detail
    gates, _ = gates_of(samples + [sample(third, 1), msgspec.structs.replace(sample(third, 1), messages=[])],
                        the_plan)
    assert "repeated [(" in gates["distill:every-sample-recorded"].detail


def test_a_stack_that_lies_about_a_verdict_or_a_decision_is_caught():
    the_plan = plan(samples_per_item=1)
    first, second, third = items(the_plan)
    lying = msgspec.structs.replace(sample(second, 0, correct=False), success=True, kept=True, dropped=None)
    gates, _ = gates_of([sample(first, 0), lying, sample(third, 0)], the_plan)
    assert not gates["distill:verdicts-reproduce"].passed and not gates["distill:kept-as-filtered"].passed
    dropping = msgspec.structs.replace(sample(third, 0), kept=False, dropped="duplicate")
    gates, _ = gates_of([sample(first, 0), sample(second, 0), dropping], the_plan)
    assert gates["distill:verdicts-reproduce"].passed and not gates["distill:kept-as-filtered"].passed
    assert "duplicate, not kept" in gates["distill:kept-as-filtered"].detail


def test_a_sample_of_an_evaluation_item_is_dropped_and_never_taught():
    the_plan = plan(samples_per_item=1, n=1)
    held_out = get_family("calc-tool").generate("heldout", 1, the_plan.task.heldout.seed)[0]
    (train_item,) = items(the_plan)
    overlapping = msgspec.structs.replace(sample(train_item, 0), item=dataclasses.replace(
        train_item, question=held_out.question).to_json())
    gates, _ = gates_of([overlapping], the_plan)
    assert not gates["distill:no-evaluation-item-taught"].passed and not gates["distill:kept-as-filtered"].passed
    honest = msgspec.structs.replace(overlapping, kept=False, dropped="overlaps-evaluation")
    gates, metrics = gates_of([honest], the_plan)
    assert gates["distill:no-evaluation-item-taught"].passed and gates["distill:kept-as-filtered"].passed
    assert not gates["distill:kept-some"].passed and metrics["dropped"] == {"overlaps-evaluation": 1}


@pytest.mark.parametrize("edit,message", [
    (lambda text: text.replace("recipe: distill\n", ""), r"field distill: given with recipe 'grpo'"),
    (lambda text: text.split("distill:\n")[0] + text.split("fewer repeats\n")[1],
     r"field distill: recipe distill needs a distill block"),
    (lambda text: text.replace("teacher: {kind: tiny, tiny: {seed: 0}}", "teacher: {kind: path}"),
     r"field distill.teacher.path: required when distill.teacher.kind is 'path'"),
    (lambda text: text.replace("samples_per_item: 4", "samples_per_item: 0"),
     r"field distill.samples_per_item: Expected `int` >= 1"),
])
def test_a_bad_distill_plan_names_its_field(tmp_path, edit, message):
    bad = tmp_path / "plan.yaml"
    bad.write_text(edit(PLAN_FILE.read_text()))
    with pytest.raises(UserError, match=message):
        load_plan(bad)


def test_only_a_stack_that_samples_a_teacher_runs_the_recipe():
    from runner._plan_checks import arm_problem

    assert arm_problem(plan(), ["trl"]) is None
    problem = arm_problem(plan(), ["trl", "openenv", "skyrl-gym"])
    assert problem == ("recipe distill needs a stack that samples the teacher and fine-tunes the student (trl); "
                       "openenv, skyrl-gym cannot")


@pytest.mark.slow
def test_a_distill_plan_qualifies_with_its_matched_baseline_and_its_accounting_adds_up(tmp_path):
    """`runner qualify --stack trl` on the distill plan, made small: the demo's tiny policy as the teacher, a
    fresh tiny student (20 warm-start steps), a quarter of the train items, two samples each."""
    text = PLAN_FILE.read_text()
    for old, new in [("n: 64", "n: 16"), ("n: 48", "n: 12"), ("samples_per_item: 4", "samples_per_item: 2"),
                     ("steps: 8", "steps: 2"), ("resume_steps: 3", "resume_steps: 2")]:
        text = text.replace(old, new)
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    run_dir = tmp_path / "run"
    result = subprocess.run([str(Path(sys.executable).parent / "runner"), "qualify", "--stack", "trl", "--plan",
                             str(plan), "--run-dir", str(run_dir), "--json"], capture_output=True, text=True, timeout=3600)
    assert result.returncode in (0, 1), result.stderr[-3000:]
    data = json.loads(result.stdout)
    assert data["passed"], data["failed_gates"]
    distill = stage_evidence(run_dir, "distill")
    metrics = distill["metrics"]
    assert metrics["samples"] == 16 * 2 == metrics["kept"] + sum(metrics["dropped"].values()) and metrics["kept"]
    assert metrics["teacher_sha256"] == json.loads((run_dir / "plan.json").read_text())["distill"]["teacher"]["sha256"]
    train = stage_evidence(run_dir, "train")
    assert {g["name"] for g in train["gates"]} >= {"sft:rows-match-demonstrations", "baseline-sft:rows-match-demonstrations"}
    assert train["metrics"]["demonstrations"] == train["metrics"]["baseline"]["demonstrations"] == metrics["kept"]
    # The student is trained on the teacher's kept episodes: one demonstration per kept sample, by its id.
    kept = [json.loads(line) for line in (run_dir / "stages" / "distill" / "teacher.jsonl").read_text().splitlines()]
    kept = {f"{s['task_id']}/attempt-{s['attempt']}" for s in kept if s["kept"]}
    demos = (run_dir / "stages" / "train" / "demonstrations.jsonl").read_text().splitlines()
    assert {json.loads(line)["task_id"] for line in demos} == kept
    for split in ("heldout", "retention"):
        assert data["evaluation"][split]["baseline"]["reading"].startswith("base = the matched SFT baseline")
