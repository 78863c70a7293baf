import pytest
from qualification.stats import (
    clopper_pearson,
    compare_paired,
    mcnemar_exact,
    non_inferior,
    rate_text,
    wilson,
)


def test_wilson_known_values():
    low, high = wilson(28, 64)
    assert low == pytest.approx(0.3229, abs=1e-4) and high == pytest.approx(0.5591, abs=1e-4)


def test_clopper_pearson_known_values():
    assert clopper_pearson(0, 10)[1] == pytest.approx(0.3085, abs=1e-4)
    low, high = clopper_pearson(28, 64)
    assert low == pytest.approx(0.3137, abs=1e-4) and high == pytest.approx(0.5672, abs=1e-4)


def test_mcnemar_exact():
    assert mcnemar_exact(5, 1) == pytest.approx(0.21875)
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(10, 0) == pytest.approx(2 / 1024)


def test_small_differences_are_inconclusive():
    # The seed documents' case: 28/64 -> 30/64 must not be called an improvement.
    base = [True] * 28 + [False] * 36
    trained = [True] * 28 + [True, True] + [False] * 34
    result = compare_paired(base, trained)
    assert (result.base_k, result.trained_k, result.verdict) == (28, 30, "inconclusive")


def test_clear_changes_get_verdicts():
    assert compare_paired([False] * 20, [True] * 12 + [False] * 8).verdict == "improved"
    assert compare_paired([True] * 20, [False] * 12 + [True] * 8).verdict == "regressed"


def test_non_inferiority_margin():
    same = compare_paired([True] * 10 + [False] * 10, [True] * 10 + [False] * 10)
    assert non_inferior(same, 0.1)
    drop = compare_paired([True] * 30 + [False] * 34, [True] * 29 + [False] * 35)
    assert non_inferior(drop, 0.15) and not non_inferior(drop, 0.01)


def test_rate_text_shows_counts_and_interval():
    assert rate_text(5, 32).startswith("5/32 (16%, 95% CI 7%-")


def test_seed_aggregation_pools_counts_and_shows_spread():
    from qualification.stats import aggregate_seeds

    agg = aggregate_seeds([(10, 20), (14, 20), (6, 20)])
    assert (agg.k, agg.n, agg.seeds) == (30, 60, 3)
    assert agg.spread == (0.3, 0.7)
    assert agg.interval == wilson(30, 60)


def test_paired_aggregation_over_repeats():
    from qualification.stats import aggregate_paired

    # Each repeat alone is inconclusive; three independent repeats agreeing are not.
    repeat = compare_paired([False] * 4 + [True] * 10, [True] * 4 + [True] * 10)
    assert repeat.verdict == "inconclusive"
    pooled = aggregate_paired([repeat, repeat, repeat])
    assert (pooled.n, pooled.improved_pairs, pooled.worsened_pairs) == (42, 12, 0)
    assert pooled.base_k == 30 and pooled.trained_k == 42
    assert pooled.verdict == "improved" and "3 repeats pooled" in pooled.test


def test_trials_of_several_seeds_pool_their_discordant_pairs():
    """Two seeds' held-out rows (10 items each): 3+4 improved and 1+1 worsened pairs pool to b=7, c=2 over
    20 items; exact McNemar p = 2 * P(X <= 2 | 9, 1/2) = 2 * 46/512; a split one seed lacks is left out."""
    from qualification.gates import pooled_evaluation

    def row(base_k, trained_k, improved, worsened):
        return {"n": 10, "base_k": base_k, "trained_k": trained_k, "improved_pairs": improved,
                "worsened_pairs": worsened, "p_value": 1.0, "difference": 0.0, "difference_ci": [0, 0],
                "verdict": "inconclusive"}

    pooled = pooled_evaluation([{"heldout": row(5, 7, 3, 1), "retention": row(9, 9, 0, 0)},
                                {"heldout": row(5, 8, 4, 1)}], 0.95)
    assert set(pooled) == {"heldout"}
    heldout = pooled["heldout"]
    assert (heldout["n"], heldout["base_k"], heldout["trained_k"]) == (20, 10, 15)
    assert (heldout["improved_pairs"], heldout["worsened_pairs"]) == (7, 2)
    assert heldout["p_value"] == pytest.approx(2 * 46 / 512)
    assert heldout["difference"] == pytest.approx(0.25) and heldout["verdict"] == "inconclusive"
    assert heldout["trained_per_seed"] == [0.7, 0.8] and heldout["trained_spread"] == [0.7, 0.8]
    assert heldout["seeds"] == 2 and "2 repeats pooled" in heldout["test"]


def test_pass_hat_k_is_tau2_benchs_mean_of_c_choose_k_over_n_choose_k():
    from qualification.stats import pass_hat_k

    # Items with 2, 4 and 0 successes of 4 attempts: pass^1 = (2+4+0)/12; pass^2 = (1 + 6 + 0)/6/3;
    # pass^4 = (0 + 1 + 0)/3.
    outcomes = [(2, 4), (4, 4), (0, 4)]
    assert pass_hat_k(outcomes, 1) == pytest.approx(0.5)
    assert pass_hat_k(outcomes, 2) == pytest.approx((1 / 6 + 1 + 0) / 3)
    assert pass_hat_k(outcomes, 4) == pytest.approx(1 / 3)
    assert pass_hat_k([(3, 3)] * 5, 3) == 1.0 and pass_hat_k([(0, 3)] * 5, 1) == 0.0
    with pytest.raises(ValueError, match="at least k attempts"):
        pass_hat_k([(1, 2)], 3)
    with pytest.raises(ValueError, match="no items"):
        pass_hat_k([], 1)


def test_sampled_figures_leave_out_items_with_an_infrastructure_error():
    from qualification.gates.stages import sampled_figures

    figures = sampled_figures({"base": {"a": [True, False], "b": [False, False], "c": [True, None]},
                               "trained": {"a": [True, True], "b": [True, False], "c": [True, True]}})
    assert figures["attempts"] == 2 and figures["excluded_items"] == 1 and figures["items"] == 2
    assert figures["base"] == {"pass@1": 0.25, "pass^k": {"1": 0.25, "2": 0.0}}
    assert figures["trained"] == {"pass@1": 0.75, "pass^k": {"1": 0.75, "2": 0.5}}
