"""The data job: small periodic binary alloys (fcc supercells, random occupation, strained and rattled) whose
energies and forces come from ASE's EMT calculator, written as extended XYZ per split and frozen by sha256.

Each structure also carries what the Matbench Discovery protocol needs: its formation energy per atom against
the pure elements (EMT, unrattled fcc), and its distance to the convex hull of the training split's formation
energies (with the pure elements at 0). The training split plays the known materials (Materials Project),
the held-out split the candidates (WBM): a model's predicted energy is placed against that same hull."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from ase import Atoms
from ase.build import bulk
from ase.calculators.emt import EMT
from ase.calculators.emt import parameters as EMT_ELEMENTS
from ase.data import atomic_numbers, reference_states
from ase.io import write

from runner_contracts import DATA_MANIFEST, DataSplit, DomainData, JsonlWriter, sha256_file
from runner_kit.domain import recipe_options

GENERATOR = "emt-fcc-alloys"
DEFAULTS = {"elements": ["Cu", "Au"], "supercell": [2, 1, 1], "rattle": 0.05, "strain": 0.01}


def options(spec: DomainData) -> dict:
    chosen = recipe_options(spec, "mace", GENERATOR, DEFAULTS)
    if len(chosen["elements"]) != 2 or any(e not in EMT_ELEMENTS for e in chosen["elements"]):
        raise ValueError(f"data.options.elements: two of EMT's elements {sorted(EMT_ELEMENTS)}, "
                         f"got {chosen['elements']}")
    return chosen


def _energy_per_atom(atoms: Atoms) -> float:
    atoms.calc = EMT()
    return atoms.get_potential_energy() / len(atoms)


def _lower_hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Andrew's monotone chain, lower half: the convex hull of formation energies against composition."""
    hull: list[tuple[float, float]] = []
    for p in sorted(set(points)):
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (p[1] - hull[-2][1])
                                  - (hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0])) <= 0:
            hull.pop()
        hull.append(p)
    return hull


def make(spec: DomainData, out: Path) -> list[DataSplit]:
    """Writes train.xyz and heldout.xyz and their manifest (data.jsonl) into `out`."""
    chosen = options(spec)
    a, b = chosen["elements"]
    rng = np.random.default_rng(spec.seed)
    lattice = {e: reference_states[atomic_numbers[e]]["a"] for e in (a, b)}
    mu = {e: _energy_per_atom(bulk(e, "fcc", a=lattice[e], cubic=True)) for e in (a, b)}
    structures = []
    for index in range(spec.train + spec.heldout):
        atoms = bulk(a, "fcc", a=lattice[a], cubic=True).repeat(chosen["supercell"])
        n = len(atoms)
        k = int(rng.integers(0, n + 1))
        symbols = np.array([b] * k + [a] * (n - k))[rng.permutation(n)]
        atoms.set_chemical_symbols(symbols.tolist())
        x = k / n
        scale = ((1 - x) * lattice[a] + x * lattice[b]) / lattice[a] * (1 + rng.uniform(-1, 1) * chosen["strain"])
        atoms.set_cell(atoms.cell * scale, scale_atoms=True)
        atoms.positions += rng.normal(0.0, chosen["rattle"], atoms.positions.shape)
        atoms.calc = EMT()
        energy, forces = float(atoms.get_potential_energy()), atoms.get_forces().copy()
        atoms.calc = None
        reference = (n - k) * mu[a] + k * mu[b]
        atoms.info = {"REF_energy": energy, "reference_energy": reference, "x": x,
                      "e_form_per_atom": (energy - reference) / n}
        atoms.arrays["REF_forces"] = forces
        structures.append(atoms)
    train, heldout = structures[:spec.train], structures[spec.train:]
    hull = _lower_hull([(0.0, 0.0), (1.0, 0.0)] + [(s.info["x"], s.info["e_form_per_atom"]) for s in train])
    xs, es = zip(*hull)
    splits = []
    out.mkdir(parents=True, exist_ok=True)
    for split, items in (("train", train), ("heldout", heldout)):
        for i, atoms in enumerate(items):
            atoms.info["item_id"] = f"{split}-{i:04d}"
            atoms.info["hull_e_form_per_atom"] = float(np.interp(atoms.info["x"], xs, es))
            atoms.info["e_above_hull"] = atoms.info["e_form_per_atom"] - atoms.info["hull_e_form_per_atom"]
        path = out / f"{split}.xyz"
        write(path, items, format="extxyz")
        stable = sum(s.info["e_above_hull"] <= 0 for s in items)
        splits.append(DataSplit(split=split, path=path.name, items=len(items), sha256=sha256_file(path),
                                generator=GENERATOR, detail=f"{a}-{b} fcc {chosen['supercell']} supercells of "
                                f"{len(items[0])} atoms, EMT energies and forces (synthetic); {stable} of {len(items)} "
                                f"on or below the training split's convex hull"))
    with JsonlWriter(out / DATA_MANIFEST) as writer:
        for split in splits:
            writer.write(split)
    return splits
