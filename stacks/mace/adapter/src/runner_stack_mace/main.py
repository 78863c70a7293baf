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

from runner_contracts import DataSplit, DomainPlan, StageRequest, StageResult
from runner_kit.domain import run_job

from . import data, scoring, training

CAPABILITIES = ["domain:materials", "native-metric:energy-force-mae", "native-metric:matbench-discovery-stability",
                "resume:bit-identical", "cpu"]
ENERGY_OFFSET, FORCE_OFFSET = -0.1, 0.05  # the broken stand-in's errors: eV/atom, eV/A


def run(request: StageRequest) -> StageResult:
    torch.set_num_threads(max(1, int(getattr(request.plan.budget, "cpus", None) or os.cpu_count() or 1)))
    return run_job(request, upstream="mace-torch", capabilities=CAPABILITIES, make_data=data.make, train=training.train,
                   score=_score)


def _score(stage: str, plan: DomainPlan, data_dir: Path, splits: dict[str, DataSplit], options):
    heldout = splits["heldout"]
    if stage == "service":
        record = training.construction_record(plan, data_dir / "train.xyz")
        cases = [("perfect", scoring.StandIn(), record),
                 ("broken", scoring.StandIn(ENERGY_OFFSET, FORCE_OFFSET), record)]
        expected = _expected(data_dir / heldout.path)
    else:
        cases = [(label, *training.load(Path(options[option])))
                 for label, option in (("base", "base_checkpoint"), ("trained", "trained_checkpoint"))]
        expected = {}
    for label, model, record in cases:
        items, metrics = scoring.score(model, data_dir / heldout.path, heldout.sha256, label, record["zs"],
                                       record["options"]["r_max"], training.loss_function(record))
        yield items, [msgspec.structs.replace(m, expected=expected.get(label, {}).get(m.name)) for m in metrics]


def _expected(heldout: Path) -> dict[str, dict[str, float]]:
    """Perfect scores 0 errors and a perfect classification. Broken (energies lowered by 0.1 eV/atom) scores
    exactly the offsets, and calls stable every item within 0.1 eV/atom of the hull: recall 1, and precision
    and accuracy as counted here from the true distances."""
    true = [float(atoms.info["e_above_hull"]) for atoms in read(heldout, index=":")]
    stable, called = sum(e <= 0 for e in true), sum(e + ENERGY_OFFSET <= 0 for e in true)
    precision = stable / called
    return {"perfect": {"energy_mae_per_atom": 0.0, "force_mae": 0.0, "stability_f1": 1.0,
                        "stability_precision": 1.0, "stability_recall": 1.0, "stability_accuracy": 1.0},
            "broken": {"energy_mae_per_atom": abs(ENERGY_OFFSET), "force_mae": FORCE_OFFSET,
                       "stability_recall": 1.0, "stability_precision": precision,
                       "stability_accuracy": (len(true) - (called - stable)) / len(true),
                       "stability_f1": 2 * precision / (precision + 1)}}
