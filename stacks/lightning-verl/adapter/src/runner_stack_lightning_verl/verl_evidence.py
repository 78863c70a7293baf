"""What verl's trainer ran, written as the contract's files while it runs (GPU path of the lightning-verl arm).

Agent Lightning's verl trainer keeps its rollouts and batches in memory; the host audits files. Three
conversions, each a plain function of plain data (so they are tested without a GPU):

- `trajectories_of`: the rollouts a step collected (AglRolloutManager's CompletedRollout, as dicts) →
  Trajectory records: the gateway's captured calls chained by prefix continuity (prompt, then sampled ids
  with their vLLM logprobs, then the tool/template ids between calls), the reward event's score;
- `training_rows_of`: the batch the actor was updated on (verl DataProto fields as arrays) → TrainingRow
  records: the unpadded sequence, loss mask = verl's response mask, the row's advantage, verl's old logprobs;
- `publish_checkpoint`: verl's `global_step_N` folder (FSDP shards, optimizer, dataloader state and, with
  `hf_model` in save_contents, `actor/huggingface/`) → `checkpoints/checkpoint-N/` with model.safetensors,
  the config and tokenizer files, the verl folder itself (hard links; resume reads it) and COMPLETE last.

`evidence_trainer_class()` is AgentLightningRayPPOTrainer with those three hooked in (its rollout manager
records each step's rollouts, `_train_step` the trained batch, `_save_checkpoint` publishes); `setup_worker`
installs it in the Ray task-runner process (see verl_launch).
"""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runner_contracts import (
    COMPLETE_MARKER,
    CapturedCall,
    ErrorInfo,
    JsonlWriter,
    Segment,
    TrainingRow,
    Trajectory,
    sha256_file,
    write_atomic,
)
from runner_kit.continuity import chain_calls, mask_runs

HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")


def episode_id(stage: str, step: int, rollout_id: str) -> str:
    return f"{stage}/s{step}/{rollout_id}"


def _reward_event(rollout: dict[str, Any]) -> dict[str, Any]:
    """The last reward event's data as the store worker posted it (the raw events: the store's triplet view
    keeps only the value)."""
    rewards = [e for e in rollout.get("events") or [] if e.get("event_type") == "reward"]
    return dict(rewards[-1].get("data") or {}) if rewards else {}


def trajectories_of(rollouts: Sequence[dict[str, Any]], *, run_id: str, stack: str, stage: str, step: int,
                    revision: str) -> list[Trajectory]:
    """One Trajectory per rollout, grouped by data_id (the GRPO group) in the order verl enqueued them.
    A failed rollout is kept, marked outcome=error with the store's reason, and has no policy segment."""
    out, index_in_group = [], defaultdict(int)
    for rollout in rollouts:
        group = f"{stage}/s{step}/{rollout['data_id']}"
        sample = index_in_group[group]
        index_in_group[group] += 1
        calls = [CapturedCall(prompt_ids=t["prompt"]["token_ids"], completion_ids=t["response"]["token_ids"],
                              logprobs=t["response"].get("log_probs") or [])
                 for t in rollout.get("triplets") or []]
        reward = _reward_event(rollout)
        task = rollout.get("input") or {}
        failed = rollout.get("rollout_state") != "succeeded" or not calls
        segments: list[Segment] = []
        row = None if failed else chain_calls(calls)
        if row is not None:
            segments.append(Segment(source="prompt", token_ids=row.prompt_ids))
            segments += [Segment(source="policy" if policy else "env", token_ids=row.completion_ids[start:end],
                                 logprobs=row.logprobs[start:end] if policy else None)
                         for start, end, policy in mask_runs(row.mask)]
        error = None
        if failed:
            error = ErrorInfo(kind="rollout-failed", message=rollout.get("error_message") or
                              f"rollout {rollout.get('rollout_state')} with {len(calls)} captured calls")
        out.append(Trajectory(
            run_id=run_id, stack=stack, stage=stage, step=step,
            episode_id=episode_id(stage, step, rollout["rollout_id"]), task_id=str(task.get("task_id", "")),
            group_id=group, sample_index=sample, policy_revision=revision, segments=segments,
            reward=float(rollout.get("final_reward") or 0.0),
            reward_components={k: float(v) for k, v in (reward.get("components") or {}).items()},
            outcome="error" if failed else reward.get("outcome", "failure"),
            finish_reason=str(reward.get("finish_reason", "")), turns=int(reward.get("turns", len(calls))),
            error=error,
            timing={k: float(rollout[k]) for k in ("enqueue_time", "running_at", "finished_at")
                    if rollout.get(k) is not None}))
    return out


