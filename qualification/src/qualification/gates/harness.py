"""The audit of an evaluation harness's run on the base and the trained checkpoint: what it scored (its
per-sample records), what it reported (its headline metric), and what the policy server answered (its call
log, which the trainer's own server wrote) must agree."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from runner_contracts import GateResult, HarnessSample, PolicyCall

from ..stats import compare_paired
from .stages import paired_row

MEAN_METRICS = ("accuracy", "mean", "exact_match", "acc")  # a headline that is the mean of per-sample scores


@dataclass
class HarnessRun:
    """One harness job on one checkpoint: its samples, its reported figures and the server's calls."""

    samples: list[HarnessSample]
    reported: dict[str, Any]
    calls: list[PolicyCall]


def harness_gates(stack: str, runs: dict[str, HarnessRun], confidence: float) -> tuple[list[GateResult], dict]:
    """Gates `harness:<stack>:completed`, `:calls-attributed` and `:score-recomputed` over base and trained,
    and the summary: each checkpoint's headline and, when every score is 0 or 1, the paired comparison of the
    two on the same samples (exact McNemar, as the evaluate stage's splits)."""
    problems: dict[str, list[str]] = {"completed": [], "attributed": [], "recomputed": []}
    summary: dict[str, Any] = {}
    for label, run in runs.items():
        reported = run.reported
        if reported.get("status") != "success" or not run.samples or reported.get("samples") != len(run.samples):
            problems["completed"].append(
                f"{label}: status {reported.get('status')!r}, {len(run.samples)} scored samples against "
                f"{reported.get('samples')} reported" + (f" ({reported['error']})" if reported.get("error") else ""))
        sample_episodes = {s.episode_id for s in run.samples}
        call_episodes = {c.episode_id for c in run.calls}
        unattributed = sum(1 for c in run.calls if c.episode_id is None)
        unserved = sorted(sample_episodes - call_episodes)
        stray = sorted(e for e in call_episodes - sample_episodes if e is not None)
        if unattributed or unserved or stray or not run.calls:
            problems["attributed"].append(
                f"{label}: {unattributed} unattributed calls, {len(unserved)} samples without a served call "
                f"{unserved[:3]}, {len(stray)} calls of no scored sample {stray[:3]}")
        scores = [s.score for s in run.samples]
        mean = sum(scores) / len(scores) if scores else math.nan
        value = reported.get("value")
        if reported.get("metric") in MEAN_METRICS and not (isinstance(value, (int, float)) and abs(mean - value) < 1e-9):
            problems["recomputed"].append(f"{label}: {reported.get('metric')} reported {value}, the samples' mean "
                                          f"is {mean:.6g}")
        summary[label] = {"value": value, "stderr": reported.get("stderr"), "samples": len(run.samples),
                          "calls": len(run.calls), "log": reported.get("log")}
    base, trained = runs.get("base"), runs.get("trained")
    if base and trained:
        by_id = [{(s.sample_id, s.epoch): s.score for s in run.samples} for run in (base, trained)]
        shared = sorted(set(by_id[0]) & set(by_id[1]))
        binary = shared and all(by[key] in (0.0, 1.0) for by in by_id for key in shared)
        if binary and len(shared) == len(by_id[0]) == len(by_id[1]):
            summary["paired"] = paired_row(compare_paired([by_id[0][k] == 1.0 for k in shared],
                                                           [by_id[1][k] == 1.0 for k in shared], confidence), confidence)
    metric = next((run.reported.get("metric") for run in runs.values() if run.reported.get("metric")), None)
    mean_metric = metric in MEAN_METRICS
    gates = [
        GateResult(name=f"harness:{stack}:completed", passed=not problems["completed"],
                   measured=sum(len(run.samples) for run in runs.values()), threshold="every sample scored",
                   detail="; ".join(problems["completed"]) or
                          ", ".join(f"{label} {len(run.samples)} samples" for label, run in runs.items())),
        GateResult(name=f"harness:{stack}:calls-attributed", passed=not problems["attributed"],
                   measured=sum(len(run.calls) for run in runs.values()), threshold="each call a scored sample's",
                   detail="; ".join(problems["attributed"]) or
                          "every call the policy server answered belongs to a sample the harness scored, and every "
                          "sample was served"),
        GateResult(name=f"harness:{stack}:score-recomputed", passed=not problems["recomputed"],
                   measured=metric, threshold="headline == mean of the samples' scores" if mean_metric else "n/a",
                   detail="; ".join(problems["recomputed"]) or
                          (f"{metric} recomputed from the per-sample scores" if mean_metric else
                           f"{metric} is not a mean of per-sample scores: taken from the harness's log as it is")),
    ]
    return gates, summary
