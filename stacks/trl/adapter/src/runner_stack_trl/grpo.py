"""GRPO through TRL's own multi-turn tool loop, with the evidence the host audits.

CapturingGRPOTrainer changes nothing about how TRL samples or trains. It records:
- the per-token logprobs of the sampling distribution, read from generate()'s scores at sampling time
  (TRL's transformers path keeps none);
- after each generation batch, one trajectory per rollout (prompt / policy / tool segments from TRL's
  own completion ids and tool mask) and one training row (the ids, loss mask and advantage the
  optimizer consumes), plus the trainer's recomputed logprobs with the sampling weights.
"""

from __future__ import annotations

import copy
import inspect
import json
import time
from pathlib import Path
from typing import Any

from qualification.tasks import get_family
from runner_contracts import (
    JsonlWriter,
    Plan,
    SamplingSpec,
    Segment,
    TrainingRow,
    Trajectory,
    sha256_file,
)
from runner_kit.continuity import mask_runs
from runner_kit.processes import freeze_heap

from .chat_formats import with_response_parser
from .checkpoints import completion_marker
from .environment import environment_class
from .policy import deterministic_torch, prompt_messages, trainer_device_args


def task_rows(family_name: str, split: str, n: int, seed: int) -> list[dict[str, Any]]:
    family = get_family(family_name)
    return [
        {"prompt": prompt_messages(item), "item": item.to_json(), "environment": family_name}
        for item in family.generate(split, n, seed)
    ]


def final_text(completion: list[dict[str, Any]]) -> str:
    """Content of the last assistant message of a TRL completion (a list of messages)."""
    for message in reversed(completion):
        if message.get("role") == "assistant":
            return message.get("content") or ""
    return ""


class TaskReward:
    """Reward function handed to GRPOTrainer: the family's reference scorer on each episode."""

    __name__ = "task_score"

    def __init__(self) -> None:
        self.last: list[tuple[Any, Any]] = []

    def __call__(self, completions, environments, **kwargs) -> list[float]:
        self.last = []
        for completion, env in zip(completions, environments, strict=True):
            transcript = env._transcript(final_text(completion))
            self.last.append((env.family.score(env.item, transcript), transcript))
        return [score.reward for score, _ in self.last]


