"""The evaluate stage: the base and the trained policy, greedy, on the held-out and retention splits;
paired statistics decide the verdicts. Then the plan's evaluation harnesses on both (harnesses.py)."""

from __future__ import annotations

from qualification.gates import evaluate_gates, latest_complete_checkpoint
from runner_contracts import ErrorInfo, EvalRecord, read_jsonl

from .arm import Arm, StageOutput, run_adapter
from .harnesses import run_harnesses


def stage_evaluate(arm: Arm) -> StageOutput:
    trained = latest_complete_checkpoint(arm.stage_dir("train") / "checkpoints")
    if trained is None:
        return StageOutput(error=ErrorInfo(kind="missing-input", message="evaluate needs the train stage's final "
                                           "checkpoint in this run directory; run the train stage first"))
    out = arm.stage_dir("evaluate")
    options = {"trained_policy": str(trained.resolve())}
    if arm.plan.recipe == "distill":  # and the matched SFT baseline the train stage fine-tuned beside it
        baseline = latest_complete_checkpoint(arm.stage_dir("train") / "baseline" / "checkpoints")
        if baseline is not None:
            options["baseline_policy"] = str(baseline.resolve())
    _, result = run_adapter(arm, "evaluate", out, options=options)
    gates, summary = evaluate_gates(read_jsonl(out / "eval.jsonl", EvalRecord), arm.plan.gates.retention_margin,
                                    arm.plan.gates.confidence)
    metrics = {"trained_policy": trained.name, "decoding": "greedy", **summary}
    if arm.plan.harnesses:  # a list, never mistaken for a split's row (those are dicts)
        harness_checks, metrics["harnesses"] = run_harnesses(arm, trained, out)
        gates += harness_checks
    return StageOutput(metrics=metrics, gates=gates)
