"""Paired comparison of two groups of runs: per-seed differences, their mean, a Student-t confidence interval, a
plain verdict and a Wilcoxon signed-rank p-value (FedVG's tables test each method against FedVG this way). The
one place these statistics are computed; ``compare`` tabulates them and ``report`` writes them to ``report.md``."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

#: the confidence level of every interval a report prints
CONFIDENCE = 0.95

BETTER, WORSE, NOISE, TOO_FEW, NOT_FINITE = "better", "worse", "within noise", "n < 2: no interval", "n/a (nan values)"


@dataclass(frozen=True)
class PairedDifference:
    """A method minus its baseline, paired by seed (only the seeds both have, in seed order): the per-seed
    ``differences``, their ``mean`` (None without a pair), the ``CONFIDENCE`` interval of the mean difference
    (``ci``: Student t with n - 1 degrees of freedom; None below 2 pairs) and the ``verdict``: "better" or
    "worse" when the interval excludes 0 (in the metric's direction), "within noise" when it holds 0,
    "n < 2: no interval" below two pairs, "n/a (nan values)" when a run's value is not finite."""

    seeds: tuple[int, ...]
    differences: tuple[float, ...]
    mean: float | None
    ci: tuple[float, float] | None
    verdict: str
    #: the two-sided Wilcoxon signed-rank p-value of the differences (``wilcoxon_p``); None where there is none
    wilcoxon: float | None = None

    @property
    def n(self) -> int:
        return len(self.differences)

    @property
    def min_wilcoxon_p(self) -> float | None:
        """The smallest two-sided p the test can give these pairs: ``smallest_p`` of the non-zero differences."""
        m = sum(d != 0 for d in self.differences)
        return smallest_p(m) if m else None


def smallest_p(n: int) -> float:
    """The smallest two-sided Wilcoxon signed-rank p-value ``n`` untied non-zero differences can give: all of one
    sign, the exact null probability of a rank sum of 0 (or n(n+1)/2) is 1/2^n each tail, so 2^(1 - n):
    0.25 with 3 pairs, 0.125 with 4, 0.0625 with 5; 6 pairs are the fewest that can reach 0.05."""
    return 2.0 ** (1 - n)


def wilcoxon_p(differences: Sequence[float]) -> float | None:
    """Two-sided Wilcoxon signed-rank test that the differences are symmetric about 0 (``scipy.stats.wilcoxon``,
    zero differences dropped: ``zero_method="wilcox"``; its ``method="auto"``: the exact null distribution up
    to 50 untied differences, exhaustive permutations up to 13 with ties or zeros). None without a non-zero
    difference or with a non-finite one. FedVG (Sec. 5) reports the test between methods without saying what
    is paired; here it is seeds, the same pairs as the interval."""
    from scipy import stats

    arr = np.asarray(differences, dtype=np.float64)
    if not np.all(np.isfinite(arr)) or not np.any(arr != 0):
        return None
    untied = bool(np.all(arr != 0)) and len(np.unique(np.abs(arr))) == len(arr)
    if untied or not 2 <= len(arr) <= 13:
        return float(stats.wilcoxon(arr).pvalue)  # exact (no ties, no zeros) or, past 13 pairs, asymptotic
    # ties or zeros in 2 to 13 pairs: scipy's permutation test of the rank sum of the positive differences over
    # every sign pattern, as stats.wilcoxon runs it, but vectorised (it calls the statistic once a pattern: 0.57 s
    # for 12 pairs with a tie). The ranks (average ranks of |d|, zeros left out, as its zero_method "wilcox") do not
    # change when signs flip; a zero, flipped or not, is never positive and adds nothing
    ranks = np.zeros_like(arr)
    ranks[arr != 0] = stats.rankdata(np.abs(arr[arr != 0]))

    def r_plus(d: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.sum((np.moveaxis(d, axis, -1) > 0) * ranks, axis=-1)

    return float(stats.permutation_test((arr,), r_plus, permutation_type="samples", vectorized=True,
                                        n_resamples=np.inf, alternative="two-sided").pvalue)


def paired_difference(method: Mapping[int, float], baseline: Mapping[int, float],
                      higher_is_better: bool) -> PairedDifference:
    """``method`` minus ``baseline`` (each a seed -> value map) over the seeds both have (see
    ``PairedDifference``). The interval is mean ± t.ppf((1 + CONFIDENCE) / 2, n - 1) · s / sqrt(n), s the
    sample std (ddof=1) of the differences: what ``scipy.stats.ttest_rel(method, baseline)
    .confidence_interval()`` gives, so a verdict other than "within noise" means a two-sided paired t-test
    p-value below 1 - CONFIDENCE. ``wilcoxon`` is ``wilcoxon_p`` of the differences (None below 2 pairs, as the
    interval)."""
    from scipy import stats

    seeds = tuple(sorted(set(method) & set(baseline)))
    diffs = np.array([method[s] - baseline[s] for s in seeds], dtype=np.float64)
    n = len(diffs)
    mean = float(diffs.mean()) if n else None
    p = wilcoxon_p(diffs) if n >= 2 else None
    if n < 2:
        return PairedDifference(seeds, tuple(map(float, diffs)), mean, None, TOO_FEW, p)
    if not np.all(np.isfinite(diffs)):
        return PairedDifference(seeds, tuple(map(float, diffs)), mean, None, NOT_FINITE)
    half = float(stats.t.ppf((1 + CONFIDENCE) / 2, n - 1)) * float(diffs.std(ddof=1)) / math.sqrt(n)
    lo, hi = mean - half, mean + half  # type: ignore[operator]
    if lo > 0 or hi < 0:
        verdict = BETTER if (lo > 0) == higher_is_better else WORSE
    else:
        verdict = NOISE
    return PairedDifference(seeds, tuple(map(float, diffs)), mean, (lo, hi), verdict, p)
