"""The trainer bridge for environment-stack arms: the same pinned GRPO trainer as the trl arm, but episodes
run natively in another stack's rollout service, which calls this process's policy server.

Per generation batch: the rollout function sends the batch's episodes to POST {service}/rollouts, the
service runs them through its upstream and calls the policy server (which samples with the trainer's
current weights and logs every call), then each episode's calls become one training row by exact prefix
continuity (runner_kit.continuity). Rewards are the environment stack's own scores.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import msgspec
from qualification.tasks import Score, TaskItem
from runner_contracts import (
    EpisodeResult,
    EpisodeSpec,
    EvalRecord,
    JsonlWriter,
    Plan,
    RolloutPrepare,
    RolloutRequest,
    RolloutResponse,
    StageRequest,
    StageResult,
)
from runner_kit.continuity import chain_calls
from runner_kit.policy_server import CallHold, PolicyServer
from runner_kit.rollout import announce_policy, post_rollouts

from .grpo import Recorder, get_item_id, task_rows, train_to_the_end, training_metrics

CONCURRENCY = 32  # episodes in flight: the policy server batches their calls (runner_kit.batching)


def _policy_fields(server: PolicyServer, plan: Plan, tokenizer_dir: Path) -> dict[str, Any]:
    return {"policy_base_url": server.base_url, "policy_model": server.model_name, "tokenizer_dir": str(tokenizer_dir),
            "sampling": plan.sampling, "tool_format": plan.policy.tool_format}


def request_rollouts(service_url: str, episodes: list[EpisodeSpec], server: PolicyServer, plan: Plan,
                     tokenizer_dir: Path) -> RolloutResponse:
    batch = RolloutRequest(episodes=episodes, **_policy_fields(server, plan, tokenizer_dir), concurrency=CONCURRENCY,
                           episode_timeout_s=plan.budget.attempt_timeout_s())
    return post_rollouts(service_url, batch, timeout=plan.budget.wall_clock_s)


class EnvironmentReward:
    """Reward function for GRPOTrainer: the environment stack's score, passed through the rollout output."""

    __name__ = "environment_score"

    def __init__(self) -> None:
        self.last: list[tuple[Score, None]] = []
        self.errors: list[Any] = []

    def __call__(self, completions, env_result, **kwargs) -> list[float]:
        results = [msgspec.convert(r, EpisodeResult) for r in env_result]
        self.last = [(Score(reward=r.reward, success=r.success, components=r.reward_components,
                            outcome=r.outcome if r.outcome in ("success", "failure") else "failure"), None)
                     for r in results]
        self.errors = [r.error for r in results]
        return [r.reward for r in results]


class Bridge:
    """Owns the policy server and turns rollout-service results into GRPO rollout output."""

    def __init__(self, request: StageRequest, server: PolicyServer, recorder: Recorder | None):
        self.request = request
        self.plan = request.plan
        self.server = server
        self.recorder = recorder
        self.service_url = request.options["rollout_service"]
        self.batches: list[dict[str, Any]] = []

    def rollout_func(self, prompts: list[Any], trainer) -> dict[str, Any]:
        inputs = trainer._bridge_inputs
        step = trainer.state.global_step + 1
        group_size = trainer.num_generations
        stage = self.request.stage
        episodes = []
        for row, example in enumerate(inputs):
            group, sample = divmod(row, group_size)
            item = TaskItem.from_json(example["item"])
            episodes.append(EpisodeSpec(
                episode_id=f"{stage}/s{step}/g{group}/{sample}", task_id=item.task_id, family=item.family,
                item=example["item"], seed=self.plan.sampling.seed, max_turns=self.plan.budget.max_turns))
        if self.recorder is not None:
            self.server.revision = self.recorder.revision(trainer.state.global_step)
        started = time.monotonic()
        response = request_rollouts(self.service_url, episodes, self.server, self.plan, Path(self.request.policy_dir))
        by_id = {result.episode_id: result for result in response.results}
        out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [],
                                     "env_result": []}
        stack_rows = 0
        eos = trainer.processing_class.eos_token_id
        for episode, example in zip(episodes, inputs, strict=True):
            result = by_id[episode.episode_id]
            # Only the attempt that completed is trained; an episode given up on trains nothing. A stack
            # with its own token capture (a gateway) supplies the rows; the host audits them against the log.
            served = self.server.calls_of(episode.episode_id, result.attempts)
            stack_rows += result.captured_calls is not None
            source = served if result.captured_calls is None else result.captured_calls
            row = chain_calls(source) if result.status == "completed" else None
            if row is None:  # failed, or never reached the policy: an empty, untrained completion
                prompt = trainer.processing_class.apply_chat_template(example["prompt"], tokenize=True,
                                                                      add_generation_prompt=True, return_dict=False)
                out["prompt_ids"].append(list(prompt))
                out["completion_ids"].append([eos])
                out["env_mask"].append([0])
                out["logprobs"].append([0.0])
            else:
                out["prompt_ids"].append(row.prompt_ids)
                out["completion_ids"].append(row.completion_ids)
                out["env_mask"].append(row.mask)
                out["logprobs"].append(row.logprobs)
            out["env_result"].append(msgspec.to_builtins(result))
        # The host derives failures, retries and continuity from the trajectories and the call log.
        self.batches.append({"step": step, "episodes": len(episodes), "rows_from_stack_capture": stack_rows,
                             "rollout_s": round(time.monotonic() - started, 3)})
        return out


