"""Gates for the probe, service, update, resume and evaluate stages (host side, over files)."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from runner_contracts import COMPLETE_MARKER, EvalRecord, GateResult, ServiceCase, Trajectory, TrainingRow, sha256_file

from ..stats import (
    PairedComparison,
    aggregate_paired,
    aggregate_seeds,
    compare_paired,
    detectable_difference,
    non_inferior,
    pass_hat_k,
    rate_text,
)
from ..tasks import TaskItem, ToolCall, Transcript, get_family, replay

def lock_gate(installed: dict[str, str], locked: dict[str, str], also_ignored: tuple[str, ...] = ()) -> GateResult:
    """Installed distributions must equal the lock: same names, same versions (a local label like +cpu
    on the installed side is accepted when the lock pins the public version). Our own packages, and
    `also_ignored` (the plan's task packages, on the job's path), are not the lock's."""
    drift = []
    for name, version in sorted(locked.items()):
        have = installed.get(name)
        if have is None:
            drift.append(f"{name}: locked {version}, not installed")
        elif have != version and have.split("+", 1)[0] != version:
            drift.append(f"{name}: locked {version}, installed {have}")
    ignored = {"pip", "runner-contracts", "runner-qualification", "runner-kit", *also_ignored}
    extra = sorted(name for name in installed if name not in locked and name not in ignored
                   and not name.startswith("runner-stack-"))
    drift += [f"{name}: installed {installed[name]}, not in the lock" for name in extra]
    return GateResult(name="probe:lock-match", passed=not drift, measured=len(drift), threshold=0,
                      detail="; ".join(drift) if drift else f"{len(locked)} locked distributions installed exactly")


def service_gates(cases: list[ServiceCase]) -> list[GateResult]:
    """Stack rewards equal the reference scorer; known-good cases succeed, known-bad fail; tool results
    equal the reference tool implementation."""
    mismatched, wrong_expectation, wrong_tools = [], [], []
    keyed, keyless, native = [], [], 0  # cases with a reward to check; a native asset's without; native ones
    for case in cases:
        item = TaskItem.from_json(case.item)
        family = get_family(item.family)
        if not getattr(family, "reference_scorer", True):
            native += 1
            expected = family.expected_reward(case.task_id, case.case)
            (keyless if expected is None else keyed).append(case)
            if expected is not None and not math.isclose(expected, case.stack_reward, abs_tol=1e-6):
                mismatched.append(f"{case.task_id}/{case.case}: environment {case.stack_reward} vs answer key {expected}")
            continue
        keyed.append(case)
        calls = [ToolCall(name=c["name"], arguments=c.get("arguments", {}), result=str(c.get("result", "")))
                 for c in case.tool_calls]
        _, reference_results = replay(family, item, calls)
        for call, expected in zip(calls, reference_results, strict=True):
            if call.result != expected:
                wrong_tools.append(f"{case.task_id}/{case.case}: {call.name}({call.arguments}) -> {call.result!r}")
        reference = family.score(item, Transcript(final_text=case.final_text, tool_calls=calls))
        if not math.isclose(reference.reward, case.stack_reward, abs_tol=1e-9):
            mismatched.append(f"{case.task_id}/{case.case}: stack {case.stack_reward} vs reference {reference.reward}")
        if reference.success != case.expected_success:
            wrong_expectation.append(f"{case.task_id}/{case.case}: expected success={case.expected_success}")
    good = sum(1 for case in keyed if case.expected_success)
    scored = (f"{len(keyed) - (native - len(keyless))} scripted episodes scored as the reference scorer does"
              + (f"; {native - len(keyless)} of the native asset's as its answer key says (reward from the "
                 "environment's own reward; no reference scorer)" if native else ""))
    gates = [
        GateResult(name="service:reward-equals-reference", passed=bool(keyed) and not mismatched,
                   measured=len(mismatched), threshold=0, detail="; ".join(mismatched[:3]) or scored),
        GateResult(name="service:known-answers", passed=bool(keyed) and not wrong_expectation and 0 < good < len(keyed),
                   measured=len(wrong_expectation), threshold=0,
                   detail="; ".join(wrong_expectation[:3]) or f"{good} known-good succeed, {len(keyed) - good} known-bad fail"),
        GateResult(name="service:tool-results", passed=not wrong_tools, measured=len(wrong_tools), threshold=0,
                   detail="; ".join(wrong_tools[:3]) or "every tool result equals the reference tool"
                   + ("; a native asset's tools are its own, with no reference to compare" if native else "")),
    ]
    if keyless:
        gates.append(GateResult(
            name="service:native-lifecycle", passed=all(case.status == "completed" for case in keyless),
            measured=sum(case.status != "completed" for case in keyless), threshold=0,
            detail=f"{len(keyless)} episodes of the native asset ran start to end; it ships no answer key "
                   "(task.native.cases), so its rewards were not checked"))
    return gates


