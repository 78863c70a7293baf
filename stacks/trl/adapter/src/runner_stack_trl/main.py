"""Entry point the host launches (`runner_stack_trl.main:run`): one function per stage."""

from __future__ import annotations

import inspect
import os
import shutil
from pathlib import Path
from typing import Any

from qualification.tasks import TaskItem, get_family, use_plan
from runner_contracts import (
    TEACHER_FILE,
    EvalRecord,
    JsonlWriter,
    ServiceCase,
    StageRequest,
    StageResult,
    sha256_file,
)
from runner_kit.tool_formats import malformed_call, render_tool_calls

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

CAPABILITIES = ["grpo", "sft", "distill", "multi-turn-tools", "resume", "cpu", "token-capture:trainer"]


def run(request: StageRequest) -> StageResult:
    use_plan(request.plan)  # a plan's native task (an environment stack's asset) is a family in this process
    if request.options.get("rollout_service") and request.stage in ("rollout", "update", "train", "evaluate"):
        from . import (
            bridge,  # an environment-stack arm: episodes run in that stack's rollout service
        )

        handlers = {"rollout": bridge.rollout, "update": bridge.train, "train": bridge.train,
                    "evaluate": bridge.evaluate}
        return handlers[request.stage](request)
    handlers = {
        "probe": probe,
        "build-policy": build_policy,
        "service": service,
        "rollout": rollout,
        "distill": distill,
        "update": train,
        "train": train,
        "evaluate": evaluate,
        "serve-policy": serve_policy,
    }
    if request.stage not in handlers:
        raise ValueError(f"trl adapter has no stage {request.stage!r}; it has {', '.join(handlers)}")
    return handlers[request.stage](request)


def missing_apis() -> dict[str, str]:
    """capability -> the TRL API this adapter needs for it that the installed release lacks (an older pin
    set, say), so the probe names it instead of a later stage failing on it."""
    from trl import chat_template_utils

    parse_response = getattr(chat_template_utils, "parse_response", None)
    absent = [name for name, ok in [
        ("trl.chat_template_utils.parse_response(..., tools=...)",
         parse_response is not None and "tools" in inspect.signature(parse_response).parameters),
        ("trl.chat_template_utils.add_response_schema", hasattr(chat_template_utils, "add_response_schema"))] if not ok]
    return {"multi-turn-tools": f"{' and '.join(absent)} {'is' if len(absent) == 1 else 'are'} not in this trl"} if absent else {}


def probe(request: StageRequest) -> StageResult:
    import torch
    from runner_kit.rollout import environment_info, reachability

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    missing = missing_apis()
    return StageResult(stage="probe", environment=environment_info("trl", gpus),
                       capabilities=[c for c in CAPABILITIES if c not in missing],
                       metrics={"torch": str(torch.__version__), "cuda_available": torch.cuda.is_available(),
                                "reach": reachability([request.policy_dir] if request.policy_dir else []),
                                "missing_apis": missing})


def build_policy(request: StageRequest) -> StageResult:
    import msgspec

    from runner_contracts import TinyRecipe

    from .policy import build_tiny_policy

    recipe = msgspec.convert(request.options.get("recipe", {}), TinyRecipe)  # the host checked the plan's already
    out = Path(request.out_dir) / "policy"
    out.mkdir(parents=True, exist_ok=True)
    record = build_tiny_policy(out, recipe)
    return StageResult(stage="build-policy", metrics=record, files={"policy": "policy"})


# --- service: scripted episodes through TRL's response parser, the environment and the reward ----------


def _render_turn(turn: dict[str, Any], tool_format: str) -> str:
    """A scripted assistant turn as raw model output in the plan's tool-call format."""
    if "tool_call" in turn:
        return render_tool_calls([(turn["tool_call"]["name"], turn["tool_call"]["arguments"])], tool_format)
    if "raw_tool_call" in turn:
        return malformed_call(turn["raw_tool_call"], tool_format)
    return turn["text"]


def _calls(transcript) -> list[dict[str, Any]]:
    return [{"name": c.name, "arguments": c.arguments, "result": c.result} for c in transcript.tool_calls]


