"""Reports: a gate table for the terminal, report.md and summary.json for a run directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from qualification.gates import pooled_evaluation
from runner_contracts import AnyPlan, DomainPlan, Evidence, Plan, read_record

from ._domain_report import domain_html, domain_markdown, domain_summary
from ._errors import UserError
from ._html import gate_markdown, measured_cell
from ._html import render as render_html
from ._secrets import write_redacted
from ._stages import STAGES, TRIAL_STAGES, trial_dir

if TYPE_CHECKING:
    from rich.table import Table

STATUS_STYLE = {"passed": "green", "failed": "red", "error": "red", "skipped": "dim"}


def load_trials(run_dir: Path, plan: AnyPlan) -> dict[int, list[Evidence]]:
    """The evidence of each further plan seed's trial (its train and evaluate stages), by seed."""
    trials = {}
    for seed in plan.seeds[1:]:
        folder = trial_dir(run_dir, seed) / "stages"
        found = [read_record(folder / stage / "evidence.json", Evidence)
                 for stage in TRIAL_STAGES if (folder / stage / "evidence.json").is_file()]
        if found:
            trials[seed] = found
    return trials


def load_run(run_dir: Path) -> tuple[AnyPlan, list[Evidence]]:
    if not (run_dir / "plan.json").is_file():
        raise UserError(f"{run_dir}: not a run directory (no plan.json)")
    plan = read_record(run_dir / "plan.json", AnyPlan)
    evidence = [read_record(run_dir / "stages" / stage / "evidence.json", Evidence)
                for stage in STAGES if (run_dir / "stages" / stage / "evidence.json").is_file()]
    return plan, evidence


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, list) and len(value) > 4:
        return f"[{', '.join(_short(v) for v in value[:4])}, ...]"
    text = str(value) if value is not None else ""
    return text if len(text) <= 40 else text[:37] + "..."


def gate_table(evidence: list[Evidence], title: str) -> Table:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    table.add_column("stage")
    table.add_column("status")
    table.add_column("gate", no_wrap=True)
    table.add_column("measured", max_width=44)
    table.add_column("threshold", max_width=24)
    for record in evidence:
        style = STATUS_STYLE[record.status]
        if not record.gates:
            detail = record.error.message if record.error else ""
            table.add_row(record.stage, f"[{style}]{record.status}[/]", escape(detail[:80]), "", "")
            continue
        for index, gate in enumerate(record.gates):
            mark = "[green]ok[/]" if gate.passed else "[red]FAIL[/]"
            table.add_row(record.stage if index == 0 else "", f"[{style}]{record.status}[/]" if index == 0 else "",
                          f"{mark} {gate.name}", escape(measured_cell(gate, _short)), escape(_short(gate.threshold)))
    return table


def _mismatch(stage: Evidence | None) -> dict[str, Any] | None:
    """The training stage's mismatch panel, reduced to what the reports show: the median over steps of
    token_mult_prob_error, the overall k3 KL and importance-ratio range, the per-step error."""
    panel = stage.metrics.get("mismatch") if stage else None
    if not panel or not panel.get("overall", {}).get("tokens"):
        return None
    overall = panel["overall"]
    return {"stage": stage.stage, "median_token_mult_prob_error": panel["median_token_mult_prob_error"],
            "kl_k3": overall["kl_k3"], "ratio_min": overall["ratio_min"], "ratio_max": overall["ratio_max"],
            "effective_sample_size": overall["effective_sample_size"],
            "token_mult_prob_error_per_step": {step: figures["token_mult_prob_error"]
                                               for step, figures in panel["per_step"].items() if figures.get("tokens")}}


