"""Native scoring: MACE's evaluate() for energy and force errors, and Matbench Discovery's stable_metrics()
for the stability classification, on one split; plus the per-item values the host recomputes them from.

matbench_discovery/__init__.py imports plotly, matplotlib and pymatviz and creates folders inside its own
install directory, so its metrics module is loaded from the installed file under a stand-in parent module
that holds the one constant it imports (STABILITY_THRESHOLD = 0, as upstream's). Recorded as a deviation."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import sys
import types
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from mace import tools
from mace.tools.torch_geometric.dataloader import DataLoader
from mace.tools.train import evaluate

from runner_contracts import DomainPrediction, NativeMetric

from .training import load_split

STABILITY = ("F1", "Precision", "Recall", "Accuracy")
OUTPUTS = {"energy": True, "forces": True, "virials": False, "stress": False, "dipoles": False}


def matbench_metrics():
    """matbench_discovery.metrics, executed from its installed file."""
    if "matbench_discovery.metrics" not in sys.modules:
        files = importlib.metadata.distribution("matbench-discovery").locate_file("matbench_discovery")
        parent = types.ModuleType("matbench_discovery")
        parent.__path__ = [str(files)]
        parent.STABILITY_THRESHOLD = 0
        sys.modules["matbench_discovery"] = parent
        spec = importlib.util.spec_from_file_location("matbench_discovery.metrics", Path(str(files)) / "metrics.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["matbench_discovery.metrics"]


class StandIn(torch.nn.Module):
    """The service stage's stand-in models: the reference itself (perfect), or the reference with every energy
    shifted by `energy_offset` eV/atom and every force component by `force_offset` eV/A (broken): its
    distance to the hull is then the true one plus the energy offset."""

    def __init__(self, energy_offset: float = 0.0, force_offset: float = 0.0):
        super().__init__()
        self.energy_offset, self.force_offset = energy_offset, force_offset

    def forward(self, data, training=False, compute_force=True, **_):
        atoms = data["ptr"][1:] - data["ptr"][:-1]
        return {"energy": data["energy"] + self.energy_offset * atoms, "forces": data["forces"] + self.force_offset}


def _defined(value) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


def score(model: torch.nn.Module, split_path: Path, data_sha256: str, label: str, record_zs: list[int],
          r_max: float, loss_fn: torch.nn.Module) -> tuple[list[DomainPrediction], list[NativeMetric]]:
    """Per-item predictions and native metrics of `model` on a split. A classification metric upstream cannot
    compute (stable_metrics divides by zero when no item is predicted stable, or none correctly) is None."""
    atoms, _, dataset, _ = load_split(split_path, r_max, tools.AtomicNumberTable(record_zs))
    split = split_path.stem
    model.eval()
    loader = DataLoader(dataset, batch_size=16, shuffle=False)
    _, native = evaluate(model, loss_fn, loader, OUTPUTS, torch.device("cpu"))
    energies, forces_per_item = [], []  # the same batches again, split per structure
    for batch in loader:
        output = model(batch.to_dict(), training=False, compute_force=True)
        energies += output["energy"].detach().tolist()
        forces_per_item += np.split(output["forces"].detach().numpy(), batch.ptr[1:-1].tolist())
    predictions, true_hull, pred_hull = [], [], []
    for structure, energy, forces in zip(atoms, energies, forces_per_item):
        n = len(structure)
        e_form = (energy - structure.info["reference_energy"]) / n
        predicted = e_form - structure.info["hull_e_form_per_atom"]
        true_hull.append(structure.info["e_above_hull"])
        pred_hull.append(predicted)
        predictions.append(DomainPrediction(model=label, split=split, item_id=str(structure.info["item_id"]), values={
            "energy_abs_error_per_atom": float(abs(energy - structure.info["REF_energy"]) / n),
            "force_mae": float(np.abs(forces - structure.arrays["REF_forces"]).mean()),
            "force_components": float(forces.size),
            "e_above_hull_true": float(structure.info["e_above_hull"]), "e_above_hull_pred": float(predicted)}))
    common = dict(model=label, split=split, items=len(predictions), data_sha256=data_sha256)
    metrics = [
        NativeMetric(name="energy_mae_per_atom", value=float(native["mae_e_per_atom"]), direction="lower", unit="eV/atom",
                     computed_by="mace.tools.train.evaluate (mae_e_per_atom)",
                     recompute={"kind": "mean", "key": "energy_abs_error_per_atom"}, **common),
        NativeMetric(name="force_mae", value=float(native["mae_f"]), direction="lower", unit="eV/A",
                     computed_by="mace.tools.train.evaluate (mae_f)",
                     recompute={"kind": "mean", "key": "force_mae", "weight": "force_components"}, **common),
    ]
    try:
        stable = matbench_metrics().stable_metrics(pd.Series(true_hull), pd.Series(pred_hull), stability_threshold=0)
    except ZeroDivisionError:
        stable = {}
    metrics += [NativeMetric(name=f"stability_{name.lower()}", value=_defined(stable.get(name)), direction="higher",
                             computed_by=f"matbench_discovery.metrics.stable_metrics ({name})",
                             recompute={"kind": "stability", "metric": name, "true": "e_above_hull_true",
                                        "pred": "e_above_hull_pred", "threshold": 0.0}, **common)
                for name in STABILITY]
    return predictions, metrics
