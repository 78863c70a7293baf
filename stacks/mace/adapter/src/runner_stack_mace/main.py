"""Entry point the host launches (`runner_stack_mace.main:run`): the jobs of a domain stack (docs/domain-stacks.md).

probe     the environment, as every stack's
data      the plan's data, made locally (data.py): data.jsonl + one file per split
service   the native scorers on known cases: the reference itself (perfect) and the reference with fixed
          offsets and flipped stability (broken), each with the values it must score
update, train   MACE trained for `steps` epochs from the plan's initial weights, or resumed from a checkpoint
evaluate  the base (initial weights) and the trained checkpoint scored natively on the held-out split
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import torch
from ase.io import read

from runner_contracts import (
    DATA_MANIFEST,
    METRICS_FILE,
    PREDICTIONS_FILE,
    DataSplit,
    DomainPlan,
    JsonlWriter,
    StageRequest,
    StageResult,
    read_jsonl,
)
from runner_kit.rollout import environment_info, reachability

from . import data, scoring, training

UPSTREAM = "mace-torch"
CAPABILITIES = ["domain:materials", "native-metric:energy-force-mae", "native-metric:matbench-discovery-stability",
                "resume:bit-identical", "cpu"]
ENERGY_OFFSET, FORCE_OFFSET = -0.1, 0.05  # the broken stand-in's errors: eV/atom, eV/A


def run(request: StageRequest) -> StageResult:
    plan = request.plan
    if not isinstance(plan, DomainPlan):
        raise ValueError("the mace stack runs domain plans (domain: mace), not language-model plans")
    torch.set_num_threads(max(1, int(plan.budget.cpus or os.cpu_count() or 1)))
    out = Path(request.out_dir)
    stage = request.stage
    if stage == "probe":
        return StageResult(stage=stage, environment=environment_info(UPSTREAM), capabilities=CAPABILITIES,
                           metrics={"reach": reachability()})
    if stage == "data":
        splits = data.make(plan.data, out)
        return StageResult(stage=stage, metrics={s.split: s.sha256 for s in splits}, files={"manifest": DATA_MANIFEST})
    data_dir = Path(request.options["data_dir"])
    splits = {s.split: s for s in read_jsonl(data_dir / DATA_MANIFEST, DataSplit)}
    if stage in ("update", "train"):
        assert request.steps is not None
        report = training.train(plan, data_dir, out, request.steps,
                                Path(request.resume_from) if request.resume_from else None)
        return StageResult(stage=stage, metrics=report)
    if stage == "service":
        return _service(plan, data_dir, splits["heldout"], out)
    if stage == "evaluate":
        models = {"base": Path(request.options["base_checkpoint"]), "trained": Path(request.options["trained_checkpoint"])}
        return _write_scores(stage, out, [(label, *training.load(folder)) for label, folder in models.items()],
                             data_dir, splits["heldout"])
    raise ValueError(f"the mace adapter has no {stage!r} job")


def _service(plan: DomainPlan, data_dir: Path, heldout: DataSplit, out: Path) -> StageResult:
    """Perfect scores 0 errors and a perfect classification. Broken (energies lowered by 0.1 eV/atom) scores
    exactly the offsets, and calls stable every item within 0.1 eV/atom of the hull: recall 1, and precision
    and accuracy as counted here from the true distances."""
    record = training.construction_record(plan, data_dir / "train.xyz")
    true = [float(atoms.info["e_above_hull"]) for atoms in read(data_dir / heldout.path, index=":")]
    stable, called = sum(e <= 0 for e in true), sum(e + ENERGY_OFFSET <= 0 for e in true)
    precision = stable / called
    expected = {"perfect": {"energy_mae_per_atom": 0.0, "force_mae": 0.0, "stability_f1": 1.0,
                            "stability_precision": 1.0, "stability_recall": 1.0, "stability_accuracy": 1.0},
                "broken": {"energy_mae_per_atom": abs(ENERGY_OFFSET), "force_mae": FORCE_OFFSET,
                           "stability_recall": 1.0, "stability_precision": precision,
                           "stability_accuracy": (len(true) - (called - stable)) / len(true),
                           "stability_f1": 2 * precision / (precision + 1)}}
    cases = [("perfect", scoring.StandIn(), record), ("broken", scoring.StandIn(ENERGY_OFFSET, FORCE_OFFSET), record)]
    return _write_scores("service", out, cases, data_dir, heldout, expected)


def _write_scores(stage: str, out: Path, models, data_dir: Path, split: DataSplit,
                  expected: dict[str, dict[str, float]] | None = None) -> StageResult:
    with JsonlWriter(out / PREDICTIONS_FILE) as predictions, JsonlWriter(out / METRICS_FILE) as metrics:
        for label, model, record in models:
            items, scores = scoring.score(model, data_dir / split.path, split.sha256, label, record["zs"],
                                          record["options"]["r_max"], training.loss_function(record))
            for item in items:
                predictions.write(item)
            for metric in scores:
                metrics.write(msgspec.structs.replace(metric, expected=(expected or {}).get(label, {}).get(metric.name)))
    return StageResult(stage=stage, files={"predictions": PREDICTIONS_FILE, "metrics": METRICS_FILE})