def _list(value: Any) -> list:
    return value.tolist() if hasattr(value, "tolist") else list(value)


def training_rows_of(batch: dict[str, Any], *, stage: str, step: int) -> list[TrainingRow]:
    """The rows verl's actor update consumed. `batch` holds DataProto fields: input_ids and attention_mask
    [n, prompt+response] (prompts left-padded, responses right-padded), response_mask, advantages and
    old_log_probs [n, response], rollout_id_list [n]."""
    input_ids, attention = _list(batch["input_ids"]), _list(batch["attention_mask"])
    response_mask, advantages = _list(batch["response_mask"]), _list(batch["advantages"])
    old = _list(batch["old_log_probs"]) if batch.get("old_log_probs") is not None else None
    rows = []
    for index, rollout_id in enumerate(_list(batch["rollout_id_list"])):
        response_width = len(response_mask[index])
        prompt_width = len(input_ids[index]) - response_width
        ids, mask, logprobs = [], [], []
        for position, (token, attended) in enumerate(zip(input_ids[index], attention[index], strict=True)):
            if not attended:
                continue
            in_response = position >= prompt_width
            trained = int(in_response and response_mask[index][position - prompt_width])
            ids.append(int(token))
            mask.append(trained)
            logprobs.append(float(old[index][position - prompt_width]) if trained and old is not None else 0.0)
        trained_advantages = [a for a, m in zip(advantages[index], response_mask[index], strict=True) if m]
        rows.append(TrainingRow(
            step=step, row_id=f"{stage}/s{step}/r{index}", episode_ids=[episode_id(stage, step, str(rollout_id))],
            input_ids=ids, loss_mask=mask, advantage=float(trained_advantages[0]) if trained_advantages else 0.0,
            old_logprobs=logprobs if old is not None else None))
    return rows


def publish_checkpoint(verl_step: Path, checkpoints: Path, step: int) -> Path:
    """checkpoints/checkpoint-<step> from verl's global_step_<step> folder; COMPLETE is written last."""
    hf = verl_step / "actor" / "huggingface"
    weights = hf / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: verl saved no HF weights; actor.checkpoint.save_contents must "
                                "include hf_model (and the model must fit one safetensors file)")
    target = checkpoints / f"checkpoint-{step}"
    if target.exists():
        shutil.rmtree(target)  # an incomplete earlier publish (no COMPLETE) of the same step
    target.mkdir(parents=True)
    _link(weights, target / "model.safetensors")
    for name in HF_FILES:
        if (hf / name).is_file():
            _link(hf / name, target / name)
    for path in sorted(verl_step.rglob("*")):
        if path.is_file():
            _link(path, target / verl_step.name / path.relative_to(verl_step))
    write_atomic(target / COMPLETE_MARKER, f"{step} {sha256_file(target / 'model.safetensors')}\n".encode())
    return target