class Recorder:
    """Writes trajectories.jsonl and training.jsonl for every training batch."""

    def __init__(self, out_dir: Path, *, run_id: str, stack: str, stage: str, initial_revision: str,
                 checkpoint_dir: Path, resume_from: str | None = None, non_policy_source: str = "tool"):
        self.non_policy_source = non_policy_source  # tool: TRL's own tool loop; env: an environment stack's text
        self.resume_from = Path(resume_from) if resume_from else None
        self.run_id, self.stack, self.stage = run_id, stack, stage
        self.initial_revision = initial_revision
        self.checkpoint_dir = checkpoint_dir
        self.trajectories = JsonlWriter(out_dir / "trajectories.jsonl")
        self.training = JsonlWriter(out_dir / "training.jsonl")
        self.steps: list[dict[str, Any]] = []

    def revision(self, global_step: int) -> str:
        if global_step == 0:
            return self.initial_revision
        name = f"checkpoint-{global_step}"
        folder = self.resume_from if self.resume_from and self.resume_from.name == name else self.checkpoint_dir / name
        return sha256_file(folder / "model.safetensors")

    def record(self, trainer: Any, inputs: list[dict[str, Any]], out: dict[str, Any],
               reward: TaskReward, started: float) -> None:
        import torch

        tokenizer = trainer.processing_class
        eos_ids = set(trainer.eos_token_ids)
        step = trainer.state.global_step + 1
        revision = self.revision(trainer.state.global_step)
        group_size = trainer.num_generations
        prompt_ids, prompt_mask = out["prompt_ids"], out["prompt_mask"]
        completion_ids, completion_mask = out["completion_ids"], out["completion_mask"]
        tool_mask = out.get("tool_mask", torch.ones_like(completion_mask))
        sampling = out["sampling_per_token_logps"]
        with torch.no_grad():
            recomputed, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model,
                torch.cat([prompt_ids, completion_ids], dim=1),
                torch.cat([prompt_mask, completion_mask], dim=1),
                completion_ids.size(1),
                batch_size=completion_ids.size(0),
            )
        elapsed = time.monotonic() - started
        rewards_in_groups: dict[int, list[float]] = {}
        for row, example in enumerate(inputs):
            group, sample = divmod(row, group_size)
            prompt = prompt_ids[row][prompt_mask[row].bool()].tolist()
            valid = completion_mask[row].bool()
            completion = completion_ids[row][valid].tolist()
            provenance = tool_mask[row][valid].tolist()
            logps = sampling[row][valid].tolist()
            old = recomputed[row][valid].tolist()
            segments = [Segment(source="prompt", token_ids=prompt, text=tokenizer.decode(prompt))]
            for start, end, is_policy in mask_runs(provenance):
                ids = completion[start:end]
                segments.append(Segment(
                    source="policy" if is_policy else self.non_policy_source,
                    token_ids=ids,
                    logprobs=[min(0.0, lp) for lp in logps[start:end]] if is_policy else None,
                    text=tokenizer.decode(ids),
                ))
            score, _ = reward.last[row]
            error = reward.errors[row] if getattr(reward, "errors", None) else None
            truncated = not completion or completion[-1] not in eos_ids
            episode_id = f"{self.stage}/s{step}/g{group}/{sample}"
            item_id = get_item_id(example)
            rewards_in_groups.setdefault(group, []).append(score.reward)
            self.trajectories.write(Trajectory(
                run_id=self.run_id, stack=self.stack, stage=self.stage, step=step, episode_id=episode_id,
                task_id=item_id, group_id=f"{self.stage}/s{step}/g{group}", sample_index=sample,
                policy_revision=revision, segments=segments, reward=score.reward,
                reward_components=score.components,
                outcome="error" if error else "truncated" if truncated and not score.success else score.outcome,
                finish_reason="length" if truncated else "stop",
                turns=sum(1 for segment in segments if segment.source == "policy"),
                error=error, timing={"batch_generate_s": elapsed},
            ))
            loss_mask = [0] * len(prompt) + [int(m) for m in provenance]
            self.training.write(TrainingRow(
                step=step, row_id=f"{self.stage}/s{step}/r{row}", episode_ids=[episode_id],
                input_ids=prompt + completion, loss_mask=loss_mask,
                advantage=float(out["advantages"][row]),
                old_logprobs=[0.0] * len(prompt) + [lp if m else 0.0 for lp, m in zip(old, provenance, strict=True)],
            ))
        self.trajectories.flush()
        self.training.flush()
        self.steps.append({
            "step": step,
            "mean_reward": sum(sum(r) for r in rewards_in_groups.values()) / len(inputs),
            "groups_with_variance": sum(1 for r in rewards_in_groups.values() if len(set(r)) > 1),
            "groups": len(rewards_in_groups),
            "generate_s": elapsed,
        })

    def close(self, ok: bool) -> None:
        for writer in (self.trajectories, self.training):
            writer.close() if ok else writer.abandon()


def get_item_id(example: dict[str, Any]) -> str:
    return json.loads(example["item"])["task_id"]