def service(request: StageRequest) -> StageResult:
    from transformers import AutoTokenizer
    from trl.chat_template_utils import parse_response

    from .chat_formats import with_response_parser
    from .environment import environment_class, tool_methods
    from .grpo import TaskReward
    from .policy import prompt_messages

    plan = request.plan
    tokenizer = with_response_parser(AutoTokenizer.from_pretrained(request.policy_dir), plan.policy.tool_format)
    reward = TaskReward()
    specs = [(plan.task.family, plan.task.train), (plan.task.retention.family or plan.task.family, plan.task.retention)]
    per_family = int(request.options.get("items_per_family", 3))
    with JsonlWriter(Path(request.out_dir) / "service.jsonl") as writer:
        for family_name, split in specs:
            family = get_family(family_name)
            env_class = environment_class(family_name)
            for item in family.generate(split.split, per_family, split.seed):
                for case in family.scripted_cases(item):
                    env = env_class()
                    env.reset(item=item.to_json())
                    tools = tool_methods(env) or None
                    messages = prompt_messages(item)
                    completion: list[dict[str, Any]] = []
                    for turn in case["turns"]:
                        prefix = tokenizer.apply_chat_template(messages + completion, tools=tools, tokenize=True,
                                                               add_generation_prompt=True, return_dict=False)
                        ids = tokenizer.encode(_render_turn(turn, plan.policy.tool_format) + tokenizer.eos_token, add_special_tokens=False)
                        parsed = parse_response(tokenizer, ids, prefix=prefix, tools=tools)
                        completion.append(parsed)
                        for call in parsed.get("tool_calls") or []:
                            function = call["function"]
                            method = getattr(env, function["name"], None)
                            try:
                                result = method(**function["arguments"]) if method else f"Tool {function['name']} not found."
                            except Exception as error:  # TRL turns tool exceptions into an error result, so do we
                                result = str({"error": str(error)})
                            completion.append({"role": "tool", "name": function["name"], "content": str(result)})
                    stack_reward = reward([completion], [env])[0]
                    score, transcript = reward.last[0]
                    writer.write(ServiceCase(
                        task_id=item.task_id, item=item.to_json(), case=case["case"],
                        expected_success=case["expected_success"], final_text=transcript.final_text,
                        tool_calls=_calls(transcript), stack_reward=stack_reward,
                        stack_components=score.components,
                    ))
    return StageResult(stage="service", files={"service": "service.jsonl"})


# --- rollout / update / train ------------------------------------------------------------------------


def _recorder(request: StageRequest, checkpoint_dir: Path):
    from .grpo import Recorder

    return Recorder(Path(request.out_dir), run_id=request.run_id, stack=request.stack, stage=request.stage,
                    initial_revision=sha256_file(Path(request.policy_dir) / "model.safetensors"),
                    checkpoint_dir=checkpoint_dir, resume_from=request.resume_from)


def _train_rows(request: StageRequest) -> list[dict[str, Any]]:
    from .grpo import task_rows

    split = request.plan.task.train
    return task_rows(split.family or request.plan.task.family, split.split, split.n, split.seed)


def rollout(request: StageRequest) -> StageResult:
    """One generation batch (G x B episodes) with the real policy and no optimizer step."""
    from .grpo import build_trainer

    checkpoint_dir = Path(request.out_dir) / "checkpoints"
    recorder = _recorder(request, checkpoint_dir)
    trainer = build_trainer(request.plan, Path(request.policy_dir), checkpoint_dir, steps=1, recorder=recorder,
                            train_items=_train_rows(request))
    ok = False
    try:
        trainer.model.train()
        batch = next(iter(trainer.get_train_dataloader()))
        trainer._generate_and_score_completions(batch)
        ok = True
    finally:
        recorder.close(ok)
    return StageResult(stage=request.stage, metrics={"steps": recorder.steps},
                       files={"trajectories": "trajectories.jsonl", "training": "training.jsonl"})


def train(request: StageRequest) -> StageResult:
    """K GRPO steps (update), or the full budget (train); checkpoints every step with a completeness marker."""
    from .grpo import build_trainer, train_to_the_end, training_metrics

    steps = request.steps or (request.plan.gates.update_steps if request.stage == "update"
                              else request.plan.budget.steps)
    if request.plan.recipe in ("sft", "distill"):
        from .sft import train_sft

        return StageResult(stage=request.stage, metrics=train_sft(request, steps),
                           files={"demonstrations": "demonstrations.jsonl", "training": "training.jsonl",
                                  "checkpoints": "checkpoints"})
    checkpoint_dir = Path(request.out_dir) / "checkpoints"
    recorder = _recorder(request, checkpoint_dir)
    trainer = build_trainer(request.plan, Path(request.policy_dir), checkpoint_dir, steps=steps, recorder=recorder,
                            train_items=_train_rows(request))
    train_to_the_end(trainer, recorder, request.resume_from)
    return StageResult(stage=request.stage, metrics={"steps": recorder.steps, **training_metrics(trainer)},
                       files={"trajectories": "trajectories.jsonl", "training": "training.jsonl",
                              "checkpoints": "checkpoints"})


