"""Comparing arms of one plan: the per-arm figures DESIGN.md names, from each arm's evidence only."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from qualification.stats import pairwise_arms
from runner_contracts import EvalRecord, Evidence, Plan, RecordError, read_jsonl

from ._errors import UserError
from ._html import render as render_html
from ._html import sampled_text
from ._report import load_run, load_trials, summary
from ._secrets import write_redacted
from ._stacks import get_stack
from ._stages import RECIPE_STAGES, STAGES, trial_dir


def _metrics(evidence: list[Evidence], stage: str) -> dict[str, Any]:
    return next((e.metrics for e in evidence if e.stage == stage), {})


def _final_weights(evidence: list[Evidence]) -> str | None:
    train = next((e for e in evidence if e.stage == "train"), None)
    return max(train.checkpoints, key=lambda c: c.step).sha256 if train and train.checkpoints else None


def _gate(evidence: list[Evidence], name: str) -> bool | None:
    for record in evidence:
        for gate in record.gates:
            if gate.name == name:
                return gate.passed
    return None


def arm_figures(stack: str, evidence: list[Evidence], data: dict[str, Any]) -> dict[str, Any]:
    """One arm's row of the comparison."""
    rollout, train, probe = _metrics(evidence, "rollout"), _metrics(evidence, "train"), _metrics(evidence, "probe")
    stages = [rollout, _metrics(evidence, "update"), train]
    environment = data.get("environment") or {}
    upstream = environment.get("upstream") or {}
    calls = sum(m.get("policy_calls", 0) for m in stages)
    stack_rows = sum(m.get("rows_from_stack_capture", 0) for m in stages)
    return {
        "stack": stack,
        "upstream": f"{upstream.get('name')}=={upstream.get('version')}",
        "trainer": train.get("trainer") or _metrics(evidence, "update").get("trainer"),
        "python": environment.get("python"),
        "deviations": environment.get("deviations") or [],
        "passed": data["passed"],
        "gates": {e.stage: e.status for e in evidence},
        "failed_gates": data["failed_gates"],
        "trace_fidelity": {
            "token_source": ("stack capture (gateway), audited against the policy server" if stack_rows else
                             "policy server capture" if calls else "trainer's own sampled ids"),
            "attribution_channel": probe.get("episode_id_channel") or "in-process (no policy server)",
            "policy_calls": calls,
            "unattributed_calls": sum(m.get("unattributed_calls", 0) for m in stages),
            "continuity_breaks": sum(m.get("continuity_breaks", 0) for m in stages),
            "max_logprob_gap": data.get("max_logprob_gap"),
            "trained_equals_sampled": _gate(evidence, "trace:trained-equals-sampled"),
            "mismatch": data.get("mismatch"),
        },
        "recovery": {
            "resume_passed": next((e.status == "passed" for e in evidence if e.stage == "resume"), None),
            "injected_environment_crash": rollout.get("recovery"),
        },
        "isolation": {
            "engine": environment.get("engine"),
            "image": environment.get("image"),
            "image_digest": environment.get("image_digest"),
            "reach": probe.get("reach"),
            "sandbox": probe.get("sandbox"),
            "foreign_packages_absent": _gate(evidence, "probe:no-foreign-packages"),
        },
        "time_to_first_reproducible_update_s": data.get("time_to_first_reproducible_update_s"),
        "throughput": {"rollouts_per_s": train.get("rollouts_per_s"),
                       "policy_tokens_per_s": train.get("policy_tokens_per_s"),
                       "rollout_stage_rollouts_per_s": rollout.get("rollouts_per_s"),
                       "policy_batching": train.get("policy_batching")},
        "final_weights_sha256": _final_weights(evidence),
        "evaluation": data.get("evaluation") or {},
        "harnesses": data.get("harnesses") or [],
        "seeds": data.get("seeds") or [],
        "release": data.get("release"),
    }


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def table_rows(arms: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """(label, one cell per arm) rows shared by the terminal table, comparison.md and the HTML report."""
    def crash(arm: dict[str, Any]) -> str:
        figures = arm["recovery"]["injected_environment_crash"] or {}
        if not figures or figures.get("applicable") is False:
            return "n/a (in-process environment)"
        return (f"host killed {len(figures.get('killed_pids') or [])} env process(es): {figures['retried_episodes']} "
                f"retried, {figures['failed_episodes']} failed, {figures['lost']} lost of {figures['requested']}")

    def split(arm: dict[str, Any], name: str) -> str:
        row = arm["evaluation"].get(name)
        if not row:
            return "–"
        detectable = row.get("detectable_difference")
        return f"{row['base']} → {row['trained']}: {row['verdict']}" + \
            (f" (detects ≥ {detectable:.0%})" if detectable is not None else "")

    rows = [
        ("upstream", [a["upstream"] for a in arms]),
        ("trainer", [a.get("trainer") or "–" for a in arms]),
        ("python", [(a["python"] or "–") + (" (deviation)" if a["deviations"] else "") for a in arms]),
        ("every gate passed", [_cell(a["passed"]) for a in arms]),
        ("failed gates", [", ".join(a["failed_gates"]) or "none" for a in arms]),
        ("token source", [a["trace_fidelity"]["token_source"] for a in arms]),
        ("episode id channel", [a["trace_fidelity"]["attribution_channel"] for a in arms]),
        ("policy calls (unattributed)", [f"{a['trace_fidelity']['policy_calls']} "
                                         f"({a['trace_fidelity']['unattributed_calls']})" for a in arms]),
        ("continuity breaks", [_cell(a["trace_fidelity"]["continuity_breaks"]) for a in arms]),
        ("max logprob gap", [_cell(a["trace_fidelity"]["max_logprob_gap"]) for a in arms]),
        ("mismatch: token_mult_prob_error median, k3 KL", [_mismatch(a["trace_fidelity"]["mismatch"]) for a in arms]),
        ("trained == sampled", [_cell(a["trace_fidelity"]["trained_equals_sampled"]) for a in arms]),
        ("resume after SIGKILL", [_cell(a["recovery"]["resume_passed"]) for a in arms]),
        ("injected env crash", [crash(a) for a in arms]),
        ("could reach", [_reach(a["isolation"]) for a in arms]),
        ("no foreign packages", [_cell(a["isolation"]["foreign_packages_absent"]) for a in arms]),
        ("first reproducible update (s)", [_cell(a["time_to_first_reproducible_update_s"]) for a in arms]),
        ("rollouts/s (train stage)", [_cell(a["throughput"]["rollouts_per_s"]) for a in arms]),
        ("policy tokens/s (train stage)", [_cell(a["throughput"]["policy_tokens_per_s"]) for a in arms]),
        ("policy server sampling (train stage)", [_batching(a["throughput"].get("policy_batching")) for a in arms]),
        ("final weights", [_same_weights(a, arms) for a in arms]),
        ("held-out (greedy)", [split(a, "heldout") for a in arms]),
        ("retention (greedy)", [split(a, "retention") for a in arms]),
    ]
    if any((a["evaluation"].get("heldout") or {}).get("sampled") for a in arms):
        rows.append(("held-out (sampled)", [sampled_text(a["evaluation"].get("heldout") or {}) for a in arms]))
    for harness in dict.fromkeys(h["stack"] for a in arms for h in a.get("harnesses") or []):
        rows.append((f"{harness} harness (greedy)", [harness_text(a, harness) for a in arms]))
    if any(len(a.get("seeds") or []) > 1 for a in arms):
        rows.append(("seeds (trained held-out per seed)", [", ".join(
            f"{row['seed']}: {row['evaluation']['heldout']['trained']}" if "heldout" in row["evaluation"]
            else f"{row['seed']}: –" for row in a.get("seeds") or []) or "–" for a in arms]))
    if any(a.get("release") for a in arms):
        rows.append(("release", [(a["release"]["verdict"] + "".join(f"; {c}" for c in a["release"]["failed"]))
                                 if a.get("release") else "–" for a in arms]))
    return rows


def harness_text(arm: dict[str, Any], stack: str) -> str:
    row = next((h for h in arm.get("harnesses") or [] if h["stack"] == stack), None)
    if row is None or row["base"]["value"] is None or row["trained"]["value"] is None:
        return "–"
    paired = row.get("paired")
    return (f"{row['task']} {row['metric']}: {row['base']['value']:.3f} → {row['trained']['value']:.3f}"
            + (f": {paired['verdict']}" if paired else ""))


def _batching(figures: dict[str, Any] | None) -> str:
    """How the policy server sampled: batched (exactly as one call at a time would) or one call at a time."""
    if not figures:
        return "–"
    if figures.get("mode") != "batched":
        return f"one call at a time: {figures.get('reason') or 'no reason given'}"
    looped = figures.get("linears_row_by_row") or []
    attention = figures.get("attention", "")
    notes = [*([f"{len(looped)} linear(s) row by row: {', '.join(looped[:3])}"] if looped else []),
             *([f"attention {attention}"] if attention.startswith("one row at a time") else [])]
    return f"batched, {figures.get('mean_rows')} rows per decode step" + (f" ({'; '.join(notes)})" if notes else "")


def _mismatch(panel: dict[str, Any] | None) -> str:
    if not panel:
        return "–"
    return f"{panel['median_token_mult_prob_error']:.4f}, {panel['kl_k3']:.2e} ({panel['stage']})"


def _reach(isolation: dict[str, Any]) -> str:
    """What the stack's processes could reach, as its probe measured it under the arm's engine."""
    reach = isolation.get("reach")
    if not reach:
        return f"{isolation.get('engine')}: not measured"
    network = f"internet ({reach['outbound_target']})" if reach["outbound_tcp"] else "no outbound network"
    files = f"writes outside the run dir ({reach['write_target']})" if reach["write_outside_run_dir"] else \
        "no writes outside the run dir"
    inputs = "" if "write_inputs" not in reach else \
        ("; inputs writable" if reach["write_inputs"] else "; inputs read-only")
    sandbox = isolation.get("sandbox") or ""  # the local engine's; a container engine names its image
    if sandbox:
        where = " without a sandbox" if sandbox.startswith("none") else f" in {sandbox.split(':')[0]}"
    else:
        where = f" {isolation['image']}" if isolation.get("image") else ""
    return f"{isolation.get('engine')} engine{where}: {network}; {files}{inputs}"


def _same_weights(arm: dict[str, Any], arms: list[dict[str, Any]]) -> str:
    digest = arm["final_weights_sha256"]
    if not digest:
        return "–"
    twins = [a["stack"] for a in arms if a is not arm and a["final_weights_sha256"] == digest]
    return digest[:12] + (f" (= {', '.join(twins)})" if twins else "")


def markdown(plan: Plan, arms: list[dict[str, Any]], stages: list[str], tests: dict[str, Any]) -> str:
    names = [a["stack"] for a in arms]
    lines = [f"# Comparison on {plan.name}", "", f"- plan_id: `{plan.plan_id}` (every arm ran this plan)",
             f"- stages: {', '.join(stages)}" + ("" if set(stages) >= set(RECIPE_STAGES[plan.recipe]) else
                                                 " (a subset: the other stages' figures are blank)"),
             f"- policy: {plan.policy.kind} `{(plan.policy.sha256 or '')[:16]}`, the same bytes for every arm",
             f"- budget: {plan.budget.steps} steps x {plan.budget.prompts_per_step} prompts x "
             f"{plan.budget.generations_per_prompt} generations", "",
             "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, cells in table_rows(arms):
        lines.append(f"| {label} | " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    lines += ["", "Held-out and retention: base → trained successes with the paired test's verdict; each arm trains "
              "its own copy of the same starting policy, so differences between arms include sampling noise."]
    for split, found in tests.items():
        lines += ["", f"## Arm against arm: {split}", "", f"**{found['ranking']}**", "",
                  "| pair | items | solved | only first | only second | p | p (Holm) | verdict |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {p['first']} vs {p['second']} | {p['n']} | {p['first_k']} vs {p['second_k']} | {p['only_first']} | "
                  f"{p['only_second']} | {p['p_value']:.3g} | {p['p_holm']:.3g} | {p['verdict']} |" for p in found["pairs"]]
    return "\n".join(lines) + "\n"


def _trained_outcomes(arm_dir: Path, plan: Plan) -> dict[str, dict[str, list[bool]]]:
    """split -> task id -> the trained policy's outcomes in every trial (greedy and sampled), from each
    evaluate stage's eval.jsonl (which that stage re-scored)."""
    folders = [arm_dir / "stages" / "evaluate"] + [trial_dir(arm_dir, seed) / "stages" / "evaluate"
                                                    for seed in plan.seeds[1:]]
    outcomes: dict[str, dict[str, list[bool]]] = {}
    for folder in folders:
        try:
            records = read_jsonl(folder / "eval.jsonl", EvalRecord) if (folder / "eval.jsonl").is_file() else []
        except RecordError:
            records = []
        for record in records:
            if record.policy == "trained" and record.finish_reason != "error":
                outcomes.setdefault(record.split, {}).setdefault(record.task_id, []).append(record.success)
    return outcomes


def arm_tests(run_dir: Path, stacks: list[str], plan: Plan) -> dict[str, Any]:
    """Per evaluation split, every pair of arms' trained policies on the same items, Holm-adjusted, and the
    ranking they allow: exact McNemar on greedy outcomes with one trial; with several seeds or sampled
    attempts, the exact sign test on each item's success rate over them."""
    by_arm = {stack: _trained_outcomes(run_dir / "arms" / stack, plan) for stack in stacks}
    tests = {}
    for split in sorted({split for outcomes in by_arm.values() for split in outcomes}):
        arms = {stack: by_arm[stack][split] for stack in stacks if split in by_arm[stack]}
        if len(arms) < 2:
            continue
        repeated = any(len(results) > 1 for outcomes in arms.values() for results in outcomes.values())
        if repeated:
            rates = {stack: {task: sum(r) / len(r) for task, r in outcomes.items()} for stack, outcomes in arms.items()}
            name = "exact sign test on per-item success rates over seeds and sampled attempts"
            pairs, ranking = pairwise_arms(rates, plan.gates.confidence, test=name)
        else:
            name = "exact McNemar on greedy outcomes"
            pairs, ranking = pairwise_arms({stack: {task: r[0] for task, r in outcomes.items()}
                                            for stack, outcomes in arms.items()}, plan.gates.confidence)
        tests[split] = {"ranking": ranking, "test": f"{name}, Holm-adjusted",
                        "pairs": [dataclasses.asdict(pair) for pair in pairs]}
    return tests


def _rollout_tokens(arm_dir: Path) -> dict[str, list[list[int]]]:
    """episode id -> each segment's token ids, from the rollout stage's trajectories (its first batch)."""
    path = arm_dir / "stages" / "rollout" / "trajectories.jsonl"
    if not path.is_file():
        return {}
    episodes = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        episodes[record["episode_id"]] = [segment["token_ids"] for segment in record["segments"]]
    return episodes


def pin_changes(run_dir: Path, arms: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For arms that are one stack at two pins (trl@1.15.0 and trl@1.16.0, or trl): the distributions whose
    versions differ between the locks, whether the first rollout batch sampled the same tokens, and whether
    training ended in the same weights."""
    changes = []
    for index, first in enumerate(arms):
        for second in arms[index + 1:]:
            if first["stack"].partition("@")[0] != second["stack"].partition("@")[0]:
                continue
            try:
                locks = [get_stack(arm["stack"]).locked_packages() for arm in (first, second)]
            except UserError:  # a report rebuilt where a pin set is gone
                locks = [{}, {}]
            moved = {name: [locks[0].get(name), locks[1].get(name)] for name in sorted(set(locks[0]) | set(locks[1]))
                     if (locks[0].get(name) or "").split("+")[0] != (locks[1].get(name) or "").split("+")[0]}
            tokens = [_rollout_tokens(run_dir / "arms" / arm["stack"]) for arm in (first, second)]
            shared = sorted(set(tokens[0]) & set(tokens[1]))
            differing = [episode for episode in shared if tokens[0][episode] != tokens[1][episode]]
            weights = [first["final_weights_sha256"], second["final_weights_sha256"]]
            changes.append({"first": first["stack"], "second": second["stack"], "lock_changes": moved,
                            "rollout_episodes": len(shared), "rollout_token_identical": len(shared) - len(differing),
                            "first_differing_episode": differing[0] if differing else None,
                            "final_weights_identical": weights[0] == weights[1] if all(weights) else None})
    return changes


def pin_lines(changes: list[dict[str, Any]]) -> list[str]:
    lines = []
    for change in changes:
        moved = ", ".join(f"{name} {a or '–'} → {b or '–'}" for name, (a, b) in change["lock_changes"].items()) or "none"
        same = change["final_weights_identical"]
        lines += ["", f"## What changed between {change['first']} and {change['second']}", "",
                  f"- lock: {moved}",
                  (f"- first rollout batch: {change['rollout_token_identical']} of {change['rollout_episodes']} episodes "
                   "sampled the same tokens" + (f" (first difference: {change['first_differing_episode']})"
                                                if change["first_differing_episode"] else "")
                   if change["rollout_episodes"] else "- first rollout batch: not compared (an arm has no rollout)"),
                  "- final weights: " + ("identical" if same else "differ" if same is False else "not compared "
                                         "(an arm has no trained checkpoint)")]
    return lines


def write_comparison(run_dir: Path, stacks: list[str]) -> dict[str, Any]:
    """comparison.json, comparison.md and report.html from the arms' run directories."""
    loaded = []
    for stack in stacks:
        plan, evidence = load_run(run_dir / "arms" / stack)
        loaded.append((stack, plan, evidence))
    plan_ids = {stack: plan.plan_id for stack, plan, _ in loaded}
    evidence_ids = {stack: {e.plan_id for e in evidence} for stack, _, evidence in loaded}
    if len(set(plan_ids.values())) != 1 or any(ids - {next(iter(plan_ids.values()))} for ids in evidence_ids.values()):
        raise UserError(f"arms ran different plans and are never compared: {plan_ids}")
    plan = loaded[0][1]
    datas = [(stack, evidence, summary(plan, evidence, load_trials(run_dir / "arms" / stack, plan)))
             for stack, _, evidence in loaded]
    arms = [arm_figures(stack, evidence, data) for stack, evidence, data in datas]
    stages = [stage for stage in STAGES if any(stage in arm["gates"] for arm in arms)]
    result = {"plan_id": plan.plan_id, "plan": plan.name, "passed": all(a["passed"] for a in arms), "arms": arms,
              "stages": stages, "arm_tests": arm_tests(run_dir, stacks, plan), "pin_changes": pin_changes(run_dir, arms)}
    write_redacted(run_dir / "comparison.json", json.dumps(result, indent=2, sort_keys=True) + "\n")
    write_redacted(run_dir / "comparison.md", markdown(plan, arms, stages, result["arm_tests"])
                   + "\n".join(pin_lines(result["pin_changes"])) + ("\n" if result["pin_changes"] else ""))
    write_redacted(run_dir / "report.html", render_html(plan, datas, comparison=(
        [a["stack"] for a in arms], table_rows(arms)), arm_tests=result["arm_tests"],
        pin_lines=pin_lines(result["pin_changes"])))
    return result
