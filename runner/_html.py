"""A self-contained HTML report (inline CSS, SVG and a few lines of JS; no network fetches)."""

from __future__ import annotations

import datetime as dt
import html
import json
from collections.abc import Callable
from typing import Any

from qualification.stats import wilson
from runner_contracts import Evidence, GateResult, Plan


PALETTE = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2"]

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1100px;color:#111827;padding:0 1rem}
h1{font-size:1.5rem;margin-bottom:.2rem}h2{font-size:1.15rem;margin-top:2rem;border-bottom:1px solid #e5e7eb;padding-bottom:.3rem}
.meta{color:#4b5563}.badge{display:inline-block;padding:.15rem .6rem;border-radius:999px;font-weight:600}
.pass{background:#dcfce7;color:#166534}.fail{background:#fee2e2;color:#991b1b}.skip{background:#f3f4f6;color:#6b7280}
table{border-collapse:collapse;width:100%;margin:.5rem 0}th,td{border:1px solid #e5e7eb;padding:.3rem .5rem;text-align:left;vertical-align:top}
th{background:#f9fafb}td.num{text-align:right;font-variant-numeric:tabular-nums}.detail{color:#4b5563;font-size:12px}
.cell{width:1.1rem;height:1.1rem;border-radius:3px;display:inline-block}.cell.pass{background:#16a34a}.cell.fail{background:#dc2626}
.cell.skip{background:#d1d5db}svg text{font:12px system-ui,sans-serif;fill:#374151}.note{color:#6b7280;font-size:12px}
button{font:inherit;padding:.2rem .6rem;margin:.2rem 0}
"""

SCRIPT = """
document.body.dataset.ready = 'yes';
document.getElementById('toggle-passed').addEventListener('click', function () {
  var rows = document.querySelectorAll('tr.gate-passed');
  var hide = this.dataset.hidden !== 'yes';
  rows.forEach(function (row) { row.style.display = hide ? 'none' : ''; });
  this.dataset.hidden = hide ? 'yes' : 'no';
  this.textContent = hide ? 'Show passed gates' : 'Show failed gates only';
});
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    text = json.dumps(value) if isinstance(value, (list, dict)) else str(value if value is not None else "")
    return text if len(text) <= 48 else text[:45] + "..."


def measured_cell(gate: GateResult, short: Callable[[Any], str] = _short) -> str:
    """A gate's measured figure, marked where it is the adapter's word rather than the host's finding."""
    cell = short(gate.measured)
    return f"{cell} (adapter's report)" if gate.reported_by == "adapter" else cell


def gate_markdown(evidence: list[Evidence], short: Callable[[Any], str] = _short) -> list[str]:
    """The markdown table of every stage's gates (a stage without gates: its status and error)."""
    lines = ["| stage | status | gate | passed | measured | threshold | detail |", "|---|---|---|---|---|---|---|"]
    for record in evidence:
        if not record.gates:
            lines.append(f"| {record.stage} | {record.status} | | | | | {record.error.message if record.error else ''} |")
        for gate in record.gates:
            detail = gate.detail.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {record.stage} | {record.status} | {gate.name} | {'yes' if gate.passed else 'NO'} | "
                         f"{measured_cell(gate, short)} | {short(gate.threshold)} | {detail} |")
    return lines


def _duration(evidence: Evidence) -> float:
    try:
        return (dt.datetime.fromisoformat(evidence.finished_at) - dt.datetime.fromisoformat(evidence.started_at)).total_seconds()
    except ValueError:
        return 0.0


def gate_matrix(arms: list[tuple[str, list[Evidence]]]) -> str:
    """Rows: stage/gate; columns: arms; a coloured cell per outcome."""
    names: list[tuple[str, str]] = []
    outcome: dict[tuple[str, str, str], str] = {}
    for arm, evidence in arms:
        for record in evidence:
            if not record.gates:
                key = (record.stage, f"({record.status})")
                names.append(key) if key not in names else None
                outcome[(arm, *key)] = "skip" if record.status == "skipped" else "fail"
            for gate in record.gates:
                key = (record.stage, gate.name)
                if key not in names:
                    names.append(key)
                outcome[(arm, *key)] = "pass" if gate.passed else "fail"
    head = "".join(f"<th>{_e(arm)}</th>" for arm, _ in arms)
    rows = []
    for stage, name in names:
        cells = "".join(
            f'<td><span class="cell {outcome.get((arm, stage, name), "skip")}" '
            f'title="{_e(outcome.get((arm, stage, name), "not run"))}"></span></td>' for arm, _ in arms)
        rows.append(f"<tr><td>{_e(stage)}</td><td>{_e(name)}</td>{cells}</tr>")
    return f"<table><tr><th>stage</th><th>gate</th>{head}</tr>{''.join(rows)}</table>"


def gate_details(arm: str, evidence: list[Evidence]) -> str:
    rows = []
    for record in evidence:
        if not record.gates:
            message = record.error.message if record.error else ""
            rows.append(f'<tr class="gate-{"passed" if record.status == "passed" else "failed"}"><td>{_e(record.stage)}</td>'
                        f'<td><span class="badge {"skip" if record.status == "skipped" else "fail"}">{_e(record.status)}'
                        f'</span></td><td colspan="3" class="detail">{_e(message)}</td></tr>')
        for gate in record.gates:
            state = "passed" if gate.passed else "failed"
            rows.append(f'<tr class="gate-{state}"><td>{_e(record.stage)}</td><td><span class="badge '
                        f'{"pass" if gate.passed else "fail"}">{_e(gate.name)}</span></td>'
                        f'<td class="num">{_e(measured_cell(gate))}</td><td class="num">{_e(_short(gate.threshold))}</td>'
                        f'<td class="detail">{_e(gate.detail)}</td></tr>')
    return (f"<h3>{_e(arm)}</h3><table><tr><th>stage</th><th>gate</th><th>measured</th><th>threshold</th>"
            f"<th>detail</th></tr>{''.join(rows)}</table>")


def sampled_text(row: dict[str, Any]) -> str:
    """A split's sampled figures in one cell: pass@1 and pass^k, base -> trained."""
    sampled = row.get("sampled")
    if not sampled:
        return "–"
    k = str(sampled["attempts"])
    base, trained = (sampled.get(policy) or {} for policy in ("base", "trained"))
    return (f"{base.get('pass@1', 0):.2f} → {trained.get('pass@1', 0):.2f}; pass^{k} "
            f"{base.get('pass^k', {}).get(k, 0):.2f} → {trained.get('pass^k', {}).get(k, 0):.2f}")


def _detectable(row: dict[str, Any]) -> str:
    value = row.get("detectable_difference")
    return f"&ge; {value:.0%}" if value is not None else "–"


def line_chart(series: dict[str, dict[int, float]], *, width: int = 640, height: int = 240, y_label: str,
               y_range: tuple[float, float] = (0.0, 1.0)) -> str:
    """A figure per training step, one line per arm; the y axis spans at least `y_range`."""
    points = [(s, v) for values in series.values() for s, v in values.items()]
    if not points:
        return '<p class="note">no training steps recorded</p>'
    left, right, top, bottom = 50, 20, 15, 35
    max_step = max(s for s, _ in points)
    low, high = min(y_range[0], min(v for _, v in points)), max(y_range[1], max(v for _, v in points))
    def x(step: float) -> float:
        return left + (step - 1) / max(1, max_step - 1) * (width - left - right)
    def y(value: float) -> float:
        return top + (high - value) / (high - low) * (height - top - bottom)
    parts = [f'<svg width="{width}" height="{height}" role="img" aria-label="{_e(y_label)} per step">']
    for tick in (low, (low + high) / 2, high):
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#e5e7eb"/>'
                     f'<text x="{left - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick:.3g}</text>')
    for step in range(1, max_step + 1):
        parts.append(f'<text x="{x(step):.1f}" y="{height - bottom + 16}" text-anchor="middle">{step}</text>')
    parts.append(f'<text x="{(left + width - right) / 2}" y="{height - 4}" text-anchor="middle">optimizer step</text>')
    for index, (arm, values) in enumerate(series.items()):
        colour = PALETTE[index % len(PALETTE)]
        path = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in sorted(values.items()))
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{path}"/>')
        parts += [f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="3" fill="{colour}"><title>{_e(arm)} step {s}: '
                  f'{v:.3f}</title></circle>' for s, v in sorted(values.items())]
        parts.append(f'<text x="{width - right - 4}" y="{top + 14 * (index + 1)}" text-anchor="end" '
                     f'fill="{colour}">{_e(arm)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def ci_bars(rows: list[tuple[str, int, int]], *, width: int = 640, confidence: float = 0.95) -> str:
    """Horizontal success-rate bars with Wilson intervals; rows are (label, k, n)."""
    bar_height, gap, left, right = 18, 10, 210, 90
    height = len(rows) * (bar_height + gap) + 30
    scale = width - left - right
    parts = [f'<svg width="{width}" height="{height}" role="img" aria-label="success rates with {confidence:.0%} CIs">']
    for tick in (0, 0.25, 0.5, 0.75, 1.0):
        xpos = left + tick * scale
        parts.append(f'<line x1="{xpos:.1f}" x2="{xpos:.1f}" y1="0" y2="{height - 22}" stroke="#e5e7eb"/>'
                     f'<text x="{xpos:.1f}" y="{height - 6}" text-anchor="middle">{tick:.0%}</text>')
    for index, (label, k, n) in enumerate(rows):
        top = index * (bar_height + gap) + 4
        rate = k / n if n else 0.0
        low, high = wilson(k, n, confidence)
        colour = PALETTE[0] if "base" in label else PALETTE[2]
        parts.append(f'<text x="{left - 8}" y="{top + 13}" text-anchor="end">{_e(label)}</text>'
                     f'<rect x="{left}" y="{top}" width="{rate * scale:.1f}" height="{bar_height}" fill="{colour}" '
                     f'opacity="0.8"><title>{k}/{n}</title></rect>'
                     f'<line x1="{left + low * scale:.1f}" x2="{left + high * scale:.1f}" y1="{top + bar_height / 2}" '
                     f'y2="{top + bar_height / 2}" stroke="#111827" stroke-width="2"/>'
                     f'<line x1="{left + low * scale:.1f}" x2="{left + low * scale:.1f}" y1="{top + 3}" '
                     f'y2="{top + bar_height - 3}" stroke="#111827" stroke-width="2"/>'
                     f'<line x1="{left + high * scale:.1f}" x2="{left + high * scale:.1f}" y1="{top + 3}" '
                     f'y2="{top + bar_height - 3}" stroke="#111827" stroke-width="2"/>'
                     f'<text x="{width - right + 8}" y="{top + 13}">{k}/{n} ({rate:.0%})</text>')
    parts.append("</svg>")
    return "".join(parts)


def comparison_table(names: list[str], rows: list[tuple[str, list[str]]]) -> str:
    head = "".join(f"<th>{_e(name)}</th>" for name in names)
    body = "".join(f"<tr><th>{_e(label)}</th>{''.join(f'<td>{_e(cell)}</td>' for cell in cells)}</tr>"
                   for label, cells in rows)
    return f"<table><tr><th></th>{head}</tr>{body}</table>"


def render(plan: Plan, arms: list[tuple[str, list[Evidence], dict[str, Any]]],
           comparison: tuple[list[str], list[tuple[str, list[str]]]] | None = None,
           arm_tests: dict[str, Any] | None = None, pin_lines: list[str] | None = None) -> str:
    """One page for one run (one arm) or a comparison (several arms on the same plan); `pin_lines` say what
    changed between two pins of one stack (runner._compare.pin_lines)."""
    passed_all = all(data["passed"] for _, _, data in arms)
    title = f"Qualification: {', '.join(arm for arm, _, _ in arms)} on {plan.name}"
    sections = [f"<h1>{_e(title)}</h1>",
                f'<p class="meta">plan_id <code>{_e(plan.plan_id)}</code> · policy {_e(plan.policy.kind)} '
                f'<code>{_e((plan.policy.sha256 or "")[:16])}</code> · recipe {_e(plan.recipe)} · '
                f'<span class="badge {"pass" if passed_all else "fail"}">'
                f'{"every gate passed" if passed_all else "not qualified"}</span></p>']
    releases = [(arm, data["release"]) for arm, _, data in arms if data.get("release")]
    if releases:
        rows = "".join(f"<tr><td>{_e(arm)}</td><td><span class='badge {'pass' if r['verdict'] == 'release' else 'fail'}'>"
                       f"{_e(r['verdict'])}</span></td><td>{_e('; '.join(r['failed']) or 'every condition met')}</td></tr>"
                       for arm, r in releases)
        sections.append(f"<h2>Release</h2><table><tr><th>arm</th><th>verdict</th><th>conditions not met</th></tr>"
                        f"{rows}</table>")
    if comparison is not None:
        sections.append("<h2>Side by side</h2>" + comparison_table(*comparison))
    for line in pin_lines or []:
        sections.append(f"<h2>{_e(line[3:])}</h2>" if line.startswith("## ") else
                        f"<p>{_e(line[2:])}</p>" if line.startswith("- ") else "")
    for split, found in (arm_tests or {}).items():
        rows = "".join(f"<tr><td>{_e(p['first'])} vs {_e(p['second'])}</td><td class='num'>{p['first_k']} vs "
                       f"{p['second_k']} of {p['n']}</td><td class='num'>{p['p_holm']:.3g}</td>"
                       f"<td><b>{_e(p['verdict'])}</b></td></tr>" for p in found["pairs"])
        sections.append(f"<h2>Arm against arm: {_e(split)}</h2><p><b>{_e(found['ranking'])}</b></p><table><tr>"
                        f"<th>pair</th><th>solved (or summed success rates)</th><th>p (Holm)</th><th>verdict</th></tr>{rows}"
                        f"</table><p class='note'>{_e(found['test'])}</p>")
    bars, verdicts = [], []
    for arm, _, data in arms:
        for split, row in (data.get("evaluation") or {}).items():
            bars += [(f"{arm} {split} base", row["base_k"], row["n"]), (f"{arm} {split} trained", row["trained_k"], row["n"])]
            low, high = row["difference_ci"]
            verdicts.append(f"<tr><td>{_e(arm)}</td><td>{_e(split)}</td><td>{_e(row['base'])}</td>"
                            f"<td>{_e(row['trained'])}</td><td class='num'>{row['difference']:+.3f} "
                            f"({low:+.3f}..{high:+.3f})</td><td>{_e(row['test'])}</td>"
                            f"<td class='num'>{row['p_value']:.3g}</td><td><b>{_e(row['verdict'])}</b></td>"
                            f"<td class='num'>{_detectable(row)}</td><td>{_e(sampled_text(row))}</td></tr>")
    seed_rows = "".join(
        f"<tr><td>{_e(arm)}</td><td class='num'>{row['seed']}</td>"
        + "".join(f"<td>{_e(row['stages'].get(stage, '–'))}</td>" for stage in ("train", "evaluate"))
        + "".join(f"<td>{_e(row['evaluation'][split]['trained']) if split in row['evaluation'] else '–'}</td>"
                  for split in ("heldout", "retention")) + "</tr>"
        for arm, _, data in arms if len(data.get("seeds") or []) > 1 for row in data["seeds"])
    if seed_rows:
        sections.append("<h2>Seeds</h2><table><tr><th>arm</th><th>seed</th><th>train</th><th>evaluate</th>"
                        f"<th>held-out trained</th><th>retention trained</th></tr>{seed_rows}</table>"
                        '<p class="note">One trial (train, evaluate) per plan seed; the figures above pool them.</p>')
    if bars:
        sections.append("<h2>Held-out and retention success (95% Wilson intervals)</h2>" + ci_bars(bars) +
                        "<table><tr><th>arm</th><th>split</th><th>base</th><th>trained</th><th>difference (CI)</th>"
                        f"<th>test</th><th>p</th><th>verdict</th><th>detectable at 80% power</th>"
                        f"<th>sampled: pass@1, pass^k (base → trained)</th></tr>"
                        f"{''.join(verdicts)}</table>"
                        '<p class="note">Small evaluation sets rarely separate base and trained: "inconclusive" '
                        "means the data cannot tell them apart at this confidence, not that nothing changed; the last "
                        "column is the smallest difference these items could have shown (exact McNemar, normal "
                        "approximation of its power).</p>")
    harness_rows = "".join(
        f"<tr><td>{_e(arm)}</td><td>{_e(row['stack'])} ({_e(row.get('upstream'))})</td><td>{_e(row.get('task'))}</td>"
        f"<td>{_e(row.get('metric'))}</td>"
        + "".join(f"<td class='num'>{_short(row[label]['value'])} ± {_short(row[label].get('stderr'))} "
                  f"(n={row[label]['samples']})</td>" for label in ("base", "trained"))
        + (f"<td class='num'>{row['paired']['p_value']:.3g}</td><td><b>{_e(row['paired']['verdict'])}</b></td>"
           if row.get("paired") else "<td>–</td><td>–</td>") + "</tr>"
        for arm, _, data in arms for row in data.get("harnesses") or [])
    if harness_rows:
        sections.append("<h2>Evaluation harnesses</h2><table><tr><th>arm</th><th>harness</th><th>task</th>"
                        "<th>metric</th><th>base</th><th>trained</th><th>p (exact McNemar)</th><th>verdict</th></tr>"
                        f"{harness_rows}</table><p class='note'>Each checkpoint served greedily by the trainer's "
                        "policy server; the harness ran in its own environment, every call it made tied to a sample "
                        "it scored. Logs: stages/evaluate/harnesses/.</p>")
    sections.append("<h2>Mean reward per training step</h2>" + line_chart(
        {arm: {int(k): float(v) for k, v in (data.get("reward_per_step") or {}).items()} for arm, _, data in arms},
        y_label="mean reward"))
    mismatch = {arm: {int(k): float(v) for k, v in data["mismatch"]["token_mult_prob_error_per_step"].items()}
                for arm, _, data in arms if data.get("mismatch")}
    if mismatch:
        sections.append("<h2>Train-inference mismatch per training step</h2>" + line_chart(
            mismatch, y_label="token_mult_prob_error", y_range=(1.0, 1.1)) + '<p class="note">mean exp|log p_train - log p_sample| over '
            "the sampled tokens (NeMo RL's token_mult_prob_error; 1 = the trainer and the sampler agree; the gate "
            "asks the median over steps to stay below 1.1). The full panel (KL, chi-square, importance ratios, "
            "effective sample size) is in each stage's evidence under metrics.mismatch.</p>")
    fidelity = []
    for arm, evidence, data in arms:
        for record in evidence:
            m = record.metrics
            if "episodes" in m or "trained_tokens" in m:
                fidelity.append(f"<tr><td>{_e(arm)}</td><td>{_e(record.stage)}</td><td class='num'>{m.get('episodes', '')}</td>"
                                f"<td class='num'>{m.get('trained_tokens', '')}</td>"
                                f"<td class='num'>{_short(m.get('max_logprob_gap', ''))}</td>"
                                f"<td class='num'>{_short((m.get('mismatch') or {}).get('median_token_mult_prob_error', ''))}</td>"
                                f"<td class='num'>{m.get('groups_with_variance', '')}/{m.get('groups', '')}</td></tr>")
    if fidelity:
        sections.append("<h2>Trace fidelity</h2><table><tr><th>arm</th><th>stage</th><th>episodes</th>"
                        "<th>trained tokens</th><th>max logprob gap</th><th>token_mult_prob_error (median)</th>"
                        "<th>groups with reward variance</th></tr>"
                        + "".join(fidelity) + "</table>")
    sections.append("<h2>Gate matrix</h2>" + gate_matrix([(arm, evidence) for arm, evidence, _ in arms]))
    timing = "".join(f"<tr><td>{_e(arm)}</td><td>{_e(record.stage)}</td><td class='num'>{_duration(record):.1f} s</td></tr>"
                     for arm, evidence, _ in arms for record in evidence)
    first = "".join(f"<tr><td>{_e(arm)}</td><td colspan='2'>time to first reproducible update: "
                    f"{_e(data.get('time_to_first_reproducible_update_s'))} s</td></tr>" for arm, _, data in arms)
    sections.append(f"<h2>Timings</h2><table><tr><th>arm</th><th>stage</th><th>wall clock</th></tr>{timing}{first}</table>")
    sections.append('<h2>All gates</h2><button id="toggle-passed" type="button">Show failed gates only</button>'
                    + "".join(gate_details(arm, evidence) for arm, evidence, _ in arms))
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f"<style>{CSS}</style></head><body>{''.join(sections)}<script>{SCRIPT}</script></body></html>\n")
