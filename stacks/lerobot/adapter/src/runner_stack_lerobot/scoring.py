"""Native evaluation: lerobot's own eval_policy (lerobot-eval's rollout loop, without its videos) rolls a policy
out in the simulator from the held-out seeds; its per-episode rows are the per-item values the host recomputes
the success rate and the mean return from."""

from __future__ import annotations

import math

import numpy as np
import torch
from lerobot.policies.act.configuration_act import ACTConfig
from lerobot.policies.pretrained import PreTrainedPolicy
from lerobot.processor import PolicyProcessorPipeline
from lerobot.processor.converters import policy_action_to_transition, transition_to_policy_action
from lerobot.scripts.lerobot_eval import eval_policy

from runner_contracts import DomainPrediction, NativeMetric

from . import task

OBS_STATE, OBS_ENVIRONMENT = "observation.state", "observation.environment_state"


class Scripted(PreTrainedPolicy):
    """A task.Policy (the expert, or no torque at all) as a lerobot policy, for the service stage's known cases."""

    config_class = ACTConfig
    name = "scripted"

    def __init__(self, act: task.Policy):
        super().__init__(ACTConfig(device="cpu", push_to_hub=False))
        self.act = act

    def select_action(self, batch, **_):
        return torch.from_numpy(self.act(batch[OBS_STATE].numpy(), batch[OBS_ENVIRONMENT].numpy()))

    def predict_action_chunk(self, batch, **_):
        return self.select_action(batch)[:, None]

    def forward(self, batch):
        raise NotImplementedError("a scripted policy is not trained")

    def get_optim_params(self):
        return []

    def reset(self):
        pass


def identity(actions: bool = False) -> PolicyProcessorPipeline:
    """A pipeline with no steps: for observations, or (actions=True) for a policy's action tensors."""
    if actions:
        return PolicyProcessorPipeline(steps=[], to_transition=policy_action_to_transition,
                                       to_output=transition_to_policy_action)
    return PolicyProcessorPipeline(steps=[])


def _envs(episodes: int) -> int:
    """The most environments up to 10 that divide the episodes (eval_policy would run and drop the rest)."""
    return max(n for n in range(1, min(10, episodes) + 1) if episodes % n == 0)


def score(policy, preprocessor, postprocessor, heldout: dict, label: str, data_sha256: str,
          expected: dict[str, float] | None = None) -> tuple[list[DomainPrediction], list[NativeMetric]]:
    env = task.vector_env(_envs(heldout["episodes"]), heldout["success_distance"])
    torch.manual_seed(0)  # a policy that samples at inference (ACT's prior is its mean; diffusion's noise is not)
    try:
        info = eval_policy(env, policy, identity(), identity(), preprocessor, postprocessor,
                           n_episodes=heldout["episodes"], start_seed=heldout["first_seed"])
    finally:
        env.close()
    predictions = [DomainPrediction(model=label, split="heldout", item_id=str(row["seed"]), values={
        "success": float(row["success"]), "sum_reward": float(row["sum_reward"]), "max_reward": float(row["max_reward"])})
        for row in info["per_episode"]]
    aggregated = info["aggregated"]
    common = dict(model=label, split="heldout", items=len(predictions), data_sha256=data_sha256, direction="higher")
    expected = expected or {}
    metrics = [
        NativeMetric(name="success_rate", value=aggregated["pc_success"] / 100,
                     computed_by="lerobot.scripts.lerobot_eval.eval_policy (aggregated pc_success / 100)",
                     recompute={"kind": "rate", "key": "success"}, expected=expected.get("success_rate"), **common),
        NativeMetric(name="mean_return", value=aggregated["avg_sum_reward"],
                     computed_by="lerobot.scripts.lerobot_eval.eval_policy (aggregated avg_sum_reward)",
                     recompute={"kind": "mean", "key": "sum_reward"}, expected=expected.get("mean_return"), **common),
    ]
    return predictions, metrics


def reference(act: task.Policy, heldout: dict) -> dict[str, float]:
    """What a scripted policy must score, from episodes run directly in the simulator (task.reference_rollouts)."""
    seeds = range(heldout["first_seed"], heldout["first_seed"] + heldout["episodes"])
    rows = task.reference_rollouts(act, seeds, heldout["success_distance"])
    return {"success_rate": float(np.mean([r["success"] for r in rows])),
            "mean_return": math.fsum(r["sum_reward"] for r in rows) / len(rows)}
