"""The GPU update path of the lightning-verl arm: verl's GRPO trainer driven through Agent Lightning.

`VerlLaunch` is the typed record of one launch, built from the frozen plan and a GPU profile; `overrides()`
renders it as Hydra overrides of Agent Lightning's verl config (agentlightning/verl/config.yaml, which
extends verl's ppo_trainer), and `command()` as the process the adapter starts on a GPU node (verl_stage).
`main()` is that process: it composes the config, starts Ray on 127.0.0.1 with a worker setup hook that
installs the evidence-writing trainer (verl_evidence), builds the in-memory datasets from the plan's task
split and calls agentlightning.verl.run_ppo. Rendering is stdlib-only, so the launch line is golden-tested
anywhere; running it needs GPUs and the stack's GPU lock (torch, vLLM).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

MODULE = "runner_stack_lightning_verl.verl_launch"
KEY_VARIABLE = "RUNNER_AGL_KEY"  # the gateway's bearer key reaches the config from the environment, not argv
SETUP_HOOK = "runner_stack_lightning_verl.verl_evidence.setup_worker"


def hydra_string(value: str) -> str:
    """A Hydra override value that stays one string whatever characters it holds."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


@dataclass(frozen=True)
class GpuProfile:
    """What the cluster gives one arm."""

    gpus_per_node: int = 1
    nnodes: int = 1
    rollout_engine: str = "vllm"
    tensor_parallel: int = 1
    gpu_memory_utilization: float = 0.5


@dataclass(frozen=True)
class Evidence:
    """Where the evidence-writing trainer puts the stage's files, and what it names them."""

    out_dir: str
    run_id: str
    stack: str
    stage: str
    initial_revision: str  # sha256 of the weights step 1 samples with


@dataclass(frozen=True)
class VerlLaunch:
    model_path: str
    prompts_per_step: int
    generations_per_prompt: int
    max_prompt_length: int
    max_response_length: int
    learning_rate: float
    steps: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    agl_base_url: str
    checkpoint_dir: str
    experiment: str
    evidence: Evidence
    resume_from: str | None = None  # a verl global_step_N folder
    profile: GpuProfile = field(default_factory=GpuProfile)

    @classmethod
    def from_plan(cls, plan: dict[str, Any], *, model_path: str, agl_base_url: str, checkpoint_dir: str,
                  profile: GpuProfile, evidence: Evidence, steps: int | None = None, resume_from: str | None = None,
                  max_prompt_length: int = 1024) -> VerlLaunch:
        """The plan's budget and sampling as verl sees them (`plan` is the frozen plan as JSON)."""
        budget, sampling = plan["budget"], plan["sampling"]
        return cls(
            model_path=model_path, prompts_per_step=budget["prompts_per_step"],
            generations_per_prompt=budget["generations_per_prompt"], max_prompt_length=max_prompt_length,
            max_response_length=sampling["max_new_tokens"] * budget["max_turns"],
            learning_rate=budget["learning_rate"], steps=steps or budget["steps"], temperature=sampling["temperature"],
            top_p=sampling["top_p"], top_k=sampling["top_k"], seed=sampling["seed"], agl_base_url=agl_base_url,
            checkpoint_dir=checkpoint_dir, experiment=f"{plan['name']}-{plan['plan_id'][:12]}", evidence=evidence,
            resume_from=resume_from, profile=profile)

    def overrides(self) -> list[str]:
        """Hydra overrides, one concern per line group; every key exists in verl 0.9.1's ppo_trainer."""
        batch = self.prompts_per_step
        return [
            "algorithm.adv_estimator=grpo",
            "algorithm.use_kl_in_reward=false",
            f"data.train_batch_size={batch}",
            f"data.max_prompt_length={self.max_prompt_length}",
            f"data.max_response_length={self.max_response_length}",
            f"data.seed={self.seed}",
            f"actor_rollout_ref.model.path={self.model_path}",
            f"actor_rollout_ref.actor.optim.lr={self.learning_rate!r}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.actor.use_kl_loss=false",
            "actor_rollout_ref.actor.entropy_coeff=0",
            "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
            f"actor_rollout_ref.rollout.name={self.profile.rollout_engine}",
            f"actor_rollout_ref.rollout.n={self.generations_per_prompt}",
            f"actor_rollout_ref.rollout.temperature={self.temperature!r}",
            f"actor_rollout_ref.rollout.top_p={self.top_p!r}",
            f"actor_rollout_ref.rollout.top_k={self.top_k if self.top_k > 0 else -1}",  # verl: -1 = off
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={self.profile.tensor_parallel}",
            f"actor_rollout_ref.rollout.gpu_memory_utilization={self.profile.gpu_memory_utilization!r}",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
            f"agentlightning.agl_base_url={self.agl_base_url}",
            f"agentlightning.agl_key=${{oc.env:{KEY_VARIABLE}}}",
            f"trainer.n_gpus_per_node={self.profile.gpus_per_node}",
            f"trainer.nnodes={self.profile.nnodes}",
            f"trainer.total_training_steps={self.steps}",
            "trainer.save_freq=1",
            f"trainer.default_local_dir={self.checkpoint_dir}",
            "trainer.logger=[console]",
            "trainer.project_name=runner",
            f"trainer.experiment_name={self.experiment}",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            *(["trainer.resume_mode=resume_path", f"trainer.resume_from_path={self.resume_from}"]
              if self.resume_from else ["trainer.resume_mode=disable"]),
            f"+runner.out_dir={hydra_string(self.evidence.out_dir)}",
            f"+runner.run_id={hydra_string(self.evidence.run_id)}",
            f"+runner.stack={hydra_string(self.evidence.stack)}",
            f"+runner.stage={hydra_string(self.evidence.stage)}",
            f"+runner.initial_revision={hydra_string(self.evidence.initial_revision)}",
        ]

    def command(self, python: str = "python3", plan_path: str = "plan.json") -> list[str]:
        return [python, "-m", MODULE, "--plan", plan_path, *self.overrides()]


