"""Reports of domain runs (runner_contracts.domain): summary.json, report.md and report.html for one run, and the
same page for several runs of a domain stack side by side (two model sizes, two pins): native metrics with
their intervals, base against trained, from each run's evidence only."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from runner_contracts import DomainPlan, Evidence

from ._errors import UserError
from ._html import CSS, SCRIPT, _e, comparison_table, gate_details, gate_markdown, gate_matrix, line_chart
from ._secrets import write_redacted

if TYPE_CHECKING:
    from rich.table import Table

SYNTHETIC = ("The data is synthetic: made locally by the stack's own recipe (stage service, metrics.data), never "
             "downloaded; its figures qualify the machinery and the native protocol, not a model for real materials "
             "or robots.")


def domain_summary(plan: DomainPlan, evidence: list[Evidence],
                   trials: dict[int, list[Evidence]] | None = None) -> dict[str, Any]:
    trials = trials or {}
    by_stage = {e.stage: e for e in evidence}
    labelled = [(e, "") for e in evidence] + [(e, f"@seed-{seed}") for seed in sorted(trials) for e in trials[seed]]
    complete = all(len(trials.get(seed, [])) == len([e for e in evidence if e.stage in ("train", "evaluate")])
                   for seed in plan.seeds[1:])
    evaluate, train, service = by_stage.get("evaluate"), by_stage.get("train"), by_stage.get("service")
    update = by_stage.get("update")
    seeds = [{"seed": plan.seeds[0], "native": evaluate.metrics.get("native", {}) if evaluate else {}}]
    for seed in plan.seeds[1:]:
        found = next((e for e in trials.get(seed, []) if e.stage == "evaluate"), None)
        seeds.append({"seed": seed, "native": found.metrics.get("native", {}) if found else {}})
    return {
        "kind": "domain",
        "plan_id": plan.plan_id,
        "plan": plan.name,
        "stack": evidence[0].stack if evidence else None,
        "passed": bool(evidence) and all(e.status == "passed" for e, _ in labelled) and complete,
        "stages": {e.stage: e.status for e in evidence},
        "failed_gates": [f"{e.stage}:{g.name}{seed}" for e, seed in labelled for g in e.gates if not g.passed],
        "errors": {e.stage: msgspec.to_builtins(e.error) for e in evidence if e.error and e.status == "error"},
        "environment": msgspec.to_builtins(evidence[0].environment) if evidence and evidence[0].environment else None,
        "time_to_first_reproducible_update_s": update.metrics.get("time_to_first_reproducible_update_s") if update else None,
        "loss_per_step": dict(enumerate(train.metrics.get("loss", []), start=1)) if train else {},
        "items_per_s": train.metrics.get("items_per_s") if train else None,
        "data": service.metrics.get("data", {}) if service else {},
        "headline": plan.headline,
        "native": evaluate.metrics.get("native", {}) if evaluate else {},
        "seeds": seeds,
        "synthetic": any(split.get("synthetic") for split in (service.metrics.get("data", {}) if service else {}).values()),
    }


def _value(figure: dict[str, Any]) -> str:
    value, (low, high) = figure["value"], figure["interval"]
    if value is None:
        return "undefined"
    return f"{value:.4g} [{low:.4g}, {high:.4g}]" if low is not None else f"{value:.4g}"


def native_rows(data: dict[str, Any]) -> list[list[str]]:
    """metric, base [CI], trained [CI], difference [CI], verdict: one row per native metric."""
    rows = []
    for name, row in data.get("native", {}).items():
        low, high = row["difference_interval"]
        difference = ("–" if row["difference"] is None else f"{row['difference']:+.4g}"
                      + (f" [{low:+.4g}, {high:+.4g}]" if low is not None else ""))
        mark = " (headline)" if name == data.get("headline") else ""
        unit = f" ({row['unit']})" if row.get("unit") else ""
        rows.append([f"{name}{unit}{mark}, {row['direction']} is better", _value(row["base"]), _value(row["trained"]),
                     difference + (f", p={row['p_value']:.3g}" if "p_value" in row else ""), row["verdict"]])
    return rows


def native_table(data: dict[str, Any]) -> Table:
    """The terminal's table of a domain run's native metrics."""
    from rich.table import Table

    table = Table(title=f"native metrics on the held-out split ({'synthetic data' if data.get('synthetic') else 'data'})")
    for column in ("metric", "base [CI]", "trained [CI]", "trained - base [CI]", "verdict"):
        table.add_column(column)
    for row in native_rows(data):
        table.add_row(*row[:4], f"[bold]{row[4]}[/]")
    return table


def domain_markdown(plan: DomainPlan, evidence: list[Evidence], data: dict[str, Any]) -> str:
    env = data.get("environment") or {}
    upstream = env.get("upstream") or {}
    lines = [f"# Qualification report: {data['stack']} on {plan.name} (domain plan)", "",
             f"- plan_id: `{plan.plan_id}`",
             f"- verdict: **{'all gates passed' if data['passed'] else 'did not qualify'}**",
             f"- model: {plan.domain} {msgspec.to_builtins(plan.model)}; budget: {plan.budget.steps} steps, "
             f"batch {plan.budget.batch_size}, learning rate {plan.budget.learning_rate:g}",
             f"- environment: engine {env.get('engine')}, Python {env.get('python')}, "
             f"{upstream.get('name')} {upstream.get('version')}, lock `{(env.get('lock_sha256') or '')[:16]}`",
             f"- time to first reproducible update: {data.get('time_to_first_reproducible_update_s')} s; "
             f"training throughput {data.get('items_per_s')} items/s",
             "", "## Data", ""]
    lines += [f"- {split}: {d['items']} items, sha256 `{d['sha256'][:16]}`, {d['detail']}" for split, d in data["data"].items()]
    if data.get("synthetic"):
        lines += ["", SYNTHETIC]
    if data.get("native"):
        lines += ["", "## Native metrics, held-out split: base (initial weights) and trained, same items", "",
                  "| metric | base [CI] | trained [CI] | trained - base [CI] | verdict |", "|---|---|---|---|---|"]
        lines += ["| " + " | ".join(row) + " |" for row in native_rows(data)]
        first = next(iter(data["native"].values()))
        lines += ["", f"Intervals: {first['test']}. 'inconclusive' means these items cannot tell base and trained "
                  "apart at this confidence."]
    if len(data.get("seeds") or []) > 1:
        lines += ["", f"## Seeds: {data['headline']} per plan seed", "", "| seed | base | trained | verdict |", "|---|---|---|---|"]
        for row in data["seeds"]:
            figure = row["native"].get(data["headline"])
            lines.append(f"| {row['seed']} | " + (f"{_value(figure['base'])} | {_value(figure['trained'])} | {figure['verdict']}"
                                                  if figure else "– | – | –") + " |")
    if data.get("loss_per_step"):
        lines += ["", "## Training loss per step", "", "| step | loss |", "|---|---|"]
        lines += [f"| {step} | {loss:.6g} |" for step, loss in data["loss_per_step"].items()]
    lines += ["", "## Gates", "", *gate_markdown(evidence)]
    return "\n".join(lines) + "\n"


def domain_html(title: str, arms: list[tuple[str, DomainPlan, list[Evidence], dict[str, Any]]]) -> str:
    """One page for one domain run or several side by side (each its own plan: two model sizes, two pins)."""
    passed = all(data["passed"] for *_, data in arms)
    plans = "; ".join(f"{_e(name)}: plan <code>{_e((plan.plan_id or '')[:12])}</code>" for name, plan, _, _ in arms)
    verdict = "every gate passed" if passed else "not qualified"
    sections = [f"<h1>{_e(title)}</h1>",
                f'<p class="meta">{plans} · <span class="badge {"pass" if passed else "fail"}">{verdict}</span></p>']
    names = [name for name, *_ in arms]
    metrics = list(dict.fromkeys(metric for *_, data in arms for metric in data.get("native", {})))
    if metrics:
        def cell(data: dict[str, Any], metric: str) -> str:
            row = data.get("native", {}).get(metric)
            return f"{_value(row['base'])} → {_value(row['trained'])}: {row['verdict']}" if row else "–"

        sections.append("<h2>Native metrics, held-out split: base → trained [CI]</h2>" + comparison_table(
            names, [(metric, [cell(data, metric) for *_, data in arms]) for metric in metrics]
            + [("model", [str(msgspec.to_builtins(plan.model)) for _, plan, _, _ in arms]),
               ("upstream", [f"{(data.get('environment') or {}).get('upstream', {}).get('name')} "
                             f"{(data.get('environment') or {}).get('upstream', {}).get('version')}" for *_, data in arms]),
               ("time to first reproducible update (s)", [str(data.get("time_to_first_reproducible_update_s")) for *_, data in arms]),
               ("training items/s", [str(data.get("items_per_s")) for *_, data in arms])]))
        first = next(iter(arms[0][3].get("native", {}).values()), None)
        if first:
            sections.append(f'<p class="note">Intervals: {_e(first["test"])}.</p>')
    if any(data.get("synthetic") for *_, data in arms):
        sections.append(f'<p class="note">{_e(SYNTHETIC)}</p>')
    sections.append("<h2>Training loss per step</h2>" + line_chart(
        {name: {int(k): float(v) for k, v in data.get("loss_per_step", {}).items()} for name, _, _, data in arms},
        y_label="loss", y_range=(0.0, 0.0)))
    sections.append("<h2>Gate matrix</h2>" + gate_matrix([(name, evidence) for name, _, evidence, _ in arms]))
    sections.append('<h2>All gates</h2><button id="toggle-passed" type="button">Show failed gates only</button>'
                    + "".join(gate_details(name, evidence) for name, _, evidence, _ in arms))
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f"<style>{CSS}</style></head><body>{''.join(sections)}<script>{SCRIPT}</script></body></html>\n")


def write_side_by_side(run_dir: Path, others: list[Path]) -> tuple[Path, list[dict[str, Any]]]:
    """side-by-side.html in `run_dir`: it and `others`, domain runs of one stack, each named by its folder."""
    from ._report import load_run, load_trials

    arms = []
    for folder in [run_dir, *others]:
        plan, evidence = load_run(folder)
        if not isinstance(plan, DomainPlan):
            raise UserError(f"{folder}: --beside sets domain runs side by side; this is a language-model run "
                            "(compare those with `runner compare`)")
        arms.append((folder.name, plan, evidence, domain_summary(plan, evidence, load_trials(folder, plan))))
    stacks = sorted({plan.domain for _, plan, _, _ in arms})
    if len(stacks) > 1:
        raise UserError(f"--beside: runs of one domain stack only, got {', '.join(stacks)}")
    path = run_dir / "side-by-side.html"
    write_redacted(path, domain_html(f"{stacks[0]}: {', '.join(name for name, *_ in arms)}", arms))
    return path, [{"run": name, **data} for name, _, _, data in arms]
