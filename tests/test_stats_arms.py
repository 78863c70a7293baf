"""Arm against arm: Holm's adjustment and the pairwise exact McNemar tests, pinned to hand-computed values."""

import msgspec
import pytest
from qualification.stats import holm, mcnemar_exact, pairwise_arms


def test_holm_multiplies_by_the_remaining_count_and_never_decreases():
    # sorted: 0.01 * 3 = 0.03, 0.02 * 2 = 0.04, 0.04 * 1 = 0.04 (kept monotone), in the given order
    assert holm([0.04, 0.01, 0.02]) == pytest.approx([0.04, 0.03, 0.04])
    assert holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert holm([0.03]) == [0.03] and holm([]) == []


def test_a_clear_winner_is_ranked_and_ties_are_not():
    items = [f"t{i}" for i in range(20)]
    strong = dict.fromkeys(items, True)
    weak = {t: i < 5 for i, t in enumerate(items)}  # 5 of 20
    twin = {t: i < 5 for i, t in enumerate(items)}
    pairs, sentence = pairwise_arms({"a": strong, "b": weak, "c": twin})
    by = {(p.first, p.second): p for p in pairs}
    ab = by[("a", "b")]
    assert (ab.n, ab.first_k, ab.second_k, ab.only_first, ab.only_second) == (20, 20, 5, 15, 0)
    assert ab.p_value == pytest.approx(2 * 0.5 ** 15)
    # a-b and a-c share the smallest p: the first sorted gets 3 x, the second 2 x but never less than the first
    assert ab.p_holm == by[("a", "c")].p_holm == pytest.approx(3 * 2 * 0.5 ** 15)
    assert ab.verdict == "a better" and by[("a", "c")].verdict == "a better"
    assert by[("b", "c")].verdict == "indistinguishable" and by[("b", "c")].p_holm == 1.0
    assert sentence.startswith("a > b (p_holm=") and "a > c" in sentence and "3 pairs" in sentence


def test_small_differences_are_not_a_ranking():
    items = [f"t{i}" for i in range(10)]
    a = {t: i < 6 for i, t in enumerate(items)}
    b = {t: i < 4 for i, t in enumerate(items)}
    pairs, sentence = pairwise_arms({"a": a, "b": b})
    assert pairs[0].p_value == pytest.approx(mcnemar_exact(2, 0)) == pytest.approx(0.5)
    assert pairs[0].verdict == "indistinguishable"
    assert sentence == "no stack is distinguishable from another on these 10 items (1 pairs, exact McNemar, " \
                       "Holm-adjusted at 95%)"


def test_only_items_every_arm_was_evaluated_on_are_compared():
    pairs, _ = pairwise_arms({"a": {"x": True, "y": True}, "b": {"y": False, "z": True}})
    assert pairs[0].n == 1 and (pairs[0].only_first, pairs[0].only_second) == (1, 0)


def test_the_comparison_reports_arm_against_arm_from_each_arms_eval_records(tmp_path):
    """write_comparison over three arm folders whose evaluate stages wrote eval.jsonl (constructed here)."""
    import json

    from runner_contracts import EvalRecord, Evidence, JsonlWriter, freeze_plan, write_record
    from test_contracts import PLAN

    from runner.api import load_plan, write_comparison

    plan = freeze_plan(load_plan(PLAN))
    solved = {"strong": 24, "weak": 4, "twin": 4}
    for stack, k in solved.items():
        arm = tmp_path / "arms" / stack
        write_record(arm / "plan.json", plan)
        write_record(arm / "stages" / "evaluate" / "evidence.json", Evidence(
            run_id=stack, stack=stack, stage="evaluate", plan_id=plan.plan_id, status="passed",
            started_at="2026-12-01T00:00:00+00:00", finished_at="2026-12-01T00:00:01+00:00"))
        with JsonlWriter(arm / "stages" / "evaluate" / "eval.jsonl") as writer:
            for i in range(24):
                writer.write(EvalRecord(policy="trained", split="heldout", task_id=f"t{i}", item="{}", final_text="",
                                        tool_calls=[], stack_reward=float(i < k), success=i < k, finish_reason="stop"))
    result = write_comparison(tmp_path, list(solved))
    heldout = result["arm_tests"]["heldout"]
    assert heldout["ranking"].startswith("strong > weak") and "strong > twin" in heldout["ranking"]
    verdicts = {(p["first"], p["second"]): p["verdict"] for p in heldout["pairs"]}
    assert verdicts == {("strong", "weak"): "strong better", ("strong", "twin"): "strong better",
                        ("weak", "twin"): "indistinguishable"}
    assert "## Arm against arm: heldout" in (tmp_path / "comparison.md").read_text()
    assert "Arm against arm: heldout" in (tmp_path / "report.html").read_text()
    assert json.loads((tmp_path / "comparison.json").read_text())["arm_tests"] == result["arm_tests"]