def checkpoint_revisions(checkpoint_dir: Path) -> tuple[dict[int, str], list[str]]:
    """{step: sha256 of model.safetensors} for complete checkpoints, and the names of incomplete ones."""
    complete, incomplete = {}, []
    if not checkpoint_dir.is_dir():
        return complete, incomplete
    for folder in sorted(checkpoint_dir.glob("checkpoint-*")):
        try:
            step = int(folder.name.split("-", 1)[1])
        except ValueError:
            continue
        marker = folder / COMPLETE_MARKER
        if not marker.is_file():
            incomplete.append(folder.name)
            continue
        digest = sha256_file(folder / "model.safetensors")
        claimed = marker.read_text().split()
        if len(claimed) != 2 or claimed[1] != digest:
            incomplete.append(folder.name)
            continue
        complete[step] = digest
    return complete, incomplete


def latest_complete_checkpoint(checkpoint_dir: Path) -> Path | None:
    complete, _ = checkpoint_revisions(checkpoint_dir)
    return checkpoint_dir / f"checkpoint-{max(complete)}" if complete else None


def update_gates(losses: list[float], expected_steps: int, initial_revision: str,
                 revisions: dict[int, str], incomplete: list[str]) -> list[GateResult]:
    final = revisions.get(expected_steps)
    finite = bool(losses) and all(math.isfinite(x) for x in losses)
    return [
        GateResult(name="update:loss-finite", passed=finite and len(losses) == expected_steps,
                   measured=losses, threshold=f"{expected_steps} finite values",
                   detail="loss per optimizer step as logged by the trainer (its word: the host cannot "
                          "recompute it)", reported_by="adapter"),
        GateResult(name="update:checkpoints-complete", passed=sorted(revisions) == list(range(1, expected_steps + 1)),
                   measured=sorted(revisions), threshold=f"1..{expected_steps}",
                   detail=f"incomplete: {incomplete}" if incomplete else "every step's checkpoint carries its marker"),
        GateResult(name="update:weights-changed", passed=final is not None and final != initial_revision,
                   measured=(final or "")[:12], threshold=f"!= {initial_revision[:12]}",
                   detail="sha256 of model.safetensors after the last step vs the starting policy"),
    ]


def resume_gates(uninterrupted: list[Trajectory], interrupted: list[Trajectory], resumed: list[Trajectory],
                 uninterrupted_rows: list[TrainingRow], interrupted_rows: list[TrainingRow],
                 resumed_rows: list[TrainingRow], kill_step: int, final_uninterrupted: str | None,
                 final_resumed: str | None, ignored_partial: list[str]) -> list[GateResult]:
    """The interrupted run up to its last complete checkpoint, then the resumed run, must replay the
    uninterrupted run: same episodes in the same order, same tokens, same rows, same final weights.
    All three runs are the same stage, so episode and row ids are comparable."""
    def stitch(before, after):
        return [x for x in before if x.step <= kill_step] + [x for x in after if x.step > kill_step]

    episodes = stitch(interrupted, resumed)
    rows = stitch(interrupted_rows, resumed_rows)
    order_a = [(t.step, t.episode_id, t.task_id) for t in uninterrupted] + [(r.step, r.row_id, tuple(r.episode_ids))
                                                                           for r in uninterrupted_rows]
    order_b = [(t.step, t.episode_id, t.task_id) for t in episodes] + [(r.step, r.row_id, tuple(r.episode_ids))
                                                                      for r in rows]
    tokens_a = {t.episode_id: [s.token_ids for s in t.segments] for t in uninterrupted}
    tokens_b = {t.episode_id: [s.token_ids for s in t.segments] for t in episodes}
    differing = sorted(key for key in tokens_a if tokens_b.get(key) != tokens_a[key])
    rows_a = {r.row_id: (r.input_ids, r.loss_mask) for r in uninterrupted_rows}
    rows_b = {r.row_id: (r.input_ids, r.loss_mask) for r in rows}
    differing += sorted(key for key in rows_a if rows_b.get(key) != rows_a[key])
    discarded = [t for t in interrupted if t.step > kill_step] + [r for r in interrupted_rows if r.step > kill_step]
    return [
        GateResult(name="resume:same-order", passed=order_a == order_b and bool(order_a),
                   measured=len(order_b), threshold=len(order_a),
                   detail="same episodes and rows in the same order" if order_a == order_b else
                   "episode or row order differs after resume"),
        GateResult(name="resume:same-tokens", passed=not differing and bool(rows_a),
                   measured=len(differing), threshold=0,
                   detail=(f"differing episodes/rows: {differing[:3]}" if differing else
                           "identical tokens and masks in every episode and training row")
                   + (f"; {len(discarded)} records written after checkpoint {kill_step} before the kill were "
                      "discarded and regenerated" if discarded else "")),
        GateResult(name="resume:same-final-weights", passed=final_uninterrupted is not None
                   and final_uninterrupted == final_resumed,
                   measured=(final_resumed or "")[:12], threshold=(final_uninterrupted or "")[:12],
                   detail="sha256 of the final model.safetensors, resumed vs uninterrupted (CPU: exact)"
                          + (f"; resumed past incomplete {ignored_partial}" if ignored_partial else "")),
    ]


