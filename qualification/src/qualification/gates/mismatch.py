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
import operator
import statistics
import struct
from array import array
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from itertools import compress

from runner_contracts import GateResult

BAND_LOG = math.log(2.0)  # ratios in [0.5, 2] are |d| <= ln 2; compared in log space, so r = exp(ln 2) counts as 2


FLUSH_TOKENS = 1 << 14  # pairs that wait before numpy reduces them: 2 x 128 KB of doubles, whose temporaries stay in cache
DOUBLE = struct.calcsize("d")  # bytes a packed logprob takes


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

    @classmethod
    def of(cls, d, tokens) -> _Figures:
        """The figures of sequences whose pairs' differences d = log p_train - log p_sample lie one after another
        in `d` (finite), `tokens` pairs each (numpy arrays). Totals over all pairs; only chi-square per sequence
        needs a sequence's own sum."""
        import numpy as np

        abs_d, r = np.abs(d), np.exp(d)
        r_minus_1 = r - 1.0
        sum_d = np.add.reduceat(d, np.cumsum(tokens) - tokens)
        return cls(tokens=int(d.size), sequences=int(tokens.size), sum_abs=float(abs_d.sum()),
                   max_abs=float(abs_d.max()), sum_neg_d=-float(sum_d.sum()), sum_k3=float((r_minus_1 - d).sum()),
                   sum_chi2=float((r_minus_1 * r_minus_1).sum()), sum_chi2_sequence=float((np.expm1(sum_d) ** 2).sum()),
                   sum_r=float(r.sum()), sum_r2=float((r * r).sum()), min_r=float(r.min()), max_r=float(r.max()),
                   outside=int(np.count_nonzero(abs_d > BAND_LOG + 1e-12)), sum_mult=float(np.exp(abs_d).sum()))

    def merge(self, other: _Figures) -> None:
        for name in (f.name for f in fields(self)):
            combine = min if name.startswith("min_") else max if name.startswith("max_") else operator.add
            setattr(self, name, combine(getattr(self, name), getattr(other, name)))

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


def _nothing_waiting() -> tuple[array, array, bytearray, bytearray, list[str | None]]:
    """(steps, lengths, trainer logprobs, sampler logprobs, labels) of the sequences waiting to be reduced; the
    logprobs as packed doubles (struct.pack converts a list 2-3x faster than array.extend)."""
    return array("q"), array("q"), bytearray(), bytearray(), []


@dataclass(frozen=True)
class LargestGap:
    """Where max |log p_train - log p_sample| is: the sequence's label, the pair's index in it (from 0), both
    logprobs."""

    gap: float
    sequence: str | None
    index: int
    trainer: float
    sampler: float


