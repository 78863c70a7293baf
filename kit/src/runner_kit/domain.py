"""What every domain stack's adapter does the same way (docs/domain-stacks.md): the jobs' dispatch, the data
recipe's option check, and scores written as predictions.jsonl + metrics.jsonl. A domain adapter supplies
its data recipe, its training driver and its native scoring; nothing here imports an upstream."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from runner_contracts import (
    DATA_MANIFEST,
    METRICS_FILE,
    PREDICTIONS_FILE,
    DataSplit,
    DomainData,
    DomainPlan,
    DomainPrediction,
    JsonlWriter,
    NativeMetric,
    StageRequest,
    StageResult,
    read_jsonl,
)

from .rollout import environment_info, reachability

MakeData = Callable[[DomainData, Path], list[DataSplit]]
Train = Callable[[DomainPlan, Path, Path, int, "Path | None"], dict[str, Any]]
# (stage, plan, data folder, splits by name, request options) -> one (predictions, metrics) per model scored
Score = Callable[[str, DomainPlan, Path, dict[str, DataSplit], dict[str, Any]],
                 Iterable[tuple[list[DomainPrediction], list[NativeMetric]]]]


def recipe_options(spec: DomainData, stack: str, generator: str, defaults: dict[str, Any]) -> dict[str, Any]:
    """The plan's data options over the recipe's defaults; a wrong generator or an unknown option is refused."""
    if spec.generator != generator:
        raise ValueError(f"data.generator: the {stack} stack makes {generator!r} data, not {spec.generator!r}")
    unknown = sorted(set(spec.options) - set(defaults))
    if unknown:
        raise ValueError(f"data.options: unknown {unknown}; known: {sorted(defaults)}")
    return {**defaults, **spec.options}


def run_job(request: StageRequest, *, upstream: str, capabilities: list[str], make_data: MakeData, train: Train,
            score: Score) -> StageResult:
    """probe, data, update/train (to request.steps, from request.resume_from) and service/evaluate (the
    scores of every model `score` yields)."""
    plan, stage, out = request.plan, request.stage, Path(request.out_dir)
    if not isinstance(plan, DomainPlan):
        raise ValueError(f"the {request.stack} stack runs domain plans (domain: {request.stack}), not "
                         "language-model plans")
    if stage == "probe":
        return StageResult(stage=stage, environment=environment_info(upstream), capabilities=capabilities,
                           metrics={"reach": reachability()})
    if stage == "data":
        splits = make_data(plan.data, out)
        return StageResult(stage=stage, metrics={s.split: s.sha256 for s in splits}, files={"manifest": DATA_MANIFEST})
    data_dir = Path(request.options["data_dir"])
    if stage in ("update", "train"):
        if request.steps is None:
            raise ValueError(f"a {stage} job needs steps")
        resume = Path(request.resume_from) if request.resume_from else None
        return StageResult(stage=stage, metrics=train(plan, data_dir, out, request.steps, resume))
    if stage not in ("service", "evaluate"):
        raise ValueError(f"the {request.stack} adapter has no {stage!r} job")
    splits = {s.split: s for s in read_jsonl(data_dir / DATA_MANIFEST, DataSplit)}
    with JsonlWriter(out / PREDICTIONS_FILE) as predictions, JsonlWriter(out / METRICS_FILE) as metrics:
        for items, scores in score(stage, plan, data_dir, splits, request.options):
            for item in items:
                predictions.write(item)
            for metric in scores:
                metrics.write(metric)
    return StageResult(stage=stage, files={"predictions": PREDICTIONS_FILE, "metrics": METRICS_FILE})
