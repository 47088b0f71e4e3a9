"""``benchmarks/ranks_vs_threads.py``: both configurations alternate from pair to pair, and the verdict on their
ratio claims no more than its 95% interval shows. The timing itself (fresh processes under torchrun) is replaced
by fixed figures; ``fedsight bench --nproc 2`` runs the real thing in ``tests/test_distributed.py``."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from scipy import stats

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture()
def script(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import ranks_vs_threads

    yield ranks_vs_threads
    sys.modules.pop("ranks_vs_threads", None)


@pytest.mark.parametrize("ranks,verdict", [([110.0, 121.0, 115.5, 118.0], "no slower"),
                                           ([80.0, 90.0, 85.0, 88.0], "slower"),
                                           ([90.0, 120.0, 95.0, 118.0], "not told apart")])
def test_pairs_alternate_and_the_verdict_follows_the_interval(script, monkeypatch, capsys, ranks, verdict):
    threads = [100.0, 110.0, 105.0, 104.0]
    calls = []

    def time_one(raw, rounds, r, t, tmp, env=None):
        calls.append((r, t))
        i = sum(1 for c in calls if c == (r, t)) - 1
        return {"updates_per_s": (ranks if r == 2 else threads)[i]}

    monkeypatch.setattr(script, "time_one", time_one)
    monkeypatch.setattr(sys, "argv", ["ranks_vs_threads.py", "--pairs", "4", "--rounds", "2", "--clients", "4"])
    script.main()
    assert calls == [(1, 2), (2, 1), (2, 1), (1, 2), (1, 2), (2, 1), (2, 1), (1, 2)]  # AB, BA, AB, BA
    logs = [math.log(a / b) for a, b in zip(ranks, threads)]
    m, half = sum(logs) / 4, stats.t.ppf(0.975, 3) * stats.tstd(logs) / 2
    out = capsys.readouterr().out
    assert (f"{math.exp(m):.3f}x (geometric mean of 4 pairs), 95% CI {math.exp(m - half):.3f}x to "
            f"{math.exp(m + half):.3f}x: {verdict}") in out
    assert out.startswith("commit ")


def test_against_tcp_alternates_the_exchange_of_two_ranks(script, monkeypatch, capsys):
    """``--against-tcp``: both sides are 2 ranks of one thread, told apart only by FEDSIGHT_DIST_SHM."""
    calls = []
    figures = {"1": [105.0, 104.0, 106.0, 105.5], "0": [100.0, 101.0, 100.5, 99.5]}

    def time_one(raw, rounds, r, t, tmp, env=None):
        assert (r, t) == (2, 1)
        calls.append(env["FEDSIGHT_DIST_SHM"])
        return {"updates_per_s": figures[calls[-1]][calls.count(calls[-1]) - 1]}

    monkeypatch.setattr(script, "time_one", time_one)
    monkeypatch.setattr(sys, "argv", ["ranks_vs_threads.py", "--pairs", "4", "--rounds", "2", "--against-tcp"])
    script.main()
    assert calls == ["0", "1", "1", "0", "0", "1", "1", "0"]
    logs = [math.log(a / b) for a, b in zip(figures["1"], figures["0"])]
    m = sum(logs) / 4
    out = capsys.readouterr().out
    assert f"shared memory / TCP (2 ranks x 1 thread): {math.exp(m):.3f}x (geometric mean of 4 pairs)" in out
    assert out.rstrip().splitlines()[-2].endswith(": faster")


def test_too_few_pairs_are_refused(script, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["ranks_vs_threads.py", "--pairs", "1"])
    with pytest.raises(SystemExit):
        script.main()
