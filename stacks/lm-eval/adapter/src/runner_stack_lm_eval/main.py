"""Entry point the host launches (`runner_stack_lm_eval.main:run`): lm-evaluation-harness's simple_evaluate of
a task's YAML file against the policy server the host started for one checkpoint
(runner/_stages/harnesses.py).

The harness job writes lm_eval's own results and samples files (EvaluationTracker, under results/), and
harness.jsonl: one HarnessSample per logged sample (its score under the headline metric, the filtered
answer) with the episode id its request carried. lm_eval sends no per-request id, so the model is
local-chat-completions with one addition: each request body gets metadata.episode_id = <checkpoint>/<the
sha256 of its messages>, which the sample's logged arguments give back.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import yaml
from runner_contracts import HARNESS_FILE, HarnessSample, StageRequest, StageResult
from runner_kit.harness import harness_main, write_samples

UPSTREAM = "lm_eval"
CAPABILITIES = ["harness:lm-eval-task-yaml", "openai-compatible-client", "per-sample-attribution:payload"]


def run(request: StageRequest) -> StageResult:
    return harness_main(request, upstream=UPSTREAM, capabilities=CAPABILITIES, harness=harness)


def episode_of(label: str, messages: list[dict[str, Any]]) -> str:
    """The episode id of a request: its checkpoint and the sha256 of its messages (canonical JSON)."""
    canonical = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return f"{label}/{hashlib.sha256(canonical.encode()).hexdigest()[:20]}"


def harness(request: StageRequest) -> StageResult:
    """options: policy_url (the server's OpenAI base URL), task (the task's YAML file), label (base | trained),
    metric (the headline; default the task's first), limit (documents)."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.models.openai_completions import LocalChatCompletion
    from lm_eval.tasks import TaskManager

    options, out = request.options, Path(request.out_dir)
    label, task_file = str(options["label"]), Path(str(options["task"]))

    class RunnerChatCompletion(LocalChatCompletion):
        def _create_payload(self, messages, *args, **kwargs) -> dict:
            payload = super()._create_payload(messages, *args, **kwargs)
            return {**payload, "metadata": {"episode_id": episode_of(label, messages)}}

    task = yaml.safe_load(task_file.read_text())["task"]
    os.chdir(task_file.parent)  # the task's data_files are relative to its folder
    model = RunnerChatCompletion(model="policy", base_url=str(options["policy_url"]).rstrip("/") + "/chat/completions",
                                 tokenizer_backend=None, num_concurrent=8, max_retries=2, timeout=300,
                                 max_gen_toks=request.plan.sampling.max_new_tokens)
    results = lm_eval.simple_evaluate(
        model=model, tasks=[task], task_manager=TaskManager(include_path=str(task_file.parent), include_defaults=False),
        apply_chat_template=True, log_samples=True, limit=options.get("limit"), random_seed=request.plan.sampling.seed,
        numpy_random_seed=request.plan.sampling.seed, fewshot_random_seed=request.plan.sampling.seed)
    tracker = EvaluationTracker(output_path=str(out / "results"))
    tracker.save_results_aggregated(results=results, samples=results["samples"])
    tracker.save_results_samples(task_name=task, samples=results["samples"][task])
    metric, key, value, stderr = _headline(results["results"][task], options.get("metric"))
    samples = [_sample(label, sample, metric, key) for sample in results["samples"][task]]
    write_samples(out, samples)
    written = sorted(str(p.relative_to(out)) for p in (out / "results").rglob("results_*.json"))
    return StageResult(stage="harness", files={"samples": HARNESS_FILE, "logs": "results"}, metrics={
        "status": "success", "upstream": f"{UPSTREAM}=={lm_eval.__version__}", "task": task, "metric": metric,
        "value": value, "stderr": stderr, "samples": len(samples), "log": written[-1] if written else None})


def _headline(figures: dict[str, Any], wanted: str | None) -> tuple[str, str, float | None, float | None]:
    """(metric, its "<metric>,<filter>" key, value, stderr): `wanted`, or the task's first metric."""
    keys = [k for k in figures if "," in k and "_stderr," not in k]
    key = next((k for k in keys if k.split(",", 1)[0] == wanted), None) if wanted else (keys[0] if keys else None)
    if key is None:
        return wanted or "", "", None, None
    metric, filter_name = key.split(",", 1)
    stderr = figures.get(f"{metric}_stderr,{filter_name}")  # numpy floats, or "N/A" when lm_eval has none
    return metric, key, float(figures[key]), float(stderr) if isinstance(stderr, (int, float)) else None


def _sample(label: str, sample: dict[str, Any], metric: str, key: str) -> HarnessSample:
    arguments = sample["arguments"]["gen_args_0"]["arg_0"][0]  # the request's messages, as lm_eval sent them
    filtered = sample.get("filtered_resps") or [""]
    return HarnessSample(policy=label, sample_id=str(sample["doc_id"]), episode_id=episode_of(label, json.loads(arguments)),
                         score=float(sample[metric]), answer=str(filtered[0] if not isinstance(filtered[0], list)
                                                                 else filtered[0][0]))
