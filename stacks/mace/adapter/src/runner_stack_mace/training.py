"""MACE's own model (ScaleShiftMACE), loss (WeightedEnergyForcesLoss), data pipeline (AtomicData, its
DataLoader) and evaluation (mace.tools.train.evaluate), driven by a loop whose whole state is in each
checkpoint: weights (model.safetensors), optimizer state, the model's construction record (model.json).
The data order of step s is a permutation seeded by (plan seed, s), so a run resumed from checkpoint k
replays steps k+1.. exactly as an uninterrupted run does."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ase.io import read
from e3nn import o3
from mace import data as mace_data
from mace import modules, tools
from mace.tools.torch_geometric.dataloader import DataLoader
from safetensors.torch import load_file, save_file

from runner_contracts import COMPLETE_MARKER, STEPS_FILE, DomainPlan, DomainStep, JsonlWriter, sha256_file, write_atomic

DEFAULTS = {"r_max": 4.5, "num_channels": 16, "max_L": 0, "num_interactions": 2, "correlation": 2,
            "num_bessel": 8, "num_polynomial_cutoff": 5, "max_ell": 2, "energy_weight": 1.0, "forces_weight": 10.0}
KEYS = mace_data.KeySpecification(info_keys={"energy": "REF_energy"}, arrays_keys={"forces": "REF_forces"})
torch.set_default_dtype(torch.float64)


def model_options(plan: DomainPlan) -> dict[str, Any]:
    unknown = sorted(set(plan.model.options) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"model.options: unknown {unknown}; known: {sorted(DEFAULTS)}")
    return {**DEFAULTS, **plan.model.options}


def load_split(path: Path, r_max: float, z_table=None):
    """(atoms, configurations, AtomicData list, atomic number table) of one split file."""
    atoms = read(path, index=":", format="extxyz")
    configs = mace_data.config_from_atoms_list(atoms, key_specification=KEYS)
    z_table = z_table or tools.get_atomic_number_table_from_zs(sorted({int(z) for c in configs for z in c.atomic_numbers}))
    return atoms, configs, [mace_data.AtomicData.from_config(c, z_table=z_table, cutoff=r_max) for c in configs], z_table


def loss_function(record: dict[str, Any]) -> torch.nn.Module:
    return modules.WeightedEnergyForcesLoss(energy_weight=record["options"]["energy_weight"],
                                            forces_weight=record["options"]["forces_weight"])


def build(record: dict[str, Any]) -> torch.nn.Module:
    """The model a construction record describes (weights as initialised by the current torch seed)."""
    o = record["options"]
    interaction = modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
    return modules.ScaleShiftMACE(
        r_max=o["r_max"], num_bessel=o["num_bessel"], num_polynomial_cutoff=o["num_polynomial_cutoff"],
        max_ell=o["max_ell"], interaction_cls=interaction, interaction_cls_first=interaction,
        num_interactions=o["num_interactions"], num_elements=len(record["zs"]),
        hidden_irreps=o3.Irreps(f"{o['num_channels']}x0e" + (f" + {o['num_channels']}x1o" if o["max_L"] >= 1 else "")),
        MLP_irreps=o3.Irreps("16x0e"), gate=torch.nn.functional.silu,
        atomic_energies=np.array(record["atomic_energies"]), avg_num_neighbors=record["avg_num_neighbors"],
        atomic_numbers=record["zs"], correlation=o["correlation"], radial_type="bessel",
        atomic_inter_scale=record["scale"], atomic_inter_shift=record["shift"])


def construction_record(plan: DomainPlan, train_path: Path) -> dict[str, Any]:
    """What build() needs, from the training split: E0s by least squares, neighbour count, energy scale."""
    options = model_options(plan)
    _, configs, dataset, z_table = load_split(train_path, options["r_max"])
    e0s = mace_data.compute_average_E0s(configs, z_table)
    energies = np.array([e0s[z] for z in z_table.zs])
    loader = DataLoader(dataset, batch_size=len(dataset), shuffle=False)
    shift, scale = modules.compute_mean_std_atomic_inter_energy(loader, energies)
    return {"options": options, "zs": [int(z) for z in z_table.zs], "atomic_energies": energies.tolist(),
            "avg_num_neighbors": float(modules.compute_avg_num_neighbors(loader)), "shift": float(shift),
            "scale": float(scale), "seed": plan.model.seed}


def save(folder: Path, model: torch.nn.Module, record: dict[str, Any], optimizer=None, step: int = 0) -> str:
    """A checkpoint folder; COMPLETE (step and weights' sha256) is written last."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    write_atomic(folder / "model.json", json.dumps(record, sort_keys=True).encode())
    if optimizer is not None:
        torch.save(optimizer.state_dict(), folder / "optimizer.pt")
    digest = sha256_file(folder / "model.safetensors")
    write_atomic(folder / COMPLETE_MARKER, f"{step} {digest}\n".encode())
    return digest


def load(folder: Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    record = json.loads((folder / "model.json").read_text())
    model = build(record)
    model.load_state_dict(load_file(str(folder / "model.safetensors")))
    return model, record


def initial_model(plan: DomainPlan, train_path: Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    record = construction_record(plan, train_path)
    torch.manual_seed(plan.model.seed)
    return build(record), record


def train(plan: DomainPlan, data_dir: Path, out: Path, steps: int, resume_from: Path | None) -> dict[str, Any]:
    """Trains to `steps` epochs, a checkpoint after each; from `resume_from` if given. Writes the initial
    weights to out/initial (the base), one DomainStep per epoch to steps.jsonl."""
    if resume_from is not None:
        model, record = load(resume_from)
        start = int((resume_from / COMPLETE_MARKER).read_text().split()[0])
    else:
        model, record = initial_model(plan, data_dir / "train.xyz")
        save(out / "initial", model, record)
        start = 0
    _, _, dataset, _ = load_split(data_dir / "train.xyz", record["options"]["r_max"],
                               tools.AtomicNumberTable(record["zs"]))
    optimizer = torch.optim.Adam(model.parameters(), lr=plan.budget.learning_rate, amsgrad=True)
    if resume_from is not None:
        optimizer.load_state_dict(torch.load(resume_from / "optimizer.pt"))
    loss_fn = loss_function(record)
    losses = []
    with JsonlWriter(out / STEPS_FILE) as writer:
        for step in range(start + 1, steps + 1):
            began = time.monotonic()
            order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(
                plan.model.seed * 1_000_003 + step)).tolist()
            batches = DataLoader([dataset[i] for i in order], batch_size=plan.budget.batch_size, shuffle=False)
            model.train()
            total = 0.0
            for batch in batches:
                optimizer.zero_grad()
                output = model(batch.to_dict(), training=True, compute_force=True)
                loss = loss_fn(pred=output, ref=batch)
                loss.backward()
                optimizer.step()
                total += float(loss.detach()) * batch.num_graphs
            losses.append(total / len(dataset))
            save(out / "checkpoints" / f"checkpoint-{step}", model, record, optimizer, step)
            writer.write(DomainStep(step=step, loss=losses[-1], items=len(dataset),
                                    order_sha256=hashlib.sha256(json.dumps(order).encode()).hexdigest(),
                                    seconds=round(time.monotonic() - began, 3)))
            writer.flush()
    return {"loss": losses, "start_step": start}