def release_verdict(plan: Plan, data: dict[str, Any], evidence: list[Evidence]) -> dict[str, Any] | None:
    """The plan's release conditions (plan.release) applied to one arm: "release", or "hold" naming each
    condition that failed. None when the plan sets no conditions."""
    spec = plan.release
    if spec is None:
        return None
    failed = []
    if not data["passed"]:
        failed.append("every gate passed: " + (", ".join(data["failed_gates"][:3]) or
                                               "not every stage passed (" + ", ".join(
                                                   f"{s} {v}" for s, v in data["stages"].items() if v != "passed") + ")"))
    heldout, retention = data["evaluation"].get("heldout"), data["evaluation"].get("retention")
    if spec.heldout_alpha is not None:
        if not heldout:
            failed.append("held-out improved: not evaluated")
        elif not (heldout["difference"] > 0 and heldout["p_value"] < spec.heldout_alpha):
            failed.append(f"held-out improved at alpha {spec.heldout_alpha:g}: {heldout['base']} -> "
                          f"{heldout['trained']}, p={heldout['p_value']:.3g}")
    if spec.retention is not None:
        if not retention:
            failed.append("retention: not evaluated")
        elif spec.retention == "zero-drop" and retention["trained_k"] < retention["base_k"]:
            failed.append(f"retention zero-drop: {retention['base_k']} -> {retention['trained_k']} of {retention['n']}")
        elif spec.retention == "non-inferior" and not all(
                g.passed for e in evidence for g in e.gates if g.name == "evaluate:retention"):
            failed.append(f"retention non-inferior within {plan.gates.retention_margin:g}: "
                          f"{retention['base']} -> {retention['trained']}")
    if spec.min_pass_hat_k is not None:
        sampled = (heldout or {}).get("sampled") or {}
        k = sampled.get("attempts")
        value = (sampled.get("trained") or {}).get("pass^k", {}).get(str(k))
        if value is None or value < spec.min_pass_hat_k:
            failed.append(f"trained held-out pass^{k or 'k'} >= {spec.min_pass_hat_k:g}: "
                          + (f"{value:.3f}" if value is not None else "no sampled evaluation"))
    if spec.max_token_mult_prob_error is not None:
        mismatch = data.get("mismatch")
        median = mismatch["median_token_mult_prob_error"] if mismatch else None
        if median is None or median > spec.max_token_mult_prob_error:
            failed.append(f"token_mult_prob_error median <= {spec.max_token_mult_prob_error:g}: "
                          + (f"{median:.4f}" if median is not None else "no training logprobs"))
    return {"verdict": "hold" if failed else "release", "failed": failed}


def _seed_rows(plan: Plan, evidence: list[Evidence], trials: dict[int, list[Evidence]]) -> list[dict[str, Any]]:
    """One row per plan seed whose trial the arm runs: its train and evaluate statuses and evaluation."""
    if not any(e.stage in TRIAL_STAGES for e in evidence):
        return []
    rows = []
    for seed in plan.seeds:
        records = [e for e in evidence if e.stage in TRIAL_STAGES] if seed == plan.seeds[0] else trials.get(seed, [])
        evaluate = next((e for e in records if e.stage == "evaluate"), None)
        rows.append({"seed": seed, "stages": {e.stage: e.status for e in records},
                     "evaluation": {k: v for k, v in (evaluate.metrics.items() if evaluate else []) if isinstance(v, dict)}})
    return rows


