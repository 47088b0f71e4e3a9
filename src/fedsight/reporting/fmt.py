"""Number, duration and markdown formatting shared by summaries, tables and plots."""

from __future__ import annotations

import math
from collections.abc import Iterable


def _fmt(v: float | None, digits: int = 4) -> str:
    if v is None:
        return "—"
    if math.isnan(v):
        return "nan"
    return f"{v:.{digits}g}"


def _decimals(values: Iterable[float | None]) -> int:
    """Decimals that give about 4 significant digits to the largest of ``values``."""
    finite = [abs(v) for v in values if v is not None and math.isfinite(v)]
    top = max(finite, default=0.0)
    return 4 if top == 0 else max(0, 3 - math.floor(math.log10(top)))


def _fmt_mean_std(mean: float | None, std: float | None, decimals: int) -> str:
    """``mean ± std`` with the same number of decimals; just the mean when std is None."""
    if mean is None:
        return "—"
    if math.isnan(mean):
        return "nan"
    return f"{mean:.{decimals}f}" if std is None else f"{mean:.{decimals}f} ± {std:.{decimals}f}"


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "n/a"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h {m:02d}m {s:02d}s"
    if m:
        return f"{m}m {s:02d}s"
    return f"{seconds:.3g} s"


def _direction_text(higher_is_better: bool | None) -> str:
    """"higher is better", "lower is better", or "" for a metric with no direction."""
    return {True: "higher is better", False: "lower is better"}.get(higher_is_better, "")  # type: ignore[arg-type]


def _metric_label(key: str, higher_is_better: bool | None) -> str:
    """``key ↑`` (higher is better), ``key ↓`` (lower is better) or just ``key`` (no direction)."""
    arrow = {True: " ↑", False: " ↓"}.get(higher_is_better, "")  # type: ignore[arg-type]
    return key + arrow


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")
