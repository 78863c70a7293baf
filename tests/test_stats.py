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
