"""Train-inference mismatch, from the logprobs of the sampled tokens: the sampler's (trajectories.jsonl)
against the trainer's recomputation with the weights that sampled them (training.jsonl old_logprobs).

Per token, d = log p_train - log p_sample and the importance ratio r = exp(d). The figures are the ones
the trainers teams use watch: mean and max |d|; KL(sampler || trainer) estimated by k1 = mean(-d) and by
k3 = mean(r - 1 - d) (Schulman's estimators, as verl's rollout_corr reports them); chi-square per token
mean((r - 1)^2) and per sequence mean((prod r - 1)^2); the ratio's min, mean and max; the effective
sample size (sum r)^2 / (N sum r^2); the share of tokens with r outside [0.5, 2]; NeMo RL's
token_mult_prob_error mean(exp|d|) (its CI requires the median over steps below 1.1); and the
perplexity ratio exp(mean(-log p_train)) / exp(mean(-log p_sample)) = exp(k1)."""

from __future__ import annotations

import math
import statistics
from bisect import bisect_right
from itertools import repeat
from operator import mul, sub
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from runner_contracts import GateResult

BAND_LOG = math.log(2.0)  # ratios in [0.5, 2] are |d| <= ln 2; compared in log space, so r = exp(ln 2) counts as 2


@dataclass
class _Figures:
    tokens: int = 0
    sequences: int = 0
    sum_abs: float = 0.0
    max_abs: float = 0.0
    sum_neg_d: float = 0.0
    sum_k3: float = 0.0
    sum_chi2: float = 0.0
    sum_chi2_sequence: float = 0.0
    sum_r: float = 0.0
    sum_r2: float = 0.0
    min_r: float = math.inf
    max_r: float = 0.0
    outside: int = 0
    sum_mult: float = 0.0

    def add(self, terms: tuple) -> None:
        """Adds one sequence's `sequence_terms`."""
        (tokens, sum_abs, max_abs, sum_d, sum_k3, sum_chi2, sum_r, sum_r2, min_r, max_r, outside, sum_mult) = terms
        self.tokens += tokens
        self.sequences += 1
        self.sum_abs += sum_abs
        self.max_abs = max(self.max_abs, max_abs)
        self.sum_neg_d -= sum_d
        self.sum_k3 += sum_k3
        self.sum_chi2 += sum_chi2
        self.sum_chi2_sequence += (math.exp(sum_d) - 1.0) ** 2
        self.sum_r += sum_r
        self.sum_r2 += sum_r2
        self.min_r, self.max_r = min(self.min_r, min_r), max(self.max_r, max_r)
        self.outside += outside
        self.sum_mult += sum_mult

    def summary(self) -> dict[str, float | int | None]:
        n = self.tokens
        if not n:
            return {"tokens": 0, "sequences": self.sequences}
        k1 = self.sum_neg_d / n
        return {
            "tokens": n, "sequences": self.sequences,
            "mean_abs_logprob_diff": self.sum_abs / n, "max_abs_logprob_diff": self.max_abs,
            "kl_k1": k1, "kl_k3": self.sum_k3 / n,
            "chi2_token": self.sum_chi2 / n, "chi2_sequence": self.sum_chi2_sequence / self.sequences,
            "ratio_min": self.min_r, "ratio_mean": self.sum_r / n, "ratio_max": self.max_r,
            "effective_sample_size": self.sum_r ** 2 / (n * self.sum_r2),
            "ratio_outside_band": self.outside / n,
            "token_mult_prob_error": self.sum_mult / n,
            "perplexity_ratio": math.exp(k1),
        }


def sequence_terms(trainer: Sequence[float], sampler: Sequence[float]) -> tuple:
    """One sequence's sums over its tokens, each per-token term as the module docstring writes it (summed in C)."""
    d = list(map(sub, trainer, sampler))
    if len(d) != len(trainer) or len(d) != len(sampler):
        raise ValueError(f"{len(trainer)} trainer logprobs but {len(sampler)} sampler logprobs")
    abs_d = list(map(abs, d))
    r = list(map(math.exp, d))
    r_minus_1 = list(map(sub, r, repeat(1.0, len(r))))
    return (len(d), sum(abs_d), max(abs_d, default=0.0), sum(d), sum(map(sub, r_minus_1, d)),
            sum(map(mul, r_minus_1, r_minus_1)), sum(r), sum(map(mul, r, r)), min(r, default=math.inf),
            max(r, default=0.0), len(abs_d) - bisect_right(sorted(abs_d), BAND_LOG + 1e-12), sum(map(math.exp, abs_d)))


@dataclass
class MismatchPanel:
    """Accumulates (trainer, sampler) logprob pairs per training step; one add() is one sequence."""

    steps: dict[int, _Figures] = field(default_factory=lambda: defaultdict(_Figures))
    overall: _Figures = field(default_factory=_Figures)

    def add(self, step: int, trainer: Sequence[float], sampler: Sequence[float]) -> None:
        if not trainer:
            return
        if not (all(map(math.isfinite, trainer)) and all(map(math.isfinite, sampler))):
            raise ValueError(f"step {step}: a logprob is not finite")
        terms = sequence_terms(trainer, sampler)
        self.steps[step].add(terms)
        self.overall.add(terms)

    def summary(self) -> dict:
        """{"overall": figures, "per_step": {step: figures}, "median_token_mult_prob_error": x}."""
        per_step = {step: figures.summary() for step, figures in sorted(self.steps.items())}
        errors = [f["token_mult_prob_error"] for f in per_step.values() if f.get("tokens")]
        return {"overall": self.overall.summary(), "per_step": per_step,
                "median_token_mult_prob_error": statistics.median(errors) if errors else None}

    def gate(self, max_median_token_mult_prob_error: float = 1.1) -> GateResult:
        """NeMo RL's CI condition: the median over steps of token_mult_prob_error below the threshold."""
        median = self.summary()["median_token_mult_prob_error"]
        overall = self.overall.summary()
        return GateResult(
            name="trace:token-mult-prob-error", passed=median is not None and median < max_median_token_mult_prob_error,
            measured=median, threshold=max_median_token_mult_prob_error,
            detail=("no trainer logprobs to compare" if median is None else
                    f"median over {len(self.steps)} step(s) of mean exp|log p_train - log p_sample|; over all "
                    f"{overall['tokens']} tokens: k3 KL {overall['kl_k3']:.3g}, ratio "
                    f"{overall['ratio_min']:.4g}..{overall['ratio_max']:.4g}, ESS {overall['effective_sample_size']:.4f}"))
