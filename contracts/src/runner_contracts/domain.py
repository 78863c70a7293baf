"""Domain contract v1: what a domain stack (kind "domain": MACE, LeRobot) is asked and writes. Its evidence is not
token trajectories but a native training and evaluation protocol: data splits frozen by content hash, one
DomainStep per training step, checkpoints with the completeness marker (model.safetensors + COMPLETE, as
every stack's), per-item predictions and the native metrics computed from them by the stack's own code. The
host recomputes every metric from the per-item values and never takes the adapter's word for one."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from .records import NonNegInt, Record, Sha256

DATA_MANIFEST = "data.jsonl"  # DataSplit records, in the data job's folder beside the splits
STEPS_FILE = "steps.jsonl"  # a training job's DomainStep records
PREDICTIONS_FILE = "predictions.jsonl"  # an evaluation's (or a service case's) DomainPrediction records
METRICS_FILE = "metrics.jsonl"  # the NativeMetric records computed from them by the stack's own code

# How the host recomputes a metric from the per-item values (NativeMetric.recompute):
#   mean: the mean of values[key];  rate: the mean of values[key] in {0, 1} (a success rate);
#   stability: Matbench Discovery's classification metric `metric` (F1, Precision, Recall, Accuracy) of
#   values[true] against values[pred] (energies above the convex hull, eV/atom), stable at <= `threshold`.
Recompute = dict[str, Any]


class DomainData(Record, kw_only=True):
    """The data a domain stack makes locally (nothing is downloaded): `generator` is the stack's recipe
    (mace: emt-fcc-alloys), `options` its parameters; `train` and `heldout` items from `seed`."""

    generator: str
    train: Annotated[int, msgspec.Meta(ge=2)]
    heldout: Annotated[int, msgspec.Meta(ge=2)]
    seed: int = 0
    options: dict[str, Any] = msgspec.field(default_factory=dict)


class DomainModel(Record, kw_only=True, omit_defaults=True):
    """The model the stack trains: its hyperparameters (`options`, the stack's own names) and the seed of its
    initial weights, which are the base the trained model is compared with."""

    seed: int = 0
    options: dict[str, Any] = msgspec.field(default_factory=dict)


class DomainBudget(Record, kw_only=True):
    """`steps`: training epochs (a checkpoint after each); the other fields as in a language-model plan."""

    steps: Annotated[int, msgspec.Meta(ge=1)]
    batch_size: Annotated[int, msgspec.Meta(ge=1)] = 8
    learning_rate: Annotated[float, msgspec.Meta(gt=0)] = 1e-2
    wall_clock_s: Annotated[float, msgspec.Meta(gt=0)] = 1800.0
    gpus: NonNegInt = 0
    cpus: Annotated[float, msgspec.Meta(gt=0)] | None = None
    memory_gb: Annotated[float, msgspec.Meta(gt=0)] | None = None


class DomainGates(Record, kw_only=True):
    update_steps: Annotated[int, msgspec.Meta(ge=1)] = 1
    resume_kill_after_step: Annotated[int, msgspec.Meta(ge=1)] = 1
    resume_steps: Annotated[int, msgspec.Meta(ge=2)] = 2
    confidence: Annotated[float, msgspec.Meta(gt=0, lt=1)] = 0.95
    metric_tolerance: Annotated[float, msgspec.Meta(ge=0)] = 1e-6  # native vs host-recomputed metric, absolute


class DomainPlan(Record, kw_only=True, tag_field="contract", tag="domain-plan"):
    """A frozen plan for one domain stack (`domain` names it): data, model, budget, gates, seeds."""

    version: int = 1
    name: str
    domain: str
    data: DomainData
    model: DomainModel = msgspec.field(default_factory=DomainModel)
    budget: DomainBudget
    gates: DomainGates = msgspec.field(default_factory=DomainGates)
    headline: str  # the metric the verdict is read on, e.g. energy_mae_per_atom
    seeds: list[int] = msgspec.field(default_factory=lambda: [0])
    plan_id: Sha256 | None = None


class DataSplit(Record, kw_only=True):
    """One split the data job wrote (`path` relative to its folder): a file, or a folder holding a dataset in its
    upstream's layout (a LeRobot dataset), with its sha256 as runner_contracts.sha256_path computes it."""

    contract: Literal["data-split"] = "data-split"
    version: int = 1
    split: str
    path: str
    items: Annotated[int, msgspec.Meta(ge=1)]
    sha256: Sha256
    generator: str
    synthetic: bool = True
    detail: str = ""


class DomainStep(Record, kw_only=True):
    """One training step (epoch) as the trainer logged it: its mean loss over the step's batches, the order it
    saw the training items in (sha256 of their ids, so a resumed run is checked to replay the same order)."""

    contract: Literal["domain-step"] = "domain-step"
    version: int = 1
    step: Annotated[int, msgspec.Meta(ge=1)]
    loss: float
    items: NonNegInt
    order_sha256: Sha256
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    seconds: float = 0.0


ModelLabel = Literal["base", "trained", "perfect", "broken"]


class DomainPrediction(Record, kw_only=True):
    """One held-out item scored for one model (a service case's stand-in model: perfect or broken): the per-item
    values the native metrics are means or counts of."""

    contract: Literal["domain-prediction"] = "domain-prediction"
    version: int = 1
    model: ModelLabel
    split: str
    item_id: str
    values: dict[str, float]


class NativeMetric(Record, kw_only=True):
    """A metric as the stack's own code computed it (`computed_by` names the function), with how the host
    recomputes it from the same DomainPrediction records (`recompute`), its direction, and the sha256 of the
    split it was computed on. `expected`: for a service case, the value the case must score."""

    contract: Literal["native-metric"] = "native-metric"
    version: int = 1
    model: ModelLabel
    split: str
    name: str
    value: float | None  # None: undefined on this split (an F1 with nothing predicted stable)
    items: NonNegInt
    direction: Literal["lower", "higher"]
    computed_by: str
    recompute: Recompute
    data_sha256: Sha256
    expected: float | None = None
    unit: str = ""  # eV/atom, eV/A; empty for a ratio


DOMAIN_RECORD_TYPES: dict[str, type[Record]] = {
    "domain-plan": DomainPlan, "data-split": DataSplit, "domain-step": DomainStep,
    "domain-prediction": DomainPrediction, "native-metric": NativeMetric,
}
