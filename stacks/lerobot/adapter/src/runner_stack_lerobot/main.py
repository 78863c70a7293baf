"""Entry point the host launches (`runner_stack_lerobot.main:run`): the jobs of a domain stack (docs/domain-stacks.md).

probe     the environment, as every stack's
data      the scripted expert's episodes as a LeRobot dataset, and the held-out simulator seeds (data.py)
service   lerobot's eval_policy on known cases: the expert itself (perfect) and a policy that applies no torque
          (broken), each with the success rate and mean return its episodes score when run directly
update, train   a LeRobot policy trained for `steps` passes over the dataset, or resumed from a checkpoint
evaluate  the base (initial weights) and the trained checkpoint rolled out on the held-out seeds
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local dataset and local checkpoints: nothing is fetched
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from runner_contracts import StageRequest, StageResult  # noqa: E402
from runner_kit.domain import run_job  # noqa: E402

from . import data, scoring, task, training  # noqa: E402

CAPABILITIES = ["domain:robotics", "native-metric:success-rate", "native-metric:mean-return",
                "simulator:mujoco", "resume:bit-identical", "cpu"]


def run(request: StageRequest) -> StageResult:
    torch.set_num_threads(max(1, int(getattr(request.plan.budget, "cpus", None) or os.cpu_count() or 1)))
    return run_job(request, upstream="lerobot", capabilities=CAPABILITIES, make_data=data.make, train=training.train,
                   score=_score)


def _score(stage: str, plan, data_dir: Path, splits, options):
    episodes, sha256 = data.heldout(data_dir), splits["heldout"].sha256
    if stage == "service":
        for label, act in (("perfect", task.expert), ("broken", task.idle)):
            yield scoring.score(scoring.Scripted(act), scoring.identity(), scoring.identity(actions=True), episodes,
                                label, sha256, scoring.reference(act, episodes))
    else:
        for label, option in (("base", "base_checkpoint"), ("trained", "trained_checkpoint")):
            yield scoring.score(*training.load(Path(options[option])), episodes, label, sha256)
