"""The service stage: scripted episodes with known outcomes through the stack's own environment, scored
by the stack and by the reference scorer; the frozen splits' hashes and the train/held-out overlap check."""

from __future__ import annotations

from typing import Any

from qualification.gates import service_gates
from qualification.tasks import exact_overlap, get_family, ngram_overlap, split_hash
from runner_contracts import GateResult, Plan, ServiceCase, read_jsonl

from .arm import Arm, StageOutput, run_adapter


def stage_service(arm: Arm) -> StageOutput:
    out = arm.stage_dir("service")
    _, result = run_adapter(arm, "service", out, in_stack_env=arm.service_env is not None)
    cases = read_jsonl(out / "service.jsonl", ServiceCase)
    splits, split_gates = split_evidence(arm.plan)
    gates = service_gates(cases) + split_gates
    metrics: dict[str, Any] = {"cases": len(cases), "splits": splits}
    if arm.service_env is not None and result is not None:
        failed, unattributed = result.metrics.get("failed_episodes", []), result.metrics.get("unattributed_calls", 0)
        gates.append(GateResult(
            name="service:scripted-episodes", passed=not failed and unattributed == 0,
            measured=len(failed) + unattributed, threshold=0,
            detail=("; ".join(failed[:3]) or f"{unattributed} unattributed policy calls") if failed or unattributed
            else f"{len(cases)} scripted episodes ran natively, every policy call attributed "
                 f"({result.metrics.get('episode_id_channel')})"))
        metrics.update({k: result.metrics.get(k) for k in ("policy_calls", "channels", "episode_id_channel", "seconds")})
    return StageOutput(metrics=metrics, gates=gates)


def split_evidence(plan: Plan) -> tuple[dict[str, Any], list[GateResult]]:
    """Content hashes of the frozen splits, and the train/held-out overlap check."""
    items, splits = {}, {}
    for label in ("train", "heldout", "retention"):
        spec = getattr(plan.task, label)
        family = get_family(spec.family or plan.task.family)
        items[label] = family.generate(spec.split, spec.n, spec.seed)
        splits[label] = {"family": family.name, "split": spec.split, "n": spec.n, "seed": spec.seed,
                         "sha256": split_hash(items[label]), "synthetic": family.synthetic,
                         "scorer_version": family.scorer_version}
    exact = exact_overlap(items["train"], items["heldout"])
    ngram = ngram_overlap(items["train"], items["heldout"])
    splits["overlap"] = {"exact_questions": exact, "heldout_share_with_8gram_in_train": round(ngram, 4)}
    scorer = get_family(plan.task.family)
    return splits, [
        GateResult(name="tasks:heldout-disjoint", passed=exact == 0, measured=exact, threshold=0,
                   detail=f"held-out questions that appear verbatim in train; {ngram:.0%} share a word "
                          "8-gram with train (templated tasks share phrasing by design)"),
        GateResult(name="tasks:scorer-pinned",
                   passed=(plan.reward.scorer, plan.reward.version) == (scorer.name, scorer.scorer_version),
                   measured=f"{scorer.name} v{scorer.scorer_version}",
                   threshold=f"{plan.reward.scorer} v{plan.reward.version}",
                   detail="the plan's reward scorer and version are the task family's reference scorer"),
    ]