def evaluate_gates(records: list[EvalRecord], margin: float, confidence: float) -> tuple[list[GateResult], dict]:
    """Re-scores every episode, pairs base and trained on the same items, and states verdicts."""
    rescored_wrong = []
    native = 0
    by_split: dict[str, dict[str, dict[str, bool]]] = defaultdict(lambda: defaultdict(dict))
    sampled: dict[str, dict[str, dict[str, list[bool | None]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for record in records:
        item = TaskItem.from_json(record.item)
        family = get_family(item.family)
        if getattr(family, "reference_scorer", True):
            calls = [ToolCall(name=c["name"], arguments=c.get("arguments", {}), result=str(c.get("result", "")))
                     for c in record.tool_calls]
            success = family.score(item, Transcript(final_text=record.final_text, tool_calls=calls)).success
        else:  # the asset's own reward is all there is: success must be what its threshold makes of it
            native += 1
            success = family.solved(record.stack_reward)
        if success != record.success:
            rescored_wrong.append(f"{record.policy}/{record.task_id}")
        if record.decoding == "sampled":
            outcome = None if record.finish_reason == "error" else success
            sampled[record.split][record.policy][record.task_id].append(outcome)
        else:
            by_split[record.split][record.policy][record.task_id] = success
    summary: dict[str, dict] = {}
    gates = [GateResult(name="evaluate:scores-verified", passed=bool(records) and not rescored_wrong,
                        measured=len(rescored_wrong), threshold=0,
                        detail=f"re-scored {len(records) - native} episodes with the reference scorer"
                        + (f"; {native} episodes of the native asset checked against its own reward and the plan's "
                           "success_reward (no reference scorer)" if native else ""))]
    for split, policies in sorted(by_split.items()):
        base, trained = policies.get("base", {}), policies.get("trained", {})
        items = sorted(base)
        if not items or set(base) != set(trained):
            gates.append(GateResult(name=f"evaluate:{split}", passed=False, detail="base and trained were not "
                                    "evaluated on the same items"))
            continue
        comparison = compare_paired([base[i] for i in items], [trained[i] for i in items], confidence)
        summary[split] = paired_row(comparison, confidence)
        if (baseline := policies.get("baseline")) is not None:  # recipe distill: distilled vs matched SFT baseline
            if set(baseline) != set(trained):
                gates.append(GateResult(name=f"evaluate:{split}-baseline", passed=False, detail="the matched SFT "
                                        "baseline and the trained policy were not evaluated on the same items"))
            else:
                versus = compare_paired([baseline[i] for i in items], [trained[i] for i in items], confidence)
                summary[split]["baseline"] = {**paired_row(versus, confidence),
                                              "reading": "base = the matched SFT baseline, trained = the distilled policy"}
        if split in sampled:
            summary[split]["sampled"] = sampled_figures(sampled[split])
        if split == "retention":
            ok = non_inferior(comparison, margin)
            gates.append(GateResult(
                name="evaluate:retention", passed=ok, measured=round(comparison.difference_ci[0], 4),
                threshold=f"> -{margin}",
                detail=f"base {summary[split]['base']} -> trained {summary[split]['trained']}; non-inferiority on the "
                       f"lower {confidence:.0%} bound of the paired difference"))
        else:
            gates.append(GateResult(
                name=f"evaluate:{split}", passed=comparison.verdict != "regressed", measured=comparison.verdict,
                threshold="not regressed",
                detail=f"base {summary[split]['base']} -> trained {summary[split]['trained']}; "
                       f"{comparison.test} p={comparison.p_value:.3g}"))
    return gates, summary


def paired_row(comparison: PairedComparison, confidence: float) -> dict:
    """A split's row: rates with intervals, the paired test and its verdict, what the sample could detect."""
    return {
        "n": comparison.n, "base_k": comparison.base_k, "trained_k": comparison.trained_k,
        "base": rate_text(comparison.base_k, comparison.n, confidence),
        "trained": rate_text(comparison.trained_k, comparison.n, confidence),
        "difference": comparison.difference, "difference_ci": list(comparison.difference_ci),
        "p_value": comparison.p_value, "test": comparison.test, "verdict": comparison.verdict,
        "improved_pairs": comparison.improved_pairs, "worsened_pairs": comparison.worsened_pairs,
        "detectable_difference": detectable_difference(
            comparison.n, comparison.improved_pairs + comparison.worsened_pairs, confidence),
    }


def sampled_figures(by_policy: dict[str, dict[str, list[bool | None]]]) -> dict:
    """pass@1 and pass^k (k = 1 .. attempts) per policy from each item's sampled attempts (None: an
    infrastructure error); an item with an errored attempt, in either policy, is left out and counted."""
    errored = {task for attempts in by_policy.values() for task, outcomes in attempts.items() if None in outcomes}
    attempts = min((len(outcomes) for by_task in by_policy.values() for outcomes in by_task.values()), default=0)
    figures: dict = {"attempts": attempts, "excluded_items": len(errored)}
    for policy, by_task in sorted(by_policy.items()):
        outcomes = [(sum(o[:attempts]), attempts) for task, o in sorted(by_task.items()) if task not in errored]
        figures["items"] = len(outcomes)
        figures[policy] = {"pass@1": round(pass_hat_k(outcomes, 1), 4) if outcomes else None,
                           "pass^k": {str(k): round(pass_hat_k(outcomes, k), 4) for k in range(1, attempts + 1)}
                           if outcomes else {}}
    return figures


def _pooled_sampled(rows: list[dict]) -> dict:
    """pass@1 and pass^k over several trials' sampled figures: item-weighted means (the same k in each)."""
    attempts = min(row["attempts"] for row in rows)
    items = sum(row["items"] for row in rows)
    pooled: dict = {"attempts": attempts, "items": items, "excluded_items": sum(row["excluded_items"] for row in rows)}
    for policy in ("base", "trained"):
        weighted = [(row["items"], row[policy]) for row in rows if row.get(policy) and row[policy]["pass@1"] is not None]
        if not weighted or not items:
            continue
        pooled[policy] = {"pass@1": round(sum(n * f["pass@1"] for n, f in weighted) / items, 4),
                          "pass^k": {str(k): round(sum(n * f["pass^k"][str(k)] for n, f in weighted) / items, 4)
                                     for k in range(1, attempts + 1)}}
    return pooled


def pooled_evaluation(per_seed: list[dict[str, dict]], confidence: float) -> dict[str, dict]:
    """One row per split over the trials of several seeds (each an evaluate stage's summary): the exact
    McNemar test on the discordant pairs of every trial together, the pooled rates, the per-seed trained
    rates (the spread a pooled figure alone would hide) and what the pooled sample could detect."""
    pooled: dict[str, dict] = {}
    splits = sorted({split for summary in per_seed for split in summary})
    for split in splits:
        rows = [summary[split] for summary in per_seed if split in summary]
        if len(rows) != len(per_seed) or any("improved_pairs" not in row for row in rows):
            continue
        comparison = aggregate_paired([PairedComparison(
            n=row["n"], base_k=row["base_k"], trained_k=row["trained_k"], improved_pairs=row["improved_pairs"],
            worsened_pairs=row["worsened_pairs"], p_value=row["p_value"], difference=row["difference"],
            difference_ci=tuple(row["difference_ci"]), verdict=row["verdict"]) for row in rows], confidence)
        spread = aggregate_seeds([(row["trained_k"], row["n"]) for row in rows], confidence)
        pooled[split] = {
            **paired_row(comparison, confidence),
            **({"sampled": _pooled_sampled([row["sampled"] for row in rows])} if all("sampled" in row for row in rows)
               else {}),
            "seeds": len(rows), "trained_per_seed": [round(row["trained_k"] / row["n"], 4) for row in rows],
            "trained_spread": [round(spread.spread[0], 4), round(spread.spread[1], 4)],
        }
    return pooled
