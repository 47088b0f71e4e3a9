"""Wilcoxon signed-rank p-values beside the paired-difference interval (issue 47; FedVG's tables): the p of a
hand-computed case, agreement with scipy on the seeds both groups have, the smallest p n pairs can give, and
the column in report.md."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from fedsight.reporting import compare, report
from fedsight.reporting.paired import paired_difference, smallest_p, wilcoxon_p
from test_report_compare import comparison, method


def exact_two_sided(diffs: list[float]) -> float:
    """The exact two-sided p by enumerating every sign pattern of the ranks (no ties, no zeros)."""
    ranks = stats.rankdata(np.abs(diffs))
    w_minus = sum(r for r, d in zip(ranks, diffs) if d < 0)
    w = min(w_minus, sum(ranks) - w_minus)
    n = len(diffs)
    tail = sum(sum(c) <= w for k in range(n + 1) for c in itertools.combinations(ranks, k)) / 2 ** n
    return min(1.0, 2 * tail)


def test_hand_computed_case() -> None:
    # |d| ranks: 0.05 -> 1 (the only negative), 0.1 -> 2, 0.2 -> 3, 0.3 -> 4; W- = 1. Of the 16 sign patterns,
    # 2 have a negative rank sum <= 1 ({} and {1}): one tail 2/16, two-sided 0.25
    diffs = [0.1, 0.2, -0.05, 0.3]
    assert wilcoxon_p(diffs) == pytest.approx(0.25)
    assert exact_two_sided(diffs) == pytest.approx(0.25)
    assert wilcoxon_p([0.1, 0.2, 0.3, 0.4, 0.5]) == pytest.approx(0.0625)  # all one sign: the floor, 2/2^5


@pytest.mark.parametrize("seed", range(6))
def test_matches_scipy_and_the_enumeration(seed: int) -> None:
    rng = np.random.default_rng(seed)
    diffs = list(rng.normal(0.3, 1.0, size=3 + seed))
    assert wilcoxon_p(diffs) == pytest.approx(float(stats.wilcoxon(diffs, method="exact").pvalue))
    assert wilcoxon_p(diffs) == pytest.approx(exact_two_sided(diffs))


@given(st.lists(st.sampled_from([-3.0, -2.0, -1.5, -1.0, 0.0, 0.5, 1.0, 2.0, 3.0]), min_size=2, max_size=9))
def test_ties_and_zeros_give_scipys_p(diffs: list[float]) -> None:
    """With tied |d| or zero differences, the vectorised permutation test equals ``scipy.stats.wilcoxon``'s (its
    statistic called once a sign pattern; ``max_size`` keeps that reference fast: 2^9 patterns)."""
    want = float(stats.wilcoxon(diffs).pvalue) if any(diffs) else None
    assert wilcoxon_p(diffs) == (pytest.approx(want, rel=1e-12) if want is not None else None)


@pytest.mark.parametrize("diffs", [[0.0, 1.0, 1.0, -2.0, 3.0, 4.0, 5.0, -6.0, 7.0, 8.0, 9.0, 10.0, 11.0],
                                   [0.5] * 6 + [-0.5] * 2, [2.0, -2.0]])
def test_thirteen_pairs_with_ties_give_scipys_p(diffs: list[float]) -> None:
    assert wilcoxon_p(diffs) == pytest.approx(float(stats.wilcoxon(diffs).pvalue), rel=1e-12)


def test_smallest_p_is_all_differences_of_one_sign() -> None:
    for n in range(1, 9):
        assert smallest_p(n) == pytest.approx(exact_two_sided([float(i) for i in range(1, n + 1)]))
    assert [smallest_p(n) for n in (3, 4, 5, 6)] == [0.25, 0.125, 0.0625, 0.03125]
    assert wilcoxon_p([0.0, 0.0]) is None and wilcoxon_p([1.0, math.nan]) is None


def test_paired_difference_carries_the_p_of_its_pairs() -> None:
    method_ = {0: 0.80, 1: 0.90, 2: 0.70, 3: 0.95, 9: 0.1}
    base = {0: 0.70, 1: 0.70, 2: 0.75, 3: 0.65, 8: 0.9}
    st = paired_difference(method_, base, True)
    assert st.seeds == (0, 1, 2, 3)
    assert st.wilcoxon == pytest.approx(float(stats.wilcoxon([0.1, 0.2, -0.05, 0.3]).pvalue))
    assert st.min_wilcoxon_p == 0.125
    # a zero difference is dropped: 3 non-zero pairs, floor 0.25
    assert paired_difference({0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}, True).min_wilcoxon_p \
        == 0.25


def test_report_md_has_the_column_and_marks_the_floor(tmp_path: Path) -> None:
    base = method(tmp_path, "base", {0: 0.70, 1: 0.71, 2: 0.72}, lr=0.1)
    other = method(tmp_path, "other", {0: 0.80, 1: 0.82, 2: 0.84}, lr=0.2)
    c = comparison(compare(base + other), "other")
    assert c.stats.wilcoxon == pytest.approx(0.25)  # 3 pairs all better: the smallest p 3 seeds can give
    report(base + other, tmp_path / "rep")
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| verdict | Wilcoxon p |" in md and "| better | 0.25 (min) |" in md
    assert "fewer than 6 never reach 0.05" in md