def _link(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:  # another filesystem
        shutil.copy2(source, target)


def verl_folder_of(checkpoint: Path) -> Path:
    """The verl global_step_N folder inside a published checkpoint (what a resumed run loads)."""
    found = sorted(checkpoint.glob("global_step_*"))
    if len(found) != 1:
        raise FileNotFoundError(f"{checkpoint}: expected one global_step_* folder (verl's own checkpoint), "
                                f"found {len(found)}")
    return found[0]


class EvidenceFiles:
    """The stage's trajectories.jsonl, training.jsonl and steps.json (verl's figures per step), and the
    revision (sha256 of model.safetensors) after each step."""

    def __init__(self, out_dir: Path, *, run_id: str, stack: str, stage: str, initial_revision: str):
        self.out_dir, self.run_id, self.stack, self.stage = out_dir, run_id, stack, stage
        self.trajectories = JsonlWriter(out_dir / "trajectories.jsonl")
        self.training = JsonlWriter(out_dir / "training.jsonl")
        self.steps: list[dict[str, Any]] = []
        self.revisions = {0: initial_revision}  # step -> sha256 of the weights after it

    def rollouts(self, step: int, rollouts: Sequence[dict[str, Any]]) -> None:
        revision = self.revisions.get(step - 1) or self.revisions[max(self.revisions)]
        for record in trajectories_of(rollouts, run_id=self.run_id, stack=self.stack, stage=self.stage, step=step,
                                      revision=revision):
            self.trajectories.write(record)
        self.trajectories.flush()

    def trained(self, step: int, batch: dict[str, Any], metrics: dict[str, Any]) -> None:
        for row in training_rows_of(batch, stage=self.stage, step=step):
            self.training.write(row)
        self.training.flush()
        loss = metrics.get("actor/pg_loss")
        self.steps.append({"step": step, "loss": None if loss is None else float(loss),
                           **{k: float(v) for k, v in metrics.items()
                              if isinstance(v, int | float) and k.startswith(("actor/", "critic/", "training/"))}})
        write_atomic(self.out_dir / "steps.json", json.dumps(self.steps, indent=1).encode())

    def checkpoint(self, step: int, verl_step: Path) -> None:
        published = publish_checkpoint(verl_step, self.out_dir / "checkpoints", step)
        self.revisions[step] = sha256_file(published / "model.safetensors")

    def close(self) -> None:
        for writer in (self.trajectories, self.training):
            writer.close()


def _batch_fields(batch) -> dict[str, Any]:
    """The DataProto fields training_rows_of reads, as CPU arrays."""
    fields = {name: batch.batch[name].cpu() for name in ("input_ids", "attention_mask", "response_mask",
                                                          "advantages") if name in batch.batch.keys()}
    fields["old_log_probs"] = batch.batch["old_log_probs"].cpu() if "old_log_probs" in batch.batch.keys() else None
    fields["rollout_id_list"] = batch.non_tensor_batch["rollout_id_list"]
    return fields


def evidence_trainer_class():
    """AgentLightningRayPPOTrainer writing the contract's files (needs verl, torch and a GPU to run)."""
    from agentlightning.verl.agl_rollout_manager import AglRolloutManager
    from agentlightning.verl.trainer import AgentLightningRayPPOTrainer

    class RecordingRolloutManager(AglRolloutManager):
        evidence: EvidenceFiles

        def enqueue_and_wait_until_completed(self, data, *, is_train):
            completed = super().enqueue_and_wait_until_completed(data, is_train=is_train)
            if is_train:
                self.evidence.rollouts(self._step, [c.model_dump(mode="json") for c in completed])
            return completed

    class EvidenceTrainer(AgentLightningRayPPOTrainer):
        def _evidence(self) -> EvidenceFiles:
            if not hasattr(self, "_evidence_files"):
                runner = self.config.runner
                self._evidence_files = EvidenceFiles(Path(runner.out_dir), run_id=runner.run_id, stack=runner.stack,
                                                     stage=runner.stage, initial_revision=runner.initial_revision)
            return self._evidence_files

        def _make_rollout_manager(self, manager_cls):
            if manager_cls is AglRolloutManager:
                manager_cls = RecordingRolloutManager
                RecordingRolloutManager.evidence = self._evidence()
            return super()._make_rollout_manager(manager_cls)

        def _train_step(self, timing_raw, curr_step_profile):
            result = super()._train_step(timing_raw, curr_step_profile)
            if result is not None:
                metrics, batch = result
                self._evidence().trained(self.global_steps, _batch_fields(batch), metrics)
            return result

        def _save_checkpoint(self):
            super()._save_checkpoint()
            step_dir = Path(self.config.trainer.default_local_dir) / f"global_step_{self.global_steps}"
            self._evidence().checkpoint(self.global_steps, step_dir)

        def fit(self):
            super().fit()
            self._evidence().close()

    return EvidenceTrainer


def setup_worker() -> None:
    """Ray's worker_process_setup_hook: Agent Lightning's own (its per-rollout loss), then the trainer class
    that entrypoint._AglTaskRunner builds (it imports it by name from agentlightning.verl.trainer)."""
    import agentlightning.verl.trainer as trainer_module
    from agentlightning.verl.per_rollout_loss import register_in_worker

    register_in_worker()
    trainer_module.AgentLightningRayPPOTrainer = evidence_trainer_class()


def read_steps(out_dir: Path) -> list[dict[str, Any]]:
    path = out_dir / "steps.json"
    return json.loads(path.read_text()) if path.is_file() else []
