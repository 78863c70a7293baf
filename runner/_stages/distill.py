"""The distill stage (recipe: distill): the teacher samples the train split in the stack, and the host
re-judges every sample (qualification.gates.distill) before the student is fine-tuned on the kept ones."""

from __future__ import annotations

from qualification.gates import distill_gates
from runner_contracts import TEACHER_FILE, TeacherSample, read_jsonl

from .arm import Arm, StageOutput, run_adapter


def stage_distill(arm: Arm) -> StageOutput:
    assert arm.plan.distill is not None and arm.plan.distill.teacher.path
    out = arm.stage_dir("distill")
    run_adapter(arm, "distill", out, options={"teacher_policy": arm.plan.distill.teacher.path})
    gates, metrics = distill_gates(read_jsonl(out / TEACHER_FILE, TeacherSample), arm.plan)
    return StageOutput(metrics=metrics, gates=gates)