@dataclass
class MismatchPanel:
    """Accumulates (trainer, sampler) logprob pairs per training step; one add() is one sequence. Pairs wait
    in typed arrays and are reduced with numpy FLUSH_TOKENS at a time, in memory that does not grow."""

    steps: dict[int, _Figures] = field(default_factory=lambda: defaultdict(_Figures))
    overall: _Figures = field(default_factory=_Figures)
    not_finite: int = 0  # sequences left out: a logprob on either side was not finite
    largest: LargestGap | None = None  # where the largest finite |d| is

    def __post_init__(self) -> None:
        self._waiting = _nothing_waiting()

    def add(self, step: int, trainer: Sequence[float], sampler: Sequence[float], label: str | None = None) -> None:
        """One sequence's pairs, as lists of floats."""
        if len(trainer) != len(sampler):
            raise ValueError(f"{len(trainer)} trainer logprobs but {len(sampler)} sampler logprobs")
        self.add_packed(step, struct.pack(f"{len(trainer)}d", *trainer), struct.pack(f"{len(sampler)}d", *sampler),
                        label)

    def add_packed(self, step: int, trainer: bytes, sampler: bytes, label: str | None = None) -> None:
        """One sequence's pairs, as packed doubles of the same length; `label` names the sequence in `largest`.
        A sequence with a value that is not finite is left out of the figures and counted (`not_finite`);
        max_abs_diff() is then infinite."""
        if len(trainer) != len(sampler):
            raise ValueError(f"{len(trainer) // DOUBLE} trainer logprobs but {len(sampler) // DOUBLE} sampler logprobs")
        if not trainer:
            return
        steps, lengths, trainers, samplers, labels = self._waiting
        steps.append(step)
        lengths.append(len(trainer) // DOUBLE)
        trainers += trainer
        samplers += sampler
        labels.append(label)
        if len(trainers) >= FLUSH_TOKENS * DOUBLE:
            self._reduce()

    def _reduce(self) -> None:
        if not self._waiting[0]:
            return
        import numpy as np

        steps, tokens, trainer, sampler, labels = self._waiting
        self._waiting = _nothing_waiting()
        steps, tokens = np.frombuffer(steps, dtype=np.int64), np.frombuffer(tokens, dtype=np.int64)
        trainer, sampler = np.frombuffer(trainer, dtype=np.float64), np.frombuffer(sampler, dtype=np.float64)
        with np.errstate(all="ignore"):  # a sequence that is not finite is left out below, its figures unread
            d = trainer - sampler
            finite = np.isfinite(d)
            if not finite.all():
                finite = np.logical_and.reduceat(finite, np.cumsum(tokens) - tokens)
                self.not_finite += int(finite.size - np.count_nonzero(finite))
                pairs = np.repeat(finite, tokens)
                d, trainer, sampler = d[pairs], trainer[pairs], sampler[pairs]
                steps, tokens = steps[finite], tokens[finite]
                labels = list(compress(labels, finite.tolist()))
                if not steps.size:
                    return
            self._note_largest(d, trainer, sampler, tokens, labels)
            if steps[0] == steps[-1] and (steps == steps[0]).all():  # the usual flush: its masks would cost ~20%
                by_step = [(int(steps[0]), d, tokens)]
            else:
                token_steps = np.repeat(steps, tokens)
                by_step = [(step, d[token_steps == step], tokens[steps == step]) for step in np.unique(steps).tolist()]
            for step, step_d, step_tokens in by_step:
                figures = _Figures.of(step_d, step_tokens)
                self.steps[step].merge(figures)
                self.overall.merge(figures)

    def _note_largest(self, d, trainer, sampler, tokens, labels: list[str | None]) -> None:
        import numpy as np

        at = int(np.abs(d).argmax())
        if self.largest is not None and abs(float(d[at])) <= self.largest.gap:
            return
        ends = np.cumsum(tokens)
        sequence = int(np.searchsorted(ends, at, side="right"))
        self.largest = LargestGap(gap=abs(float(d[at])), sequence=labels[sequence],
                                  index=at - int(ends[sequence] - tokens[sequence]), trainer=float(trainer[at]),
                                  sampler=float(sampler[at]))

    def merge(self, other: MismatchPanel) -> None:
        """Adds the pairs another panel holds (an audit done in parts), reduced first on both sides."""
        self._reduce()
        other._reduce()
        self.overall.merge(other.overall)
        self.not_finite += other.not_finite
        if other.largest is not None and (self.largest is None or other.largest.gap > self.largest.gap):
            self.largest = other.largest
        for step, figures in other.steps.items():
            self.steps[step].merge(figures)

    def max_abs_diff(self) -> float:
        """max |log p_train - log p_sample| over every pair added (0.0 when none; inf when one is not finite)."""
        self._reduce()
        return math.inf if self.not_finite else self.overall.max_abs

    def summary(self) -> dict:
        """{"overall": figures, "per_step": {step: figures}, "median_token_mult_prob_error": x,
        "sequences_not_finite": n}."""
        self._reduce()
        per_step = {step: figures.summary() for step, figures in sorted(self.steps.items())}
        errors = [f["token_mult_prob_error"] for f in per_step.values() if f.get("tokens")]
        return {"overall": self.overall.summary(), "per_step": per_step,
                "median_token_mult_prob_error": statistics.median(errors) if errors else None,
                "sequences_not_finite": self.not_finite}

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
