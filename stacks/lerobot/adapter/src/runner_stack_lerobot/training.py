"""A LeRobot policy (ACT by default) made by lerobot's own factories (make_policy_config, make_policy,
make_pre_post_processors, the policy's optimizer preset) and trained by lerobot_train's own update_policy on
the recorded dataset, from a loop whose whole state is in each checkpoint: the policy as save_pretrained
writes it (config.json, model.safetensors), its processors (normalisation statistics) and the optimizer state.
Step s is one pass over the dataset in a permutation seeded by (plan seed, s), with torch's generator reseeded
from the same pair (dropout, the VAE's sampling), so a run resumed from checkpoint k replays steps k+1.. exactly."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch
from lerobot.datasets.factory import resolve_delta_timestamps
from lerobot.datasets.lerobot_dataset import LeRobotDataset, LeRobotDatasetMetadata
from lerobot.policies.factory import get_policy_class, make_policy, make_policy_config, make_pre_post_processors
from lerobot.utils.logging_utils import AverageMeter, MetricsTracker

from runner_contracts import COMPLETE_MARKER, STEPS_FILE, DomainPlan, DomainStep, JsonlWriter, sha256_file, write_atomic

from .data import REPO_ID, TRAIN_DIR

# A small ACT for two torques from ten numbers; any other field of the policy's config may be set in
# model.options, and `policy` names another lerobot policy type (diffusion, vqbet, ...).
DEFAULTS: dict[str, Any] = {"policy": "act", "chunk_size": 10, "n_action_steps": 1, "dim_model": 64, "n_heads": 4,
                            "dim_feedforward": 256, "n_encoder_layers": 2, "n_decoder_layers": 1,
                            "n_vae_encoder_layers": 2, "latent_dim": 16}


def policy_config(plan: DomainPlan):
    options = {**DEFAULTS, **plan.model.options}
    kind = options.pop("policy")
    if kind != DEFAULTS["policy"]:  # the other defaults are ACT's field names
        options = {k: v for k, v in options.items() if k in plan.model.options}
    try:
        return make_policy_config(kind, device="cpu", push_to_hub=False, optimizer_lr=plan.budget.learning_rate, **options)
    except (TypeError, ValueError) as error:
        raise ValueError(f"model.options: not a valid {kind!r} policy config: {error}") from None


def dataset(plan: DomainPlan, data_dir: Path) -> LeRobotDataset:
    """The training split as the policy reads it (action chunks of the policy's length)."""
    meta = LeRobotDatasetMetadata(REPO_ID, root=data_dir / TRAIN_DIR)
    return LeRobotDataset(REPO_ID, root=data_dir / TRAIN_DIR,
                          delta_timestamps=resolve_delta_timestamps(policy_config(plan), meta))


def save(folder: Path, policy, preprocessor, postprocessor, optimizer=None, step: int = 0) -> str:
    """A checkpoint folder; COMPLETE (step and weights' sha256) is written last."""
    folder.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(folder)
    preprocessor.save_pretrained(folder)
    postprocessor.save_pretrained(folder)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), folder / "optimizer.pt")
    digest = sha256_file(folder / "model.safetensors")
    write_atomic(folder / COMPLETE_MARKER, f"{step} {digest}\n".encode())
    return digest


def load(folder: Path):
    """(policy, preprocessor, postprocessor) of a checkpoint folder, as lerobot-eval loads a trained policy."""
    config = json.loads((folder / "config.json").read_text())
    policy = get_policy_class(config["type"]).from_pretrained(folder)
    preprocessor, postprocessor = make_pre_post_processors(policy.config, pretrained_path=str(folder))
    return policy, preprocessor, postprocessor


def train(plan: DomainPlan, data_dir: Path, out: Path, steps: int, resume_from: Path | None) -> dict[str, Any]:
    """Trains to `steps` passes over the dataset, a checkpoint after each; from `resume_from` if given. Writes the
    initial weights to out/initial (the base), one DomainStep per pass to steps.jsonl."""
    from accelerate import Accelerator
    from lerobot.scripts.lerobot_train import update_policy

    data = dataset(plan, data_dir)
    frames = [data[i] for i in range(len(data))]  # read once: LeRobotDataset's per-item reads cost 0.7 ms each
    if resume_from is not None:
        policy, preprocessor, postprocessor = load(resume_from)
        start = int((resume_from / COMPLETE_MARKER).read_text().split()[0])
    else:
        torch.manual_seed(plan.model.seed)
        config = policy_config(plan)
        policy = make_policy(config, ds_meta=data.meta)
        preprocessor, postprocessor = make_pre_post_processors(config, dataset_stats=data.meta.stats)
        save(out / "initial", policy, preprocessor, postprocessor)
        start = 0
    preset = policy.config.get_optimizer_preset()
    optimizer = preset.build(policy.get_optim_params())
    if resume_from is not None:
        optimizer.load_state_dict(torch.load(resume_from / "optimizer.pt"))
    accelerator = Accelerator(cpu=True)
    tracker = MetricsTracker(plan.budget.batch_size, data.num_frames, data.num_episodes,
                             {"loss": AverageMeter("loss"), "grad_norm": AverageMeter("grdn"), "lr": AverageMeter("lr"),
                              "update_s": AverageMeter("updt_s")}, initial_step=start, accelerator=accelerator)
    losses = []
    with JsonlWriter(out / STEPS_FILE) as writer:
        for step in range(start + 1, steps + 1):
            began = time.monotonic()
            seed = plan.model.seed * 1_000_003 + step
            order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed)).tolist()
            torch.manual_seed(seed)
            total = 0.0
            for batch in torch.utils.data.DataLoader([frames[i] for i in order], batch_size=plan.budget.batch_size):
                items = len(batch["index"])
                tracker, _ = update_policy(tracker, policy, preprocessor(batch), optimizer, preset.grad_clip_norm,
                                           accelerator)
                total += tracker.loss.val * items
            losses.append(total / len(data))
            save(out / "checkpoints" / f"checkpoint-{step}", policy, preprocessor, postprocessor, optimizer, step)
            writer.write(DomainStep(step=step, loss=losses[-1], items=len(data),
                                    order_sha256=hashlib.sha256(json.dumps(order).encode()).hexdigest(),
                                    metrics={"grad_norm": tracker.grad_norm.val},
                                    seconds=round(time.monotonic() - began, 3)))
            writer.flush()
    return {"loss": losses, "start_step": start, "frames": data.num_frames, "episodes": data.num_episodes,
            "policy": policy.name}