def distill(request: StageRequest) -> StageResult:
    from .distill import sample_teacher

    return StageResult(stage="distill", metrics=sample_teacher(request), files={"teacher": TEACHER_FILE})


# --- evaluate ----------------------------------------------------------------------------------------


def serve_policy(request: StageRequest) -> StageResult:
    """The `serve-policy` job: `request.policy_dir` served on 127.0.0.1, greedy whatever a call asks (an
    evaluation harness's model, see runner/_stages/harnesses.py), every call logged to calls.jsonl; writes
    service.json {url: the OpenAI base URL (.../v1), pid} once it answers and runs until SIGTERM."""
    from runner_contracts.processes import StopSignal
    from runner_kit.policy_server import PolicyServer
    from runner_kit.rollout import publish_service
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .policy import deterministic_torch

    stop = StopSignal()
    out, policy = Path(request.out_dir), Path(request.policy_dir or "")
    deterministic_torch(request.plan.sampling.seed)
    server = PolicyServer(AutoModelForCausalLM.from_pretrained(policy), AutoTokenizer.from_pretrained(policy),
                          sampling=request.plan.sampling, calls_path=out / "calls.jsonl",
                          revision=sha256_file(policy / "model.safetensors"), tool_format=request.plan.policy.tool_format)
    server.greedy = True
    server.start()
    ok = False
    try:
        publish_service(out, server.base_url, request.stack)
        stop.wait()
        ok = True
    finally:
        server.close(ok)
    return StageResult(stage=request.stage, files={"calls": "calls.jsonl"},
                       metrics={"decoding": "greedy", "policy_batching": server.sampler.evidence()})


def evaluate(request: StageRequest) -> StageResult:
    """Held-out and retention splits, base vs trained policy, the same greedy decoding for both; with
    plan.evaluation, also that many sampled attempts per item and policy (attempt a seeded the same for both)."""
    import torch

    from .grpo import build_trainer, run_episodes, task_rows

    plan = request.plan
    policies = {"base": Path(request.policy_dir), "trained": Path(request.options["trained_policy"])}
    if request.options.get("baseline_policy"):  # recipe distill: the matched SFT baseline
        policies["baseline"] = Path(request.options["baseline_policy"])
    splits = [("heldout", plan.task.heldout.family or plan.task.family, plan.task.heldout),
              ("retention", plan.task.retention.family or plan.task.family, plan.task.retention)]
    all_rows = {label: task_rows(family, spec.split, spec.n, spec.seed) for label, family, spec in splits}
    families = sorted({row["environment"] for rows in all_rows.values() for row in rows})
    counts: dict[str, dict[str, int]] = {}
    with JsonlWriter(Path(request.out_dir) / "eval.jsonl") as writer:
        for policy_label, policy_path in policies.items():
            any_rows = [rows[0] for rows in all_rows.values()]
            trainer = build_trainer(plan, policy_path, Path(request.out_dir) / "scratch", steps=1, recorder=None,
                                    train_items=[r for r in any_rows if r["environment"] in families])
            attempts = [None] + list(range(plan.evaluation.attempts if plan.evaluation else 0))
            for attempt in attempts:
                if attempt is not None:
                    torch.manual_seed(plan.sampling.seed * 1009 + attempt)
                for split_label, rows in all_rows.items():
                    for row, env, transcript, finish, _ in run_episodes(
                            trainer, rows, sampling=None if attempt is None else plan.sampling):
                        item = TaskItem.from_json(row["item"])
                        score = env.family.score(item, transcript)
                        key = f"{policy_label}/{split_label}" + ("" if attempt is None else "/sampled")
                        counts.setdefault(key, {"k": 0, "n": 0})
                        counts[key]["k"] += int(score.success)
                        counts[key]["n"] += 1
                        writer.write(EvalRecord(
                            policy=policy_label, split=split_label, task_id=item.task_id, item=row["item"],
                            final_text=transcript.final_text,
                            tool_calls=_calls(transcript), stack_reward=score.reward, success=score.success,
                            finish_reason=finish, decoding="greedy" if attempt is None else "sampled",
                            attempt=attempt or 0,
                        ))
    shutil.rmtree(Path(request.out_dir) / "scratch", ignore_errors=True)
    decoding = "greedy" + (f" and {plan.evaluation.attempts} sampled attempts" if plan.evaluation else "")
    return StageResult(stage="evaluate", metrics={"counts": counts, "decoding": decoding},
                       files={"eval": "eval.jsonl"})
