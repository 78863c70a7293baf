"""The mismatch panel pinned to hand-computed values (qualification/gates/mismatch.py)."""

import math

import pytest
from qualification.gates.mismatch import MismatchPanel

LN2 = math.log(2)


def test_identical_logprobs_give_the_neutral_panel():
    panel = MismatchPanel()
    panel.add(1, [-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5])
    figures = panel.summary()["overall"]
    assert figures["tokens"] == 3 and figures["sequences"] == 1
    for name in ("mean_abs_logprob_diff", "max_abs_logprob_diff", "kl_k1", "kl_k3", "chi2_token", "chi2_sequence",
                 "ratio_outside_band"):
        assert figures[name] == 0.0, name
    for name in ("ratio_min", "ratio_mean", "ratio_max", "effective_sample_size", "token_mult_prob_error",
                 "perplexity_ratio"):
        assert figures[name] == pytest.approx(1.0), name
    assert panel.gate().passed and panel.gate().measured == pytest.approx(1.0)


def test_a_ratio_of_two_and_a_half():
    """d = log p_train - log p_sample = (ln 2, -ln 2): r = (2, 0.5), one sequence whose product is 1."""
    panel = MismatchPanel()
    panel.add(1, [-1.0 + LN2, -1.0 - LN2], [-1.0, -1.0])
    f = panel.summary()["overall"]
    assert f["mean_abs_logprob_diff"] == pytest.approx(LN2) and f["max_abs_logprob_diff"] == pytest.approx(LN2)
    assert f["kl_k1"] == pytest.approx(0.0, abs=1e-12)
    assert f["kl_k3"] == pytest.approx(0.25)  # ((2 - 1 - ln2) + (0.5 - 1 + ln2)) / 2
    assert f["chi2_token"] == pytest.approx(0.625)  # (1 + 0.25) / 2
    assert f["chi2_sequence"] == pytest.approx(0.0, abs=1e-12)  # prod r = 1
    assert (f["ratio_min"], f["ratio_mean"], f["ratio_max"]) == pytest.approx((0.5, 1.25, 2.0))
    assert f["effective_sample_size"] == pytest.approx(6.25 / 8.5)  # (sum r)^2 / (N sum r^2)
    assert f["ratio_outside_band"] == 0.0  # 0.5 and 2 are on the band's edges, inside
    assert f["token_mult_prob_error"] == pytest.approx(2.0)  # mean exp|d|
    assert f["perplexity_ratio"] == pytest.approx(1.0)
    gate = panel.gate()
    assert not gate.passed and gate.measured == pytest.approx(2.0) and gate.threshold == 1.1


def test_per_step_figures_and_the_median_over_steps():
    panel = MismatchPanel()
    panel.add(1, [-1.0], [-1.0])  # exp|d| = 1
    panel.add(2, [-1.0 + LN2], [-1.0])  # 2
    panel.add(3, [-1.0 + math.log(1.05)], [-1.0])  # 1.05
    panel.add(3, [-2.0 - math.log(3)], [-2.0])  # r = 1/3: outside the band; the step's error (1.05 + 3) / 2
    summary = panel.summary()
    assert [summary["per_step"][s]["token_mult_prob_error"] for s in (1, 2, 3)] == pytest.approx([1.0, 2.0, 2.025])
    assert summary["per_step"][3]["sequences"] == 2 and summary["per_step"][3]["ratio_outside_band"] == 0.5
    assert summary["median_token_mult_prob_error"] == pytest.approx(2.0)
    assert summary["overall"]["kl_k1"] == pytest.approx((0 - LN2 - math.log(1.05) + math.log(3)) / 4)
    assert summary["overall"]["perplexity_ratio"] == pytest.approx(math.exp(summary["overall"]["kl_k1"]))


def test_no_pairs_fail_the_gate_and_non_finite_logprobs_are_left_out_and_counted():
    panel = MismatchPanel()
    assert not panel.gate().passed and panel.gate().detail == "no trainer logprobs to compare"
    assert panel.max_abs_diff() == 0.0
    panel.add(4, [float("-inf"), -1.0], [-1.0, -1.0])  # the whole sequence is left out
    assert panel.max_abs_diff() == math.inf and panel.summary()["sequences_not_finite"] == 1
    assert panel.summary()["overall"]["tokens"] == 0
    panel.add(4, [-1.0 + LN2], [-1.0])
    panel.add(5, [-1.0], [float("nan")])
    summary = panel.summary()
    assert summary["sequences_not_finite"] == 2 and panel.max_abs_diff() == math.inf
    assert summary["overall"]["tokens"] == 1 and summary["overall"]["max_abs_logprob_diff"] == pytest.approx(LN2)
    assert list(summary["per_step"]) == [4]
    with pytest.raises(ValueError, match="2 trainer logprobs but 1 sampler logprobs"):
        panel.add(4, [-1.0, -1.0], [-1.0])


def test_pairs_reduced_in_several_flushes_give_the_figures_of_one(monkeypatch):
    """Pairs wait in arrays and numpy reduces them FLUSH_TOKENS at a time: a step split across flushes, and a
    flush in the middle of the run, change no figure."""
    from qualification.gates import mismatch

    sequences = [(1 + k // 3, [-1.0 - 0.1 * k, -0.5 + 0.05 * k], [-1.0, -0.5 + 0.3 * (k % 2)]) for k in range(9)]
    whole = MismatchPanel()
    for k, (step, trainer, sampler) in enumerate(sequences):
        whole.add(step, trainer, sampler, f"sequence {k}")
    monkeypatch.setattr(mismatch, "FLUSH_TOKENS", 3)
    pieces = MismatchPanel()
    for k, (step, trainer, sampler) in enumerate(sequences):
        pieces.add(step, trainer, sampler, f"sequence {k}")
    expected, found = whole.summary(), pieces.summary()
    assert found["per_step"].keys() == expected["per_step"].keys() == {1, 2, 3}
    for step in (1, 2, 3):
        assert found["per_step"][step] == pytest.approx(expected["per_step"][step], rel=1e-12)
    assert found["overall"] == pytest.approx(expected["overall"], rel=1e-12)
    assert found["overall"]["tokens"] == 18 and found["overall"]["sequences"] == 9
    assert pieces.max_abs_diff() == pytest.approx(max(abs(t - s) for _, ts, ss in sequences for t, s in zip(ts, ss)))
    # |d| is largest at sequence 8's first pair: -1.8 against -1.0
    assert pieces.largest == whole.largest == mismatch.LargestGap(gap=pytest.approx(0.8), sequence="sequence 8",
                                                                  index=0, trainer=-1.8, sampler=-1.0)


def test_the_largest_gap_is_located_across_merged_panels_and_never_at_a_pair_that_is_not_finite():
    first, second = MismatchPanel(), MismatchPanel()
    first.add(1, [-1.0, -2.0], [-1.0, -2.5], "a")
    second.add(1, [-1.0, float("-inf")], [-9.0, -1.0], "not finite")  # left out: its gap of 8 is not located
    second.add(2, [-0.5, -0.1, -0.7], [-0.5, -0.1, -0.1], "b")
    first.merge(second)
    assert (first.largest.sequence, first.largest.index, first.largest.trainer) == ("b", 2, -0.7)
    assert first.max_abs_diff() == math.inf  # the sequence that is not finite still fails agreement
