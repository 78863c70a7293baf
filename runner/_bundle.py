"""Candidate bundles: what a team hands over once a run qualified. The bundle folder is a model repository
as `save_pretrained` lays one out (config, weights, tokenizer, chat template), with the run's plan and
evidence under evidence/, a model card (README.md with the Hugging Face metadata header, written with
huggingface_hub's ModelCardData) and SHA256SUMS over every other file (`sha256sum -c` reads it).
`verify` checks the sums, that nothing was added, and that the weights are the ones the evidence names."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from runner_contracts import Evidence, Plan, read_record, sha256_file

from ._errors import UserError
from ._report import load_run

SUMS = "SHA256SUMS"
WEIGHTS = "model.safetensors"
# What save_pretrained writes for a model and its tokenizer; a checkpoint's optimizer and trainer state stay out.
MODEL_FILES = ("config.json", "generation_config.json", WEIGHTS, "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


def _hub():
    try:
        import huggingface_hub
    except ImportError:
        raise UserError("runner bundle writes the model card with huggingface_hub: pip install 'runner[bundle]'") \
            from None
    return huggingface_hub


def trained_checkpoint(run_dir: Path, evidence: list[Evidence]) -> tuple[Path, str]:
    """(folder, weights sha256) of the checkpoint the evaluate stage judged, as the train stage recorded it."""
    by_stage = {e.stage: e for e in evidence}
    if "train" not in by_stage or not by_stage["train"].checkpoints:
        raise UserError(f"{run_dir}: the run has no trained checkpoint (no train stage with checkpoints)")
    evaluated = (by_stage["evaluate"].metrics or {}).get("trained_policy") if "evaluate" in by_stage else None
    checkpoints = by_stage["train"].checkpoints
    chosen = next((c for c in checkpoints if Path(c.path).name == evaluated), checkpoints[-1])
    return run_dir / chosen.path, chosen.sha256


def _evidence_files(run_dir: Path) -> list[Path]:
    """The run's plan, summary, reports and every stage's evidence and result (not its logs or weights)."""
    names = ("plan.json", "summary.json", "report.md", "report.html")
    files = [run_dir / name for name in names if (run_dir / name).is_file()]
    for stage in sorted((run_dir / "stages").glob("*")):
        files += [stage / name for name in ("evidence.json", "result.json") if (stage / name).is_file()]
    return files


def _figure(split: dict[str, Any]) -> str:
    low, high = split.get("difference_ci") or (None, None)
    interval = f", difference {split['difference']:+.1%} (95% CI {low:+.1%} to {high:+.1%})" if low is not None else ""
    return (f"base {split['base']} -> trained {split['trained']}{interval}; {split['verdict']} "
            f"({split['test']}, p={split['p_value']:.3g})")


def model_card(plan: Plan, summary: dict[str, Any], base_sha: str | None, *, failed: list[str]) -> str:
    """README.md: the Hugging Face metadata header (base model, task families, held-out and retention
    accuracy) and what the run showed, its release verdict, intended use and limits."""
    hub = _hub()
    families = sorted({plan.task.family, plan.task.retention.family or plan.task.family})
    evaluation = summary.get("evaluation") or {}
    results = [hub.EvalResult(task_type="text-generation", dataset_type=family, dataset_name=f"{family} ({split})",
                              dataset_split=split, metric_type="accuracy",
                              metric_value=round(evaluation[split]["trained_k"] / evaluation[split]["n"], 4))
               for split, family in (("heldout", plan.task.family),
                                     ("retention", plan.task.retention.family or plan.task.family))
               if split in evaluation and evaluation[split].get("n")]
    data = hub.ModelCardData(base_model=plan.policy.path if plan.policy.kind == "path" else None,
                             model_name=f"{plan.name}-{summary['stack']}", datasets=families,
                             tags=["runner", f"runner-stack-{summary['stack']}", plan.recipe],
                             eval_results=results or None, library_name="transformers")
    release = summary.get("release") or {}
    status = ("**Not qualified**: bundled with --allow-failed; failed: " + ", ".join(failed)) if failed else \
        "Qualified: every gate of the plan passed."
    lines = [
        f"# {plan.name}: {summary['stack']} arm", "", status, "",
        f"- Plan `{plan.name}` (plan id `{plan.plan_id}`), recipe {plan.recipe}, stack {summary['stack']}.",
        f"- Base policy: {plan.policy.kind} `{plan.policy.path}` (weights sha256 `{base_sha or plan.policy.sha256}`),"
        f" tool-call format {plan.policy.tool_format}.",
        f"- Task families: {', '.join(families)} (synthetic or a team's own data: see the plan).", "",
        "## What the run showed", "",
        *[f"- {split}: {_figure(evaluation[split])}" for split in ("heldout", "retention") if split in evaluation],
        f"- Release verdict: {release.get('verdict', 'none (the plan sets no release conditions)')}"
        + "".join(f"; failed: {c}" for c in release.get("failed", [])), "",
        "## Intended use and limits", "",
        f"A candidate checkpoint for the task families above, trained under plan `{plan.name}`; its figures hold "
        "for those families and that plan's sizes only. The evidence (evidence/) is what runner audited: "
        "sampled tokens, loss masks, logprobs, resume after a kill, held-out and retention statistics. "
        "Re-check it with `runner bundle verify` before use.", "",
    ]
    return hub.ModelCard("---\n" + data.to_yaml() + "\n---\n\n" + "\n".join(lines)).content


def create(run_dir: Path, out: Path, *, allow_failed: bool = False) -> dict[str, Any]:
    """Writes the bundle of a finished run into `out` (a new or empty folder) and returns its summary."""
    plan, evidence = load_run(run_dir)
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise UserError(f"{run_dir}: no summary.json; the run has not finished (runner report {run_dir} rebuilds it)")
    summary = json.loads(summary_path.read_text())
    failed = [f"{stage}: {state}" for stage, state in summary.get("stages", {}).items() if state != "passed"]
    failed += list(summary.get("failed_gates", []))
    if failed and not allow_failed:
        raise UserError(f"{run_dir}: not every gate passed ({'; '.join(failed[:3])}); bundle it anyway with "
                        "--allow-failed, which marks it in the model card")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out}: exists and is not an empty folder")
    checkpoint, weights_sha = trained_checkpoint(run_dir, evidence)
    if sha256_file(checkpoint / WEIGHTS) != weights_sha:
        raise UserError(f"{checkpoint / WEIGHTS}: sha256 differs from the train stage's evidence ({weights_sha[:12]})")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".bundle-", dir=out.parent) as scratch:
        staging = Path(scratch) / "bundle"
        staging.mkdir()
        for name in MODEL_FILES:
            if (checkpoint / name).is_file():
                shutil.copy2(checkpoint / name, staging / name)
        for source in _evidence_files(run_dir):
            target = staging / "evidence" / source.relative_to(run_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
        (staging / "bundle.json").write_text(json.dumps({
            "run_dir": str(run_dir.resolve()), "checkpoint": str(checkpoint.relative_to(run_dir)),
            "weights_sha256": weights_sha, "plan_id": plan.plan_id, "stack": summary["stack"],
            "qualified": not failed, "failed": failed}, indent=2) + "\n")
        (staging / "README.md").write_text(model_card(plan, summary, plan.policy.sha256, failed=failed))
        files = sorted(p for p in staging.rglob("*") if p.is_file())
        (staging / SUMS).write_text("".join(f"{sha256_file(p)}  {p.relative_to(staging).as_posix()}\n" for p in files))
        if out.exists():
            out.rmdir()
        staging.rename(out)
    return {"bundle": str(out), "files": len(files) + 1, "weights_sha256": weights_sha, "qualified": not failed}


def verify(bundle: Path) -> list[str]:
    """Problems with a bundle, one line each naming the file; empty when it is intact."""
    sums = bundle / SUMS
    if not sums.is_file():
        return [f"{sums}: missing; not a bundle written by `runner bundle`"]
    problems, listed = [], set()
    for number, line in enumerate(sums.read_text().splitlines(), 1):
        digest, _, name = line.partition("  ")
        if len(digest) != 64 or not name:
            problems.append(f"{sums}:{number}: expected '<sha256>  <path>', got {line!r}")
            continue
        listed.add(name)
        path = bundle / name
        if not path.is_file():
            problems.append(f"{path}: listed in {SUMS}, missing")
        elif sha256_file(path) != digest:
            problems.append(f"{path}: sha256 {sha256_file(path)[:12]} differs from {SUMS} ({digest[:12]})")
    for path in sorted(p for p in bundle.rglob("*") if p.is_file()):
        name = path.relative_to(bundle).as_posix()
        if name != SUMS and name not in listed:
            problems.append(f"{path}: not in {SUMS} (added after the bundle was written)")
    train = bundle / "evidence" / "stages" / "train" / "evidence.json"
    if (bundle / WEIGHTS).is_file() and train.is_file():
        recorded = {c.sha256 for c in read_record(train, Evidence).checkpoints}
        if sha256_file(bundle / WEIGHTS) not in recorded:
            problems.append(f"{bundle / WEIGHTS}: not a checkpoint the train stage's evidence records")
    elif not (bundle / WEIGHTS).is_file():
        problems.append(f"{bundle / WEIGHTS}: missing")
    return problems


def push(bundle: Path, repo_id: str) -> str:
    """Uploads a verified bundle with the hub's own client (its token from the usual places); not tested
    here, as no hub is reachable."""
    if problems := verify(bundle):
        raise UserError(f"{bundle}: does not verify ({problems[0]})")
    api = _hub().HfApi()
    api.create_repo(repo_id, exist_ok=True, private=True)
    return str(api.upload_folder(folder_path=str(bundle), repo_id=repo_id))
