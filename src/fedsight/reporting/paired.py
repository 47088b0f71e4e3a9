"""Paired comparison of two groups of runs: per-seed differences, their mean, a Student-t confidence interval and
a plain verdict. The one place these statistics are computed; ``compare`` tabulates them and ``report`` writes
them to ``report.md``."""

from __future__ import annotations

import math
from collections.abc import Mapping
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

    @property
    def n(self) -> int:
        return len(self.differences)


def paired_difference(method: Mapping[int, float], baseline: Mapping[int, float],
                      higher_is_better: bool) -> PairedDifference:
    """``method`` minus ``baseline`` (each a seed -> value map) over the seeds both have (see
    ``PairedDifference``). The interval is mean ± t.ppf((1 + CONFIDENCE) / 2, n - 1) · s / sqrt(n), s the
    sample std (ddof=1) of the differences: what ``scipy.stats.ttest_rel(method, baseline)
    .confidence_interval()`` gives, so a verdict other than "within noise" means a two-sided paired t-test
    p-value below 1 - CONFIDENCE."""
    from scipy import stats

    seeds = tuple(sorted(set(method) & set(baseline)))
    diffs = np.array([method[s] - baseline[s] for s in seeds], dtype=np.float64)
    n = len(diffs)
    mean = float(diffs.mean()) if n else None
    if n < 2:
        return PairedDifference(seeds, tuple(map(float, diffs)), mean, None, TOO_FEW)
    if not np.all(np.isfinite(diffs)):
        return PairedDifference(seeds, tuple(map(float, diffs)), mean, None, NOT_FINITE)
    half = float(stats.t.ppf((1 + CONFIDENCE) / 2, n - 1)) * float(diffs.std(ddof=1)) / math.sqrt(n)
    lo, hi = mean - half, mean + half  # type: ignore[operator]
    if lo > 0 or hi < 0:
        verdict = BETTER if (lo > 0) == higher_is_better else WORSE
    else:
        verdict = NOISE
    return PairedDifference(seeds, tuple(map(float, diffs)), mean, (lo, hi), verdict)
