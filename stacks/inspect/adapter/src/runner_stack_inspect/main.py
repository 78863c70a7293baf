"""Entry point the host launches (`runner_stack_inspect.main:run`): Inspect AI's own eval of a task file
against the policy server the host started for one checkpoint (runner/_stages/harnesses.py).

The harness job writes Inspect's log as Inspect writes it (logs/*.json), and harness.jsonl: one
HarnessSample per scored sample (its score as a number, by Inspect's value_to_float) with the episode id
its model calls carried, which the host matches against the policy server's calls.jsonl.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from runner_contracts import HARNESS_FILE, ErrorInfo, HarnessSample, StageRequest, StageResult
from runner_kit.harness import harness_main, write_samples

from . import attribution  # importing it registers the hook that names each sample's calls

UPSTREAM = "inspect_ai"
CAPABILITIES = ["harness:inspect-task-file", "openai-compatible-client", "per-sample-attribution:hook"]
PROVIDER = "openai-api/runner/policy"  # Inspect's OpenAI-compatible provider: service "runner", model "policy"


def run(request: StageRequest) -> StageResult:
    return harness_main(request, upstream=UPSTREAM, capabilities=CAPABILITIES, harness=harness)


def harness(request: StageRequest) -> StageResult:
    """options: policy_url (the server's OpenAI base URL), task (the task file), label (base | trained),
    metric (the headline; default the first score's first metric), limit (samples)."""
    import inspect_ai
    from inspect_ai import eval as inspect_eval

    options, out = request.options, Path(request.out_dir)
    label = str(options["label"])
    attribution.LABEL = label
    # Inspect globs the task path from the working directory, and Python 3.11's glob takes no absolute pattern.
    task = os.path.relpath(str(options["task"]))
    logs = inspect_eval(
        task, model=PROVIDER, model_base_url=str(options["policy_url"]),
        model_args={"api_key": "runner"},  # the provider requires one; the policy server reads none
        log_dir=str(out / "logs"), log_format="json", display="none",
        temperature=0.0, seed=request.plan.sampling.seed, max_tokens=request.plan.sampling.max_new_tokens,
        limit=options.get("limit"), max_connections=8, max_retries=2, timeout=300,
    )
    log = logs[0]
    samples = [_sample(label, sample) for sample in (log.samples or [])]
    write_samples(out, samples)
    metric, value, stderr = _headline(log, options.get("metric"))
    metrics: dict[str, Any] = {
        "status": log.status, "upstream": f"{UPSTREAM}=={inspect_ai.__version__}", "task": log.eval.task,
        "metric": metric, "value": value, "stderr": stderr, "samples": len(samples),
        "log": str(Path(log.location).relative_to(out)) if log.location else None,
    }
    error = ErrorInfo(kind="harness", message=str(log.error.message)) if log.error else None
    return StageResult(stage="harness", files={"samples": HARNESS_FILE, "logs": "logs"}, metrics=metrics,
                       error=error)


def _sample(label: str, sample) -> HarnessSample:
    from inspect_ai.scorer import value_to_float

    to_float = value_to_float()
    score = next(iter(sample.scores.values()), None) if sample.scores else None
    return HarnessSample(policy=label, sample_id=str(sample.id), epoch=sample.epoch, episode_id=_episode(sample),
                         score=float(to_float(score.value)) if score is not None else 0.0,
                         answer=(score.answer if score is not None and score.answer is not None
                                 else sample.output.completion if sample.output else ""))


def _headline(log, wanted: str | None) -> tuple[str | None, float | None, float | None]:
    """(metric, value, stderr) of the first score: `wanted`, or its first metric that is not stderr."""
    if not log.results or not log.results.scores:
        return wanted, None, None
    metrics = log.results.scores[0].metrics
    name = wanted or next((n for n in metrics if n != "stderr"), None)
    value = metrics[name].value if name in metrics else None
    stderr = metrics["stderr"].value if "stderr" in metrics else None
    return name, value, stderr


def _episode(sample) -> str:
    """The episode id the sample's model calls carried, as its log records each call's config ("" if none)."""
    headers = [(event.config.extra_headers or {}).get(attribution.EPISODE_HEADER)
               for event in sample.events or [] if getattr(event, "event", None) == "model"]
    return next((h for h in headers if h), "")