def summary(plan: Plan, evidence: list[Evidence], trials: dict[int, list[Evidence]] | None = None) -> dict[str, Any]:
    """An arm's figures from its evidence; with several plan seeds, `trials` holds the further seeds' train
    and evaluate evidence: the arm passes only if every trial does, and the evaluation is pooled."""
    trials = trials or {}
    by_stage = {e.stage: e for e in evidence}
    evaluate = by_stage.get("evaluate")
    train = by_stage.get("train")
    update = by_stage.get("update")
    seeds = _seed_rows(plan, evidence, trials)
    labelled = [(e, "") for e in evidence] + [(e, f"@seed-{seed}") for seed in sorted(trials) for e in trials[seed]]
    every = [e for e, _ in labelled]
    trials_complete = all(row["stages"] and all(s in row["stages"] for s in seeds[0]["stages"]) for row in seeds)
    data = {
        "plan_id": plan.plan_id,
        "plan": plan.name,
        "stack": evidence[0].stack if evidence else None,
        "passed": bool(evidence) and all(e.status == "passed" for e in every) and trials_complete,
        "stages": {e.stage: e.status for e in evidence},
        "failed_gates": [f"{e.stage}:{g.name}{seed}" for e, seed in labelled for g in e.gates if not g.passed],
        "errors": {e.stage: msgspec.to_builtins(e.error) for e in evidence if e.error and e.status == "error"},
        "time_to_first_reproducible_update_s": update.metrics.get("time_to_first_reproducible_update_s") if update else None,
        "reward_per_step": train.metrics.get("reward_per_step") if train else None,
        "max_logprob_gap": max((e.metrics.get("max_logprob_gap", 0.0) for e in evidence), default=None),
        "mismatch": _mismatch(train or update),
        "evaluation": {k: v for k, v in (evaluate.metrics.items() if evaluate else []) if isinstance(v, dict)},
        "seeds": seeds,
        "environment": msgspec.to_builtins(evidence[0].environment) if evidence and evidence[0].environment else None,
        "native_asset": native_asset_note(plan),
        "harnesses": evaluate.metrics.get("harnesses", []) if evaluate else [],
    }
    evaluated = [row["evaluation"] for row in seeds if row["evaluation"]]
    if len(evaluated) > 1:
        data["evaluation"] = pooled_evaluation(evaluated, plan.gates.confidence)
    data["release"] = release_verdict(plan, data, every)
    return data


def native_asset_note(plan: Plan) -> str | None:
    """What a native asset's qualification is about, said where its figures are read."""
    native = plan.task.native
    if native is None:
        return None
    source = (f"{native.requirement} from the index, lock and data `{(native.sha256 or '')[:12]}`"
              if native.requirement else f"{native.name}, tree `{(native.sha256 or '')[:12]}`")
    return (f"{native.env} ({source}) in {native.stack}'s own form; "
            "its reward is the asset's own (no reference scorer; checked against its answer key)"
            + ("; with the tiny CPU policy, which was never trained on this task, the qualification is about the "
               "machinery (token truth, attribution, recovery, resume, isolation), not the policy's skill on it"
               if plan.policy.kind == "tiny" else ""))


