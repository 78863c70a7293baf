"""Honest statistics for small evaluation sets: intervals, paired tests, verdict words."""

from __future__ import annotations

import math
from dataclasses import dataclass


def wilson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for k successes in n trials."""
    if n == 0:
        return 0.0, 1.0
    z = _z(confidence)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper-Pearson) interval, by bisection on the binomial tail."""
    if n == 0:
        return 0.0, 1.0
    alpha = 1 - confidence
    lower = 0.0 if k == 0 else _bisect(lambda p: _binom_sf(k, n, p) - alpha / 2)
    upper = 1.0 if k == n else _bisect(lambda p: alpha / 2 - _binom_cdf(k, n, p))
    return lower, upper


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: b = base fail & trained pass, c = base pass & trained fail."""
    m = b + c
    if m == 0:
        return 1.0
    tail = _binom_cdf(min(b, c), m, 0.5)
    return min(1.0, 2 * tail)


@dataclass(frozen=True)
class PairedComparison:
    n: int
    base_k: int
    trained_k: int
    improved_pairs: int  # base failed, trained succeeded
    worsened_pairs: int  # base succeeded, trained failed
    p_value: float
    difference: float
    difference_ci: tuple[float, float]
    verdict: str  # improved | inconclusive | regressed
    test: str = "exact McNemar (two-sided)"


def compare_paired(base: list[bool], trained: list[bool], confidence: float = 0.95) -> PairedComparison:
    """Base vs trained on the same items. The CI of the difference is exact, conditional on the
    discordant pairs (Clopper-Pearson on b/(b+c), scaled by (b+c)/n)."""
    if len(base) != len(trained):
        raise ValueError(f"paired comparison needs equal lengths, got {len(base)} and {len(trained)}")
    n = len(base)
    b = sum(1 for x, y in zip(base, trained, strict=True) if not x and y)
    c = sum(1 for x, y in zip(base, trained, strict=True) if x and not y)
    m = b + c
    p_value = mcnemar_exact(b, c)
    difference = (b - c) / n if n else 0.0
    if m == 0 or n == 0:
        ci = (0.0, 0.0)
    else:
        low, high = clopper_pearson(b, m, confidence)
        ci = (m / n * (2 * low - 1), m / n * (2 * high - 1))
    alpha = 1 - confidence
    verdict = "inconclusive"
    if p_value < alpha:
        verdict = "improved" if b > c else "regressed"
    return PairedComparison(n=n, base_k=sum(base), trained_k=sum(trained), improved_pairs=b, worsened_pairs=c,
                            p_value=p_value, difference=difference, difference_ci=ci, verdict=verdict)


def non_inferior(comparison: PairedComparison, margin: float) -> bool:
    """Retention holds when the lower bound of (trained - base) is above -margin."""
    return comparison.difference_ci[0] > -margin


def rate_text(k: int, n: int, confidence: float = 0.95) -> str:
    low, high = wilson(k, n, confidence)
    return f"{k}/{n} ({k / n:.0%}, {confidence:.0%} CI {low:.0%}-{high:.0%})" if n else "0/0"


def _z(confidence: float) -> float:
    # Inverse normal CDF by bisection on erf; exact enough for interval widths.
    target = 1 - (1 - confidence) / 2
    return _bisect(lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2))) - target, 0.0, 10.0)


def _binom_pmf(i: int, n: int, p: float) -> float:
    if p in (0.0, 1.0):
        return float((p == 0.0 and i == 0) or (p == 1.0 and i == n))
    return math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
                    + i * math.log(p) + (n - i) * math.log1p(-p))


def _binom_cdf(k: int, n: int, p: float) -> float:
    return min(1.0, sum(_binom_pmf(i, n, p) for i in range(0, k + 1)))


def _binom_sf(k: int, n: int, p: float) -> float:
    """P(X >= k)."""
    return min(1.0, sum(_binom_pmf(i, n, p) for i in range(k, n + 1)))


def _bisect(f, low: float = 0.0, high: float = 1.0, iterations: int = 100) -> float:
    f_low = f(low)
    for _ in range(iterations):
        mid = (low + high) / 2
        f_mid = f(mid)
        if (f_mid > 0) == (f_low > 0):
            low, f_low = mid, f_mid
        else:
            high = mid
    return (low + high) / 2


@dataclass(frozen=True)
class SeedAggregate:
    """Success over repeated seeds: pooled k/n with a Wilson interval, and the per-seed spread."""

    seeds: int
    k: int
    n: int
    interval: tuple[float, float]
    per_seed: tuple[tuple[int, int], ...]
    spread: tuple[float, float]  # lowest and highest per-seed rate


def aggregate_seeds(results: list[tuple[int, int]], confidence: float = 0.95) -> SeedAggregate:
    """Pools (k, n) from independent repeats (different seeds); the spread shows seed-to-seed variation
    that a pooled interval alone would hide."""
    if not results:
        raise ValueError("no results to aggregate")
    k, n = sum(r[0] for r in results), sum(r[1] for r in results)
    rates = [rk / rn for rk, rn in results if rn]
    return SeedAggregate(seeds=len(results), k=k, n=n, interval=wilson(k, n, confidence),
                         per_seed=tuple(results), spread=(min(rates, default=0.0), max(rates, default=0.0)))


def aggregate_paired(comparisons: list[PairedComparison], confidence: float = 0.95) -> PairedComparison:
    """One verdict over repeats: the exact McNemar test on the discordant pairs of all repeats together
    (valid when repeats are independent: different training seeds or different items)."""
    if not comparisons:
        raise ValueError("no comparisons to aggregate")
    b = sum(c.improved_pairs for c in comparisons)
    c_ = sum(c.worsened_pairs for c in comparisons)
    n = sum(c.n for c in comparisons)
    base = [False] * b + [True] * c_ + [True] * sum(c.base_k - c.worsened_pairs for c in comparisons)
    trained = [True] * b + [False] * c_ + [True] * sum(c.base_k - c.worsened_pairs for c in comparisons)
    rest = n - len(base)
    result = compare_paired(base + [False] * rest, trained + [False] * rest, confidence)
    return PairedComparison(**{**result.__dict__, "test": f"exact McNemar (two-sided), {len(comparisons)} repeats pooled"})


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment of p-values for several tests at once (family-wise error), in the
    order given: the i-th smallest p is multiplied by (m - i), and adjusted values never decrease."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted = [1.0] * len(p_values)
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


@dataclass(frozen=True)
class ArmPair:
    """Two arms' trained policies on the same held-out items, Holm-adjusted over the pairs: exact McNemar on
    one outcome per item, or the exact sign test on per-item success rates (several seeds or attempts)."""

    first: str
    second: str
    n: int
    first_k: float  # items solved (one outcome per item) or the sum of per-item success rates
    second_k: float
    only_first: int  # items on which the first arm did better (solved, or a higher rate) than the second
    only_second: int
    p_value: float
    p_holm: float
    verdict: str  # "<arm> better" | "indistinguishable"


def pairwise_arms(outcomes: dict[str, dict[str, bool]] | dict[str, dict[str, float]], confidence: float = 0.95,
                  test: str = "exact McNemar") -> tuple[list[ArmPair], str]:
    """Every pair of arms on the items all of them were evaluated on (arm -> task id -> success, or success
    rate over seeds and attempts), and a ranking sentence that orders arms only where a Holm-adjusted test
    says so. On rates the same exact binomial test on the items where the arms differ is the sign test."""
    arms = list(outcomes)
    items = sorted(set.intersection(*(set(o) for o in outcomes.values()))) if outcomes else []
    raw = []
    for i, first in enumerate(arms):
        for second in arms[i + 1:]:
            a, b = [outcomes[first][t] for t in items], [outcomes[second][t] for t in items]
            only_first = sum(1 for x, y in zip(a, b, strict=True) if x > y)
            only_second = sum(1 for x, y in zip(a, b, strict=True) if y > x)
            raw.append((first, second, round(sum(a), 4), round(sum(b), 4), only_first, only_second,
                        mcnemar_exact(only_first, only_second)))
    adjusted = holm([r[-1] for r in raw])
    alpha = 1 - confidence
    pairs = []
    for (first, second, first_k, second_k, only_first, only_second, p), p_holm in zip(raw, adjusted, strict=True):
        verdict = "indistinguishable"
        if p_holm < alpha:
            verdict = f"{first if only_first > only_second else second} better"
        pairs.append(ArmPair(first, second, len(items), first_k, second_k, only_first, only_second, p, p_holm,
                             verdict))
    better = [pair for pair in pairs if pair.verdict != "indistinguishable"]
    if not pairs:
        sentence = "one arm: nothing to rank"
    elif not better:
        sentence = (f"no stack is distinguishable from another on these {len(items)} items ({len(pairs)} pairs, "
                    f"{test}, Holm-adjusted at {confidence:.0%})")
    else:
        sentence = "; ".join(f"{pair.verdict.removesuffix(' better')} > "
                             f"{pair.second if pair.verdict.startswith(pair.first) else pair.first} "
                             f"(p_holm={pair.p_holm:.3g})" for pair in better) + \
                   f"; every other pair indistinguishable ({len(pairs)} pairs, Holm-adjusted at {confidence:.0%})"
    return pairs, sentence


def detectable_difference(n: int, discordant: int, confidence: float = 0.95, power: float = 0.8) -> float | None:
    """The smallest paired difference in success rate a two-sided McNemar test on `n` items would detect
    with probability `power`, given the share of discordant items observed (at least 2 of n assumed, so a
    run without discordance does not claim a precision it has not shown). Normal approximation
    (Connor 1987, dropping the second-order term): (z_{1-alpha/2} + z_power) * sqrt(psi / n), capped at 1."""
    if n <= 0:
        return None
    psi = max(discordant, 2) / n
    return min(1.0, (_z(confidence) + _z(2 * power - 1)) * math.sqrt(psi / n))


def items_needed(effect: float, discordance: float, confidence: float = 0.95, power: float = 0.8) -> int:
    """Paired items (items x seeds, when seeds are pooled) a two-sided McNemar test needs to detect a
    difference of `effect` in success rate with probability `power`, when a share `discordance` of items
    come out differently for the two policies (the inverse of detectable_difference)."""
    if not 0 < effect <= discordance <= 1:
        raise ValueError(f"need 0 < effect ({effect}) <= discordance ({discordance}) <= 1: a difference in success "
                         "rate cannot exceed the share of items on which the two policies differ")
    return math.ceil((_z(confidence) + _z(2 * power - 1)) ** 2 * discordance / effect ** 2)


def pass_hat_k(outcomes: list[tuple[int, int]], k: int) -> float:
    """tau2-bench's pass^k: the mean over items of C(c, k) / C(n, k), for c successes in n attempts of each
    item; the chance that k attempts drawn from an item's n all succeed. pass^1 is pass@1 (the mean c/n)."""
    if not outcomes:
        raise ValueError("pass^k of no items")
    if k < 1 or any(n < k for _, n in outcomes):
        raise ValueError(f"pass^{k} needs k >= 1 and at least k attempts of every item")
    return sum(math.comb(c, k) / math.comb(n, k) for c, n in outcomes) / len(outcomes)
