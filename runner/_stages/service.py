"""The service stage: scripted episodes with known outcomes through the stack's own environment, scored
by the stack and by the reference scorer; the frozen splits' hashes and the train/held-out overlap check."""

from __future__ import annotations

from collections import Counter
from typing import Any

from qualification.gates import service_gates
from qualification.tasks import exact_overlap, get_family, ngram_overlap, service_cases, split_hash
from runner_contracts import SERVICE_CALLS_FILE, GateResult, Plan, PolicyCall, ServiceCase, read_jsonl

from .arm import Arm, StageOutput, run_adapter
from .audits import reported

SERVICE_ITEMS_PER_FAMILY = 3  # items of each scripted family (the stage's option items_per_family)


def stage_service(arm: Arm) -> StageOutput:
    out = arm.stage_dir("service")
    _, result = run_adapter(arm, "service", out, in_stack_env=arm.service_env is not None,
                            options={"items_per_family": SERVICE_ITEMS_PER_FAMILY})
    cases = read_jsonl(out / "service.jsonl", ServiceCase)
    splits, split_gates = split_evidence(arm.plan)
    gates = service_gates(cases) + split_gates
    metrics: dict[str, Any] = {"cases": len(cases), "splits": splits}
    if arm.service_env is not None:
        gate, figures = scripted_episodes_gate(arm.plan, cases, read_jsonl(out / SERVICE_CALLS_FILE, PolicyCall)
                                               if (out / SERVICE_CALLS_FILE).is_file() else [])
        gates.append(gate)
        metrics.update(figures)
        reported(result, "seconds", metrics)
    return StageOutput(metrics=metrics, gates=gates)


def scripted_episodes_gate(plan: Plan, cases: list[ServiceCase], calls: list[PolicyCall], *,
                           items_per_family: int = SERVICE_ITEMS_PER_FAMILY) -> tuple[GateResult, dict[str, Any]]:
    """Every scripted case the host expects (it derives them from the plan itself) ran once and completed,
    and every policy call the scripted server answered names one of them."""
    expected = {(item.task_id, case["case"]) for _, item, case in service_cases(plan, items_per_family)}
    ran = Counter((case.task_id, case.case) for case in cases)
    missing, unexpected = sorted(expected - ran.keys()), sorted(ran.keys() - expected)
    repeated = sorted(key for key, count in ran.items() if count > 1)
    failed = [f"{case.task_id}/{case.case}: {case.error.message if case.error else case.status}"
              for case in cases if case.status != "completed"]
    episodes = {case.episode_id for case in cases}
    unattributed = sum(1 for call in calls if call.episode_id not in episodes)
    problems = ([f"missing {'/'.join(key)}" for key in missing[:3]] + [f"ran twice {'/'.join(key)}" for key in repeated[:3]]
                + [f"not scripted {'/'.join(key)}" for key in unexpected[:3]] + failed[:3]
                + ([f"{unattributed} policy calls name no scripted episode"] if unattributed else []))
    channels = sorted({call.channel for call in calls})
    gate = GateResult(
        name="service:scripted-episodes", passed=not problems and bool(calls),
        measured=len(missing) + len(repeated) + len(unexpected) + len(failed) + unattributed, threshold=0,
        detail="; ".join(problems) or (f"{len(cases)} scripted episodes ran natively, every one of the "
                                       f"{len(calls)} policy calls attributed (via {', '.join(channels)})"
                                       if calls else "the service stage recorded no policy call"))
    return gate, {"policy_calls": len(calls), "channels": channels, "failed_episodes": len(failed),
                  "missing_cases": len(missing), "unattributed_calls": unattributed}


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
                   detail="the plan's reward scorer and version are the task family's reference scorer"
                   if getattr(scorer, "reference_scorer", True) else
                   f"the plan's reward names the native asset's task: the reward is the {plan.task.native.stack} "
                   "environment's own (no reference scorer)"),
    ]