def test_arms_with_several_trials_are_compared_on_per_item_success_rates(tmp_path):
    """Two seeds, each trial with one greedy and two sampled outcomes per item: 'steady' solves every item
    in every attempt, 'shaky' two of three on the first 12 items and none on the rest; the exact sign test
    counts 24 items where steady's rate is higher and none the other way: p = 2 * 0.5**24."""
    from runner_contracts import EvalRecord, Evidence, JsonlWriter, freeze_plan, write_record
    from test_contracts import PLAN

    from runner.api import load_plan, write_comparison

    raw = load_plan(PLAN)
    plan = freeze_plan(msgspec.structs.replace(raw, seeds=[7, 8]))
    for stack in ("steady", "shaky"):
        arm = tmp_path / "arms" / stack
        write_record(arm / "plan.json", plan)
        for folder in (arm, arm / "seeds" / "seed-8"):
            write_record(folder / "stages" / "evaluate" / "evidence.json", Evidence(
                run_id=stack, stack=stack, stage="evaluate", plan_id=plan.plan_id, status="passed",
                started_at="2026-12-01T00:00:00+00:00", finished_at="2026-12-01T00:00:01+00:00"))
            with JsonlWriter(folder / "stages" / "evaluate" / "eval.jsonl") as writer:
                for i in range(24):
                    for decoding, attempt in (("greedy", 0), ("sampled", 0), ("sampled", 1)):
                        success = stack == "steady" or (i < 12 and attempt == 0)
                        writer.write(EvalRecord(policy="trained", split="heldout", task_id=f"t{i}", item="{}",
                                                final_text="", tool_calls=[], stack_reward=float(success),
                                                success=success, finish_reason="stop", decoding=decoding,
                                                attempt=attempt))
    heldout = write_comparison(tmp_path, ["steady", "shaky"])["arm_tests"]["heldout"]
    pair = heldout["pairs"][0]
    assert heldout["test"].startswith("exact sign test on per-item success rates")
    assert (pair["n"], pair["only_first"], pair["only_second"]) == (24, 24, 0)
    assert pair["first_k"] == 24 and pair["second_k"] == pytest.approx(12 * 2 / 3)
    assert pair["p_value"] == pytest.approx(2 * 0.5 ** 24) and pair["verdict"] == "steady better"


def test_the_detectable_difference_is_the_mcnemar_power_approximation():
    from qualification.stats import detectable_difference

    # (z_0.975 + z_0.8) * sqrt(psi / n) = (1.95996 + 0.84162) * sqrt((12 / 48) / 48)
    assert detectable_difference(48, 12) == pytest.approx(2.80158 * (0.25 / 48) ** 0.5, rel=1e-4)
    assert detectable_difference(48, 0) == detectable_difference(48, 2)  # no discordance: 2 assumed
    assert detectable_difference(4, 4) == 1.0 and detectable_difference(0, 0) is None
    assert detectable_difference(400, 40) < detectable_difference(100, 10)  # more items, finer


def test_items_needed_inverts_the_detectable_difference_and_the_cli_says_so():
    import json
    import subprocess
    import sys
    from pathlib import Path

    from qualification.stats import detectable_difference, items_needed

    n = items_needed(0.05, 0.25)
    assert n == 785  # ceil(2.80158^2 * 0.25 / 0.05^2)
    assert detectable_difference(n, round(0.25 * n)) <= 0.05 < detectable_difference(n - 10, round(0.25 * (n - 10)))
    with pytest.raises(ValueError, match="cannot exceed the share of items"):
        items_needed(0.3, 0.2)
    runner = str(Path(sys.executable).parent / "runner")
    plan = str(Path(__file__).resolve().parents[1] / "qualification" / "plans" / "calc-tool-cpu.yaml")
    out = json.loads(subprocess.run([runner, "plan", "power", plan, "--effect", "0.05", "--json"], capture_output=True,
                                    text=True, check=True).stdout)
    assert (out["items_needed"], out["seeds_needed_at_plan_n"], out["plan_items"]) == (785, 17, 48)
    bad = subprocess.run([runner, "plan", "power", plan, "--effect", "0.5", "--discordance", "0.2"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "cannot exceed the share of items" in bad.stderr and "Traceback" not in bad.stderr