def compose(overrides: list[str]):
    """Agent Lightning's verl config with the overrides applied (raises on a key verl does not have)."""
    import importlib.util
    from pathlib import Path

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    # Both config folders are found without importing the packages (verl's __init__ needs torch); the
    # config's own `pkg://verl/trainer/config` search path would import verl, so it is given as a file path.
    agl = Path(importlib.util.find_spec("agentlightning").origin).parent / "verl"
    verl = Path(importlib.util.find_spec("verl").origin).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(agl), version_base=None):
        return hydra_compose(config_name="config", overrides=[f"hydra.searchpath=[file://{verl}]", *overrides])


def _ray_temp_dir() -> str:
    """Ray's session folder: RAY_TMPDIR, else the job's TMPDIR (the only writable place in a container) when
    short enough for the AF_UNIX sockets Ray makes under it (107 bytes with ~60 of Ray's own), else /tmp/ray."""
    if os.environ.get("RAY_TMPDIR"):
        return os.environ["RAY_TMPDIR"]
    scratch = os.path.join(os.environ.get("TMPDIR", "/tmp"), "ray")
    return scratch if len(scratch) <= 45 else "/tmp/ray"


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] != "--plan":
        raise SystemExit(f"usage: python -m {MODULE} --plan PLAN_JSON [hydra overrides...]")
    with open(args[1]) as handle:
        plan = json.load(handle)
    config = compose(args[2:])
    import ray
    from agentlightning.verl.entrypoint import run_ppo
    from verl.trainer.main_ppo import get_ppo_ray_runtime_env

    # run_ppo starts Ray itself unless it is running; started here, it stays on loopback and its workers run
    # our setup hook (which also registers Agent Lightning's loss, as run_ppo's default hook would).
    runtime_env = {**get_ppo_ray_runtime_env(), "worker_process_setup_hook": SETUP_HOOK}
    ray.init(runtime_env=runtime_env, _node_ip_address="127.0.0.1", include_dashboard=False,
             num_gpus=config.trainer.n_gpus_per_node, _temp_dir=_ray_temp_dir())

    from qualification.tasks import get_family

    def rows(label: str) -> list[dict[str, Any]]:
        spec = plan["task"][label]
        family = get_family(spec.get("family") or plan["task"]["family"])
        return [{"item": item.to_json(), "task_id": item.task_id, "family": family.name, "question": item.question}
                for item in family.generate(spec["split"], spec["n"], spec["seed"])]

    run_ppo(config, rows("train"), rows("heldout"))


if __name__ == "__main__":
    main()
