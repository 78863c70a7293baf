"""SFT audit: every row the optimizer consumed is a demonstration as the stack rendered it, with the loss
on exactly its target tokens, and every step was recorded."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from runner_contracts import Demonstration, GateResult, TrainingRow


def sft_gates(demonstrations: Iterable[Demonstration], rows: Iterable[TrainingRow], steps: int) -> tuple[list[GateResult], dict]:
    demos = {d.task_id: d for d in demonstrations}
    unmatched, wrong_mask, per_step, trained_tokens = [], [], Counter(), 0
    for row in rows:
        per_step[row.step] += 1
        demo = demos.get(row.episode_ids[0]) if len(row.episode_ids) == 1 else None
        if demo is None or demo.input_ids != row.input_ids:
            unmatched.append(row.row_id)
            continue
        if row.loss_mask != demo.target_mask:
            wrong_mask.append(row.row_id)
        trained_tokens += sum(row.loss_mask)
    empty = [d.task_id for d in demos.values() if not any(d.target_mask)]
    missing_steps = [s for s in range(1, steps + 1) if not per_step.get(s)]
    gates = [
        GateResult(name="sft:rows-match-demonstrations", passed=not unmatched and bool(per_step),
                   measured=len(unmatched), threshold=0,
                   detail=f"rows that are no demonstration: {unmatched[:3]}" if unmatched else
                   f"{sum(per_step.values())} rows, each a demonstration token for token"),
        GateResult(name="sft:mask-equals-targets", passed=not wrong_mask, measured=len(wrong_mask), threshold=0,
                   detail=f"rows whose loss mask is not the target mask: {wrong_mask[:3]}" if wrong_mask else
                   f"{trained_tokens} trained tokens, all and only target tokens"),
        GateResult(name="sft:targets-nonempty", passed=bool(demos) and not empty, measured=len(empty), threshold=0,
                   detail=f"demonstrations without targets: {empty[:3]}" if empty else f"{len(demos)} demonstrations"),
        GateResult(name="sft:every-step-recorded", passed=not missing_steps, measured=sorted(per_step),
                   threshold=f"1..{steps}", detail=f"missing steps {missing_steps}" if missing_steps else ""),
    ]
    return gates, {"rows": sum(per_step.values()), "trained_tokens": trained_tokens, "demonstrations": len(demos)}