def _make_bridge_trainer_class(bridge: Bridge):
    from .grpo import _make_trainer_class

    base = _make_trainer_class()

    class BridgeGRPOTrainer(base):
        def _generate_and_score_completions(self, inputs):
            self._bridge_inputs = inputs  # rollout_func sees only prompts; it needs the task items too
            return super()._generate_and_score_completions(inputs)

    return BridgeGRPOTrainer


def build_bridge(request: StageRequest, policy_dir: Path, output_dir: Path, *, steps: int, recorder: Recorder | None):
    """A GRPO trainer whose rollouts come from the environment stack, and the policy server it shares."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .grpo import grpo_config
    from .policy import deterministic_torch

    plan = request.plan
    deterministic_torch(plan.sampling.seed)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_dir)
    hold = request.options.get("hold_calls")  # the host's injected crash (runner/_stages/rollout.py)
    server = PolicyServer(model, tokenizer, sampling=plan.sampling, calls_path=Path(request.out_dir) / "calls.jsonl",
                          revision=recorder.initial_revision if recorder else "", tool_format=plan.policy.tool_format,
                          hold=CallHold(int(hold["after_episodes"]), Path(hold["release_file"])) if hold else None)
    bridge = Bridge(request, server, recorder)
    split = plan.task.train
    # The service starts what waits for the policy's address (NeMo Gym's model server and agent) while the
    # trainer below is built, not during the first batch.
    refused = announce_policy(bridge.service_url, RolloutPrepare(
        **_policy_fields(server, plan, policy_dir), families=[split.family or plan.task.family],
        max_turns=plan.budget.max_turns))
    if refused:
        print(f"the rollout service was not told the policy's address ahead of the first batch: {refused}",
              file=sys.stderr, flush=True)
    reward = EnvironmentReward()
    trainer = _make_bridge_trainer_class(bridge)(
        model=model,
        reward_funcs=[reward],
        args=grpo_config(plan, output_dir, steps=steps),
        train_dataset=Dataset.from_list(task_rows(split.family or plan.task.family, split.split, split.n, split.seed)),
        processing_class=tokenizer,
        rollout_func=bridge.rollout_func,
        recorder=recorder,
        task_reward=reward,
    )
    server.start()
    return trainer, bridge


def _recorder(request: StageRequest) -> Recorder:
    from runner_contracts import sha256_file

    return Recorder(Path(request.out_dir), run_id=request.run_id, stack=request.stack, stage=request.stage,
                    initial_revision=sha256_file(Path(request.policy_dir) / "model.safetensors"),
                    checkpoint_dir=Path(request.out_dir) / "checkpoints", resume_from=request.resume_from,
                    non_policy_source="env")


def _files() -> dict[str, str]:
    return {"trajectories": "trajectories.jsonl", "training": "training.jsonl", "calls": "calls.jsonl"}


def rollout(request: StageRequest) -> StageResult:
    recorder = _recorder(request)
    trainer, bridge = build_bridge(request, Path(request.policy_dir), Path(request.out_dir) / "checkpoints",
                                   steps=1, recorder=recorder)
    ok = False
    try:
        trainer.model.train()
        trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
        ok = True
    finally:
        recorder.close(ok)
        bridge.server.close(ok)
    hold = bridge.server.hold
    return StageResult(stage=request.stage, files=_files(), metrics={
        "steps": recorder.steps, "batches": bridge.batches, "policy_batching": bridge.server.sampler.evidence(),
        **({"call_hold": hold.evidence()} if hold else {})})


def train(request: StageRequest) -> StageResult:
    steps = request.steps or (request.plan.gates.update_steps if request.stage == "update" else request.plan.budget.steps)
    recorder = _recorder(request)
    trainer, bridge = build_bridge(request, Path(request.policy_dir), Path(request.out_dir) / "checkpoints",
                                   steps=steps, recorder=recorder)
    train_to_the_end(trainer, recorder, request.resume_from, close=bridge.server.close)
    return StageResult(stage=request.stage, files={**_files(), "checkpoints": "checkpoints"}, metrics={
        "steps": recorder.steps, "batches": bridge.batches, "policy_batching": bridge.server.sampler.evidence(),
        **training_metrics(trainer)})


def evaluate(request: StageRequest) -> StageResult:
    """Held-out and retention episodes through the environment stack, base vs trained, greedy decoding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .policy import deterministic_torch

    plan = request.plan
    policies = {"base": Path(request.policy_dir), "trained": Path(request.options["trained_policy"])}
    splits = [("heldout", plan.task.heldout), ("retention", plan.task.retention)]
    counts: dict[str, dict[str, int]] = {}
    batching: dict[str, dict[str, Any]] = {}
    out_dir = Path(request.out_dir)
    with JsonlWriter(out_dir / "eval.jsonl") as writer:
        for label, path in policies.items():
            deterministic_torch(plan.sampling.seed)
            tokenizer = AutoTokenizer.from_pretrained(path)
            server = PolicyServer(AutoModelForCausalLM.from_pretrained(path), tokenizer, sampling=plan.sampling,
                                  calls_path=out_dir / f"calls-{label}.jsonl", revision=label,
                                  tool_format=plan.policy.tool_format).start()
            try:
                for attempt in [None, *range(plan.evaluation.attempts if plan.evaluation else 0)]:
                    server.greedy = attempt is None
                    tag = "" if attempt is None else f"a{attempt}/"
                    for split_label, spec in splits:
                        rows = task_rows(spec.family or plan.task.family, spec.split, spec.n, spec.seed)
                        episodes = [EpisodeSpec(
                            episode_id=f"eval/{label}/{split_label}/{tag}{get_item_id(row)}", task_id=get_item_id(row),
                            family=row["environment"], item=row["item"], max_turns=plan.budget.max_turns,
                            seed=plan.sampling.seed if attempt is None else plan.sampling.seed * 1009 + attempt)
                            for row in rows]
                        response = request_rollouts(request.options["rollout_service"], episodes, server, plan, path)
                        for episode, result in zip(episodes, response.results, strict=True):
                            key = f"{label}/{split_label}" + ("" if attempt is None else "/sampled")
                            counts.setdefault(key, {"k": 0, "n": 0})
                            counts[key]["k"] += int(result.success)
                            counts[key]["n"] += 1
                            writer.write(EvalRecord(
                                policy=label, split=split_label, task_id=episode.task_id, item=episode.item,
                                final_text=result.final_text,
                                tool_calls=[msgspec.to_builtins(c) for c in result.tool_calls],
                                stack_reward=result.reward, success=result.success,
                                finish_reason="error" if result.status == "failed" else result.finish_reason,
                                decoding="greedy" if attempt is None else "sampled",
                                attempt=attempt or 0))
            finally:
                server.close()
                batching[label] = server.sampler.evidence()
    decoding = "greedy" + (f" and {plan.evaluation.attempts} sampled attempts" if plan.evaluation else "")
    return StageResult(stage="evaluate", metrics={"counts": counts, "decoding": decoding, "policy_batching": batching},
                       files={"eval": "eval.jsonl"})