def markdown(plan: Plan, evidence: list[Evidence], data: dict[str, Any]) -> str:
    env = data.get("environment") or {}
    upstream = env.get("upstream") or {}
    lines = [
        f"# Qualification report: {data['stack']} on {plan.name}",
        "",
        f"- plan_id: `{plan.plan_id}`",
        f"- verdict: **{'all gates passed' if data['passed'] else 'did not qualify'}**",
        *([f"- release: **{data['release']['verdict']}**" + "".join(f"; failed: {c}" for c in data["release"]["failed"])]
          if data.get("release") else []),
        f"- policy: {plan.policy.kind} `{(plan.policy.sha256 or '')[:16]}`",
        f"- environment: engine {env.get('engine')}, Python {env.get('python')}, "
        f"{upstream.get('name')} {upstream.get('version')}, lock `{(env.get('lock_sha256') or '')[:16]}`",
        f"- time to first reproducible update: {data.get('time_to_first_reproducible_update_s')} s",
        *([f"- native asset: {data['native_asset']}"] if data.get("native_asset") else []),
        "",
        "## Gates",
        "",
        *gate_markdown(evidence, _short),
    ]
    if data.get("reward_per_step"):
        lines += ["", "## Mean reward per training step", "", "| step | mean reward |", "|---|---|"]
        lines += [f"| {step} | {reward:.3f} |" for step, reward in data["reward_per_step"].items()]
    if data.get("evaluation"):
        lines += ["", "## Evaluation (greedy decoding, same items for base and trained)", "",
                  "| split | base | trained | difference (CI) | test | p | verdict |", "|---|---|---|---|---|---|---|"]
        for split, row in data["evaluation"].items():
            for label, figures in [(split, row), *([(f"{split}: matched SFT baseline -> distilled", row["baseline"])]
                                                   if row.get("baseline") else [])]:
                low, high = figures["difference_ci"]
                lines.append(f"| {label} | {figures['base']} | {figures['trained']} | {figures['difference']:+.3f} "
                             f"({low:+.3f}..{high:+.3f}) | {figures['test']} | {figures['p_value']:.3g} | "
                             f"{figures['verdict']} |")
        lines += ["", "Small evaluation sets rarely separate base and trained; 'inconclusive' means the "
                  "data cannot tell them apart at this confidence, not that nothing changed."]
        sampled = {split: row["sampled"] for split, row in data["evaluation"].items() if row.get("sampled")}
        if sampled:
            lines += ["", "## Sampled evaluation (pass@1 and pass^k, tau2-bench's definition)", "",
                      "| split | attempts | items (excluded) | base pass@1 | trained pass@1 | base pass^k | trained pass^k |",
                      "|---|---|---|---|---|---|---|"]
            for split, row in sampled.items():
                k = str(row["attempts"])
                cells = [(row.get(p) or {}).get("pass@1") for p in ("base", "trained")]
                cells += [(row.get(p) or {}).get("pass^k", {}).get(k) for p in ("base", "trained")]
                lines.append(f"| {split} | {k} | {row['items']} ({row['excluded_items']}) | "
                             + " | ".join("–" if c is None else f"{c:.3f}" for c in cells) + " |")
    if data.get("harnesses"):
        lines += ["", "## Evaluation harnesses (each checkpoint served greedily by the trainer's policy server)", "",
                  "| harness | task | metric | base | trained | difference (CI) | test | p | verdict |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row in data["harnesses"]:
            lines.append(harness_line(row))
    if len(data.get("seeds") or []) > 1:
        lines += ["", "## Seeds (one trial per plan seed; the evaluation above pools them)", "",
                  "| seed | train | evaluate | held-out trained | retention trained |", "|---|---|---|---|---|"]
        for row in data["seeds"]:
            evaluation = row["evaluation"]
            lines.append(f"| {row['seed']} | {row['stages'].get('train', '–')} | {row['stages'].get('evaluate', '–')} | "
                         + " | ".join(evaluation[split]["trained"] if split in evaluation else "–"
                                      for split in ("heldout", "retention")) + " |")
    return "\n".join(lines) + "\n"


def harness_line(row: dict[str, Any]) -> str:
    """A harness's row: each checkpoint's headline (± its standard error, over n samples) and, for 0/1 scores,
    the paired comparison on the same samples."""
    def figure(label: str) -> str:
        value, stderr = row[label]["value"], row[label].get("stderr")
        return ("–" if value is None else f"{value:.3f}" + (f" ± {stderr:.3f}" if stderr is not None else "")
                + f" (n={row[label]['samples']})")

    paired = row.get("paired")
    tail = (f"{paired['difference']:+.3f} ({paired['difference_ci'][0]:+.3f}..{paired['difference_ci'][1]:+.3f}) | "
            f"{paired['test']} | {paired['p_value']:.3g} | {paired['verdict']}") if paired else "– | – | – | –"
    return (f"| {row['stack']} ({row.get('upstream') or '?'}) | {row.get('task')} | {row.get('metric')} | "
            f"{figure('base')} | {figure('trained')} | {tail} |")


def write_report(run_dir: Path) -> dict[str, Any]:
    """report.md, report.html (self-contained) and summary.json from the run's plan and evidence."""
    plan, evidence = load_run(run_dir)
    if isinstance(plan, DomainPlan):
        data = domain_summary(plan, evidence, load_trials(run_dir, plan))
        write_redacted(run_dir / "report.md", domain_markdown(plan, evidence, data))
        write_redacted(run_dir / "report.html", domain_html(f"Qualification: {data['stack']} on {plan.name}",
                                                           [(data["stack"] or "arm", plan, evidence, data)]))
        write_redacted(run_dir / "summary.json", json.dumps(data, indent=2, sort_keys=True) + "\n")
        return data
    data = summary(plan, evidence, load_trials(run_dir, plan))
    write_redacted(run_dir / "report.md", markdown(plan, evidence, data))
    write_redacted(run_dir / "report.html", render_html(plan, [(data["stack"] or "arm", evidence, data)]))
    write_redacted(run_dir / "summary.json", json.dumps(data, indent=2, sort_keys=True) + "\n")
    return data