def _make_trainer_class():
    import torch
    from trl import GRPOTrainer

    class CapturingGRPOTrainer(GRPOTrainer):
        def __init__(self, *args, recorder: Recorder | None = None, task_reward: TaskReward, **kwargs):
            super().__init__(*args, **kwargs)
            self.recorder = recorder
            self.task_reward = task_reward
            self.add_callback(completion_marker())

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                                  has_tool_images=False):
            model = self.accelerator.unwrap_model(self.model)
            original = model.generate
            captured: dict[str, Any] = {}

            def generate(*args, **kwargs):
                output = original(*args, **kwargs, output_scores=True, return_dict_in_generate=True)
                captured["scores"] = output.scores
                return output.sequences

            model.generate = generate
            try:
                completion_ids, _ = super()._generate_single_turn(
                    prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
            finally:
                del model.generate
            # scores[t] is the processed (temperature/top-k/top-p) distribution the token at t was drawn from.
            logprobs = []
            for row, ids in enumerate(completion_ids):
                logprobs.append([
                    torch.log_softmax(captured["scores"][t][row].float(), dim=-1)[token].item()
                    for t, token in enumerate(ids)
                ])
            return completion_ids, logprobs

        def _generate_and_score_completions(self, inputs):
            started = time.monotonic()
            out = super()._generate_and_score_completions(inputs)
            if self.recorder is not None and self.model.training:
                self.recorder.record(self, inputs, out, self.task_reward, started)
            return out

    return CapturingGRPOTrainer


def grpo_config(plan: Plan, output_dir: Path, *, steps: int):
    from trl import GRPOConfig

    budget, sampling = plan.budget, plan.sampling
    return GRPOConfig(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=budget.prompts_per_step * budget.generations_per_prompt,
        num_generations=budget.generations_per_prompt,
        learning_rate=budget.learning_rate,
        beta=0.0,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_completion_length=sampling.max_new_tokens,
        max_tool_calling_iterations=budget.max_turns - 1,
        seed=sampling.seed,
        data_seed=sampling.seed,
        logging_steps=1,
        save_strategy="steps",
        save_steps=1,
        log_completions=False,
        **trainer_device_args(budget.gpus),
    )


def build_trainer(plan: Plan, policy_dir: Path, output_dir: Path, *, steps: int, recorder: Recorder | None,
                  train_items: list[dict[str, Any]]):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    deterministic_torch(plan.sampling.seed)
    tokenizer = with_response_parser(AutoTokenizer.from_pretrained(policy_dir), plan.policy.tool_format)
    model = AutoModelForCausalLM.from_pretrained(policy_dir)
    families = {row["environment"] for row in train_items}
    task_reward = TaskReward()
    trainer_class = _make_trainer_class()
    return trainer_class(
        model=model,
        reward_funcs=[task_reward],
        args=grpo_config(plan, output_dir, steps=steps),
        train_dataset=Dataset.from_list(train_items),
        processing_class=tokenizer,
        environment_factory={name: environment_class(name) for name in sorted(families)},
        recorder=recorder,
        task_reward=task_reward,
    )


def training_metrics(trainer) -> dict[str, Any]:
    """Loss and gradient norm per logged optimizer step, and the step reached."""
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {"loss": [float(entry["loss"]) for entry in history],
            "grad_norm": [float(entry.get("grad_norm", 0.0)) for entry in history],
            "global_step": trainer.state.global_step}


def train_to_the_end(trainer, recorder: Recorder, resume_from: str | None, close=lambda ok: None) -> None:
    """`trainer.train()` with what start-up made out of the collector's reach; the recorder's files (and
    `close`'s) are finalised if it returns and kept, marked partial, if it raises."""
    freeze_heap()  # the imports and the loaded model: no full collection walks them mid-step
    ok = False
    try:
        trainer.train(resume_from_checkpoint=resume_from)
        ok = True
    finally:
        recorder.close(ok)
        close(ok)


def run_episodes(trainer, rows: list[dict[str, Any]], batch_size: int = 16, sampling: SamplingSpec | None = None):
    """Episodes through TRL's own generate + tool loop (no training): greedy, or sampled with `sampling`'s
    settings (the caller seeds torch). Yields (row, env, transcript, finish, completion messages)."""
    trainer.model.eval()
    config = trainer.generation_config
    config.do_sample = sampling is not None
    config.temperature = sampling.temperature if sampling else None
    config.top_p = sampling.top_p if sampling else None
    config.top_k = (sampling.top_k or None) if sampling else None
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        # The per-rollout environment and tool wiring GRPOTrainer does in _generate_and_score_completions.
        trainer._batch_environments = [row["environment"] for row in batch]
        trainer.environments = [trainer.environment_factories[name]() for name in trainer._batch_environments]
        trainer._sync_tool_dicts, trainer._async_tool_dicts = [], []
        for env, row in zip(trainer.environments, batch, strict=True):
            env.reset(**{k: v for k, v in row.items() if k != "environment"})
            tools = {name: getattr(env, name) for name, _ in inspect.getmembers(type(env), inspect.isfunction)
                     if name not in ("reset", "get_reward") and not name.startswith("_")}
            trainer._sync_tool_dicts.append(tools)
            trainer._async_tool_dicts.append({})
        prompts = copy.deepcopy([row["prompt"] for row in batch])
        _, completion_ids, _, completions, *_ = trainer._generate(prompts)
        eos = set(trainer.eos_token_ids)
        for row, env, completion, ids in zip(batch, trainer.environments, completions, completion_ids, strict=True):
            finish = "stop" if ids and ids[-1] in eos else "length"
            yield row, env, env._transcript(final_text(completion)), finish, completion
