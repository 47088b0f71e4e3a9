"""FedDrive's end-of-training statistic (``--avg_last_100`` in the authors' ``src/fed_setting/main.py``; thesis
Sec. 5.2.3: "the mean and standard deviation of the last mIoU scores from 20 evaluations on the test set, which
are computed every 5 rounds over the final 100 rounds").

What the code does, and what this module does: after round ``t`` (1-based) of ``R``, when ``t >= R - 100`` and
``t % 5 == 0``, the global model is evaluated on every test set; at the end, per test set and metric, the
mean and the population standard deviation (``np.std``, ddof 0) of those evaluations are logged. The
metrics are averaged, not the weights: no model is averaged over the window. The window holds both ends, so at
R = 1600 it is rounds 1500, 1505, ..., 1600: 21 evaluations, not the text's 20 (the code is the reference
here: it is what produced the tables). ``eval.last_rounds`` (100) and ``eval.last_every`` (5) set the window;
the engine evaluates in it on top of ``eval.every``, and ``summary.md`` prints the statistic of every test
metric (``window_stats``).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def in_window(r: int, total_rounds: int, last_rounds: int, every: int) -> bool:
    """Whether round ``r`` (1-based) of ``total_rounds`` is evaluated for the window: ``last_rounds > 0``,
    ``r >= total_rounds - last_rounds`` and ``r % every == 0`` (FedDrive's condition)."""
    return last_rounds > 0 and 1 <= r <= total_rounds and r >= total_rounds - last_rounds and r % every == 0


def window_rounds(total_rounds: int, last_rounds: int, every: int) -> list[int]:
    """The rounds of the window, in order."""
    return [r for r in range(1, total_rounds + 1) if in_window(r, total_rounds, last_rounds, every)]


def window_stats(series: dict[str, Any], total_rounds: int, last_rounds: int, every: int,
                 prefix: str = "test") -> dict[str, tuple[float, float, int]]:
    """``{metric: (mean, population std, evaluations)}`` over the window's rounds, for every series whose key
    starts with ``prefix`` (``test/*`` and ``test_<name>/*``); ``series``: key -> an object with ``rounds`` and
    ``values`` arrays (``runs_view._Series``). A metric with no evaluation in the window is left out."""
    want = set(window_rounds(total_rounds, last_rounds, every))
    out: dict[str, tuple[float, float, int]] = {}
    for key, s in series.items():
        if not key.startswith(prefix):
            continue
        vals = np.asarray([v for r, v in zip(np.asarray(s.rounds), np.asarray(s.values, dtype=np.float64))
                           if int(r) in want])
        if len(vals):
            out[key] = (float(np.mean(vals)), float(np.std(vals)), len(vals))
    return out


def window_section(config: dict[str, Any], series: dict[str, Any], n_rounds: int) -> list[str]:
    """``summary.md``'s lines for a run with ``eval.last_rounds`` set (none otherwise): the mean ± std of every
    test metric over the window, with how many evaluations fell in it."""
    ev = config.get("eval") if isinstance(config.get("eval"), dict) else {}
    last = int(ev.get("last_rounds") or 0)
    every = int(ev.get("last_every") or 5)
    server = config.get("server") if isinstance(config.get("server"), dict) else {}
    total = int(server.get("rounds") or n_rounds)
    if last <= 0:
        return []
    stats = window_stats(series, total, last, every)
    rounds = window_rounds(total, last, every)
    lines = [f"## Last {last} rounds (FedDrive's avg_last_100)", "",
             f"Mean ± population std over the evaluations every {every} round{'s' if every != 1 else ''} in rounds "
             f"{rounds[0] if rounds else '-'}..{total} ({len(rounds)} planned; the thesis's statistic, one run).", ""]
    if not stats:
        return lines + ["No test evaluation fell in the window (the run stopped before it).", ""]
    lines += ["| metric | mean | std | evaluations |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {stats[k][0]:.4g} | {stats[k][1]:.3g} | {stats[k][2]} |" for k in series if k in stats]
    return lines + [""]
