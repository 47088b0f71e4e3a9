"""Units of metric keys and numbers in human units: ``2.50 GB``, ``18.9 GFLOP``, ``10.6 s``, ``28.12 dB``.

A run's metrics are logged as plain floats (``cost/total_up_bytes = 2497000000.0``); readers should not have to
count digits. Units come from the key (choices made here, not from a table each task keeps):

* ``*bytes*`` -> bytes, ``*flops*`` -> FLOP: decimal (SI) prefixes, 3 significant digits (``2.50 GB``, as
  network and compute budgets are quoted; not GiB);
* ``time/*`` and ``*_s`` -> seconds (durations from a minute up as ``1m 05s``);
* ``psnr*`` -> dB;
* the keypoint task's PCKh, PCK and COCO AP/AR (and ``local/wma``, ``local/worst10`` of a primary metric that is
  one of them) -> percent: the task logs them in percent (``fedsight.tasks.keypoints``).

Everything else has no unit (accuracy and mIoU are fractions in [0, 1], losses have none).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .fmt import _fmt, _fmt_duration

#: keypoint metrics logged in percent (``fedsight.tasks.keypoints.keypoint_metrics``, ``metrics.keypoints``)
PERCENT_KEYPOINT = frozenset({"pckh", "pck", "ap", "ap50", "ap75", "ar"})
#: the local-evaluation summaries, in the unit of the primary metric they summarise
_SUMMARIES = frozenset({"wma", "worst10"})
_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""))


def metric_unit(key: str, task: str | None = None, primary: str | None = None) -> str:
    """``"B"``, ``"FLOP"``, ``"s"``, ``"dB"``, ``"%"`` or ``""`` (no unit) for metric ``key`` of a run of task
    ``task`` (config ``task.name``) whose primary metric is ``primary`` (``test/pckh``)."""
    leaf = key.rsplit("/", 1)[-1].lower()
    prefix = key.split("/", 1)[0] if "/" in key else ""
    if "bytes" in leaf:
        return "B"
    if "flops" in leaf:
        return "FLOP"
    if prefix == "time" or leaf.endswith("_s"):
        return "s"
    if leaf.startswith("psnr"):
        return "dB"
    if leaf in _SUMMARIES and primary and primary.rsplit("/", 1)[-1] not in _SUMMARIES:
        return metric_unit(primary, task)
    if task == "keypoints" and leaf in PERCENT_KEYPOINT:
        return "%"
    return ""


def scale_for(values: Sequence[float], unit: str) -> tuple[float, str]:
    """``(factor, label)`` to draw ``values`` of ``unit`` with: divide by ``factor`` and name the axis ``label``
    (``(1e6, "MB")`` for byte counts up to 999 MB); units without prefixes give ``(1.0, unit)``."""
    if unit not in ("B", "FLOP"):
        return 1.0, unit
    finite = [abs(v) for v in values if v is not None and math.isfinite(v)]
    top = max(finite, default=0.0)
    for factor, p in _PREFIXES:
        if top >= factor:
            return factor, f"{p}{unit}"
    return 1.0, unit


def human(value: float | None, unit: str) -> str:
    """``value`` with its unit: ``2.50 GB``, ``18.9 GFLOP``, ``0.679 s``, ``1m 05s``; a unit shown in a label
    instead (``%``, ``dB``) and no unit give the plain 4-significant-digit number."""
    if value is None or not math.isfinite(value):
        return _fmt(value)
    if unit in ("B", "FLOP"):
        factor, label = scale_for([value], unit)
        return f"{_sig3(value / factor)} {label}" if factor > 1 else f"{value:.4g} {label}"
    if unit == "s":
        return _fmt_duration(value) if value >= 60 else f"{value:.3g} s"
    return _fmt(value)


def _sig3(x: float) -> str:
    """3 significant digits, trailing zeros kept (``2.50``, ``18.9``, ``189``)."""
    if x == 0:
        return "0"
    decimals = max(0, 2 - math.floor(math.log10(abs(x))))
    text = f"{x:.{decimals}f}"
    return text if float(text) < 1000 or decimals else f"{x:.0f}"
