"""Gates of a domain stack's stages (runner_contracts.domain): data frozen by hash, training steps and
checkpoints, resume replay, and native metrics recomputed on the host from the per-item predictions, with
bootstrap intervals and a paired comparison of base and trained. numpy and scipy are imported on use: this
package is installed in every stack environment, and not every one has them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runner_contracts import DataSplit, DomainPrediction, DomainStep, GateResult, NativeMetric, sha256_path

BOOTSTRAP_RESAMPLES = 2000


def data_gates(prefix: str, manifest: list[DataSplit], folder: Path) -> tuple[list[GateResult], dict[str, str]]:
    """Every split the data job listed (a file, or a dataset folder) exists with the sha256 it claimed
    (recomputed here)."""
    found = {s.split: sha256_path(folder / s.path) if (folder / s.path).exists() else None for s in manifest}
    wrong = sorted(s.split for s in manifest if found[s.split] != s.sha256)
    return [GateResult(name=f"{prefix}:data-frozen", passed=bool(manifest) and not wrong, measured=wrong, threshold=[],
                       detail=(f"splits whose file does not hash as listed: {wrong}" if wrong else
                               "; ".join(f"{s.split}: {s.items} items, sha256 {s.sha256[:12]}" for s in manifest)))], \
        {split: digest for split, digest in found.items() if digest}


def step_gates(prefix: str, steps: list[DomainStep], expected: int, initial: str | None,
               revisions: dict[int, str], incomplete: list[str]) -> list[GateResult]:
    """One finite loss per step 1..expected, a complete checkpoint per step, and weights that moved."""
    numbers = [s.step for s in steps]
    finite = all(math.isfinite(s.loss) for s in steps)
    final = revisions.get(expected)
    return [
        GateResult(name=f"{prefix}:steps-logged", passed=numbers == list(range(1, expected + 1)) and finite,
                   measured=[round(s.loss, 6) for s in steps], threshold=f"steps 1..{expected}, finite losses",
                   detail="mean training loss per step as the trainer logged it (its word: the host cannot recompute "
                          "it; the resume stage checks that a resumed run logs the same)", reported_by="adapter"),
        GateResult(name=f"{prefix}:checkpoints-complete", passed=sorted(revisions) == list(range(1, expected + 1)),
                   measured=sorted(revisions), threshold=f"1..{expected}",
                   detail=f"incomplete: {incomplete}" if incomplete else "every step's checkpoint carries its marker"),
        GateResult(name=f"{prefix}:weights-changed", passed=final is not None and initial is not None and final != initial,
                   measured=(final or "")[:12], threshold=f"!= {(initial or '')[:12]}",
                   detail="sha256 of model.safetensors after the last step vs the initial weights"),
    ]


def replay_gates(plain: list[DomainStep], interrupted: list[DomainStep], resumed: list[DomainStep], kill_step: int,
                 final_plain: str | None, final_resumed: str | None) -> list[GateResult]:
    """Interrupted up to its last complete checkpoint, then resumed, must replay the uninterrupted run: the same
    data order and the same loss at every step (bit for bit), and the same final weights."""
    stitched = [s for s in interrupted if s.step <= kill_step] + [s for s in resumed if s.step > kill_step]

    def key(s: DomainStep) -> tuple:
        return s.step, s.order_sha256, s.loss

    differing = [a.step for a, b in zip(plain, stitched) if key(a) != key(b)]
    same = len(plain) == len(stitched) and not differing and bool(plain)
    return [
        GateResult(name="resume:same-steps", passed=same, measured=differing or len(stitched), threshold=len(plain),
                   detail="same data order and bit-identical loss at every step" if same else
                   f"steps {differing[:5]} differ, or {len(stitched)} steps against {len(plain)}"),
        GateResult(name="resume:same-final-weights", passed=final_plain is not None and final_plain == final_resumed,
                   measured=(final_resumed or "")[:12], threshold=(final_plain or "")[:12],
                   detail="sha256 of model.safetensors at the last step: resumed vs uninterrupted"),
    ]


def recompute(metric: NativeMetric, items: Sequence[DomainPrediction]) -> float | None:
    """The metric from the per-item values, by the rule the record names (runner_contracts.domain)."""
    rule = metric.recompute
    kind = rule.get("kind")
    if not items:
        return None
    if kind in ("mean", "rate"):
        values = [item.values[rule["key"]] for item in items]
        weights = [item.values[rule["weight"]] for item in items] if rule.get("weight") else [1.0] * len(values)
        return sum(v * w for v, w in zip(values, weights)) / sum(weights)
    if kind == "stability":
        true = [item.values[rule["true"]] <= rule.get("threshold", 0.0) for item in items]
        pred = [item.values[rule["pred"]] <= rule.get("threshold", 0.0) for item in items]
        return _classification(rule["metric"], true, pred)
    raise ValueError(f"native metric {metric.name}: unknown recompute rule {rule!r}")


def _classification(name: str, true: Sequence[bool], pred: Sequence[bool]) -> float | None:
    tp = sum(t and p for t, p in zip(true, pred))
    fp = sum(p and not t for t, p in zip(true, pred))
    fn = sum(t and not p for t, p in zip(true, pred))
    tn = len(true) - tp - fp - fn
    ratios = {"Precision": (tp, tp + fp), "Recall": (tp, tp + fn), "Accuracy": (tp + tn, len(true)),
              "F1": (2 * tp, 2 * tp + fp + fn)}
    if tp == 0:  # upstream's stable_metrics raises ZeroDivisionError then (P + R = 0, or a 0/0): none is defined
        return None
    top, bottom = ratios[name]
    return top / bottom


def metric_gates(prefix: str, metrics: list[NativeMetric], predictions: list[DomainPrediction],
                 data_hashes: dict[str, str], tolerance: float) -> tuple[list[GateResult], dict[tuple[str, str], list]]:
    """Each native metric equals its recomputation from the per-item values and was computed on the frozen split;
    returns the gate and the items grouped by (model, split)."""
    grouped: dict[tuple[str, str], list[DomainPrediction]] = {}
    for item in predictions:
        grouped.setdefault((item.model, item.split), []).append(item)
    disagree, wrong_data = [], []
    for metric in metrics:
        items = grouped.get((metric.model, metric.split), [])
        host = recompute(metric, items)
        if not _close(metric.value, host, tolerance) or metric.items != len(items):
            disagree.append(f"{metric.model} {metric.name}: {metric.value} vs {host} ({metric.items} vs {len(items)} items)")
        if data_hashes.get(metric.split) != metric.data_sha256:
            wrong_data.append(f"{metric.model} {metric.name}")
    return [
        GateResult(name=f"{prefix}:metrics-recomputed", passed=bool(metrics) and not disagree, measured=len(disagree),
                   threshold=0, detail="; ".join(disagree[:4]) or f"{len(metrics)} native metrics (the stack's own code) "
                   f"equal their recomputation from {len(predictions)} per-item records within {tolerance:g}"),
        GateResult(name=f"{prefix}:on-frozen-data", passed=bool(metrics) and not wrong_data, measured=wrong_data,
                   threshold=[], detail="every metric names the sha256 of the split file the data job froze"),
    ], grouped


def _close(a: float | None, b: float | None, tolerance: float) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= tolerance


def case_gates(metrics: list[NativeMetric], tolerance: float) -> list[GateResult]:
    """The service stage's known cases: every metric a case declares a value for scores it, and the perfect
    stand-in scores the ideal on every metric that has one (0 for an error, 1 for a rate or a classification;
    a return has none)."""
    wrong = [f"{m.model} {m.name}: {m.value} (must be {m.expected})" for m in metrics
             if m.expected is not None and not _close(m.value, m.expected, tolerance)]
    ideal = [f"perfect {m.name}: {m.value}" for m in metrics
             if m.model == "perfect" and (best := _ideal(m)) is not None and not _close(m.value, best, tolerance)]
    broken = [m for m in metrics if m.model == "broken" and m.expected is not None]
    return [GateResult(name="service:known-cases", passed=not wrong and not ideal and bool(broken),
                       measured=len(wrong) + len(ideal), threshold=0,
                       detail="; ".join((wrong + ideal)[:4]) or
                       f"perfect scores the ideal on every metric; broken scores the {len(broken)} values it must")]


def _ideal(metric: NativeMetric) -> float | None:
    if metric.direction == "lower":
        return 0.0
    return 1.0 if metric.recompute.get("kind") in ("rate", "stability") else None


def compare_models(name: str, direction: str, base: list[DomainPrediction], trained: list[DomainPrediction],
                   metric: NativeMetric, confidence: float, seed: int = 0) -> dict[str, Any]:
    """Base against trained on the same items: each one's value with a percentile bootstrap interval, and the
    paired difference (trained - base) with its interval from the same resamples; for a mean, a Wilcoxon
    signed-rank p-value on the per-item differences. The verdict reads the interval in the metric's direction."""
    import numpy as np
    from scipy.stats import wilcoxon

    by_id = {item.item_id: item for item in trained}
    pairs = [(item, by_id[item.item_id]) for item in base if item.item_id in by_id]
    n = len(pairs)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, n, size=(BOOTSTRAP_RESAMPLES, n))

    def statistic(which: int, index) -> float | None:
        return recompute(metric, [pairs[i][which] for i in index])

    point = [statistic(0, range(n)), statistic(1, range(n))]
    samples = np.array([[np.nan if (v := statistic(w, row)) is None else v for w in (0, 1)] for row in draws])
    alpha = (1 - confidence) / 2

    def interval(values) -> list[float | None]:
        values = values[~np.isnan(values)]
        return [float(np.quantile(values, alpha)), float(np.quantile(values, 1 - alpha))] if values.size else [None, None]

    difference = None if None in point else point[1] - point[0]
    low, high = interval(samples[:, 1] - samples[:, 0])
    better = (lambda d: d < 0) if direction == "lower" else (lambda d: d > 0)
    verdict = ("inconclusive" if low is None or difference is None or low <= 0 <= high else
               "improved" if better(difference) else "regressed")
    row = {"metric": name, "direction": direction, "unit": metric.unit, "items": n, "computed_by": metric.computed_by,
           "base": {"value": point[0], "interval": interval(samples[:, 0])},
           "trained": {"value": point[1], "interval": interval(samples[:, 1])},
           "difference": difference, "difference_interval": [low, high], "verdict": verdict,
           "test": f"paired percentile bootstrap ({BOOTSTRAP_RESAMPLES} resamples, {confidence:.0%})"}
    if metric.recompute.get("kind") == "mean" and not metric.recompute.get("weight"):
        key = metric.recompute["key"]
        differences = [b.values[key] - a.values[key] for a, b in pairs]
        if any(differences):
            row["p_value"] = float(wilcoxon(differences).pvalue)
            row["test"] += "; Wilcoxon signed-rank p on the per-item differences"
    return row
