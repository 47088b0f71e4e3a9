"""Which panels one run's ``curves.png`` has (``plot_run``), so that a run of any task reads in a few panels.

Choices, in order (each says itself in the figure's note line or its legends):

* **The same series twice is drawn once.** ``psnr`` and ``ssim`` are the task's reported channel (``metric = "y"``
  or ``"rgb"``) and repeat ``psnr_y`` or ``psnr_rgb``; when the values are equal only the channel-named key is
  drawn and its legend says which channel (``psnr_y (Y)``, ``psnr_rgb (RGB)``). Likewise ``cost/*_fp32`` (every
  number at 4 bytes, ``fedsight.cost``) where it equals the bytes as sent (an FP32 model's update).
* **Constant bookkeeping is said, not drawn.** A series outside evaluation and training (``clients/*``,
  ``cost/*``, ...) that has the same value at every one of two or more rounds is left out of the panels and
  named in the note line with its value in human units (``clients/sampled = 3``, ``cost/up_bytes = 1.45 MB
  every round``). Evaluation and training series are drawn even when flat: that they do not move is a result.
* **Upload and download get one panel per kind of count, told apart** (per round, cumulative), with up and
  down in different line styles and markers; when up and down are equal at every round the legend says so.
* **Metrics at several input resolutions** (the keypoint task's ``test_<H>x<W>/*`` beside ``test/*``, whose size
  ``partition.json`` records) are one panel per metric with one line per input size, not one panel per size; and
  a panel of the primary metric against the input size at the last evaluated round (first evaluated round dashed,
  the training ladder's rungs marked with the clients that train there).
* Units go on the axes: bytes and FLOPs in SI prefixes (``MB``, ``GFLOP``), PSNR in dB, PCKh/PCK/AP in %
  (``fedsight.reporting.units``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .fmt import _direction_text
from .runs_view import _Series
from .units import human, metric_unit

#: ``test_96x72`` or ``test_coco_96x72``: a test set (``test`` / ``test_coco``) at another input size
_SIZED = re.compile(r"^(test(?:_.+?)?)_(\d+)x(\d+)$")
#: channel suffix -> how a legend names it
_CHANNELS = {"y": "Y", "rgb": "RGB"}
_EVAL_OR_TRAIN = ("test", "val", "local", "train")


@dataclass
class Line:
    label: str
    x: np.ndarray
    y: np.ndarray
    style: dict[str, Any] = field(default_factory=dict)


@dataclass
class Panel:
    """One axes: its title, y label, lines; ``x`` is ``"round"`` (integer ticks) or ``"size"`` (input sizes,
    ``xticks`` their labels); ``spans``: shaded x ranges with a label (training rungs)."""

    title: str
    ylabel: str
    lines: list[Line]
    x: str = "round"
    xticks: list[str] = field(default_factory=list)
    spans: list[tuple[float, float, str]] = field(default_factory=list)
    #: the metric keys drawn (round panels)
    keys: list[str] = field(default_factory=list)


def _prefix(key: str) -> str:
    return key.split("/", 1)[0] if "/" in key else ""


def _same(a: _Series, b: _Series) -> bool:
    return (a.rounds.shape == b.rounds.shape and bool(np.array_equal(a.rounds, b.rounds))
            and bool(np.allclose(a.values, b.values, rtol=0, atol=0, equal_nan=True)))


def duplicate_channels(keys: Sequence[str], series: dict[str, _Series]) -> dict[str, str]:
    """``{"test/psnr": "test/psnr_y", ...}``: every ``P/psnr`` or ``P/ssim`` whose series equals ``P/psnr_y`` or
    ``P/psnr_rgb`` (the task's reported channel), mapped to the channel-named key it repeats; and every
    ``cost/X_fp32`` equal to ``cost/X``, mapped to it."""
    present = set(keys)
    out: dict[str, str] = {}
    for k in keys:
        if k.startswith("cost/") and k.endswith("_fp32") and k[:-5] in present and _same(series[k], series[k[:-5]]):
            out[k] = k[:-5]
            continue
        head, _, leaf = k.rpartition("/")
        if leaf not in ("psnr", "ssim"):
            continue
        for ch in _CHANNELS:
            twin = f"{head}/{leaf}_{ch}" if head else f"{leaf}_{ch}"
            if twin in present and _same(series[k], series[twin]):
                out[k] = twin
                break
    return out


def channel_label(key: str, unit: str = "") -> str:
    """``test/psnr_y (Y)``, ``test/ssim_rgb (RGB)``; with ``unit`` (``%`` or ``dB``, shown in a label) first:
    ``test/psnr_y (dB, Y)``, ``test/pckh (%)``; other keys as they are."""
    leaf = key.rsplit("/", 1)[-1]
    parts = [unit] if unit in ("%", "dB") else []
    for ch, name in _CHANNELS.items():
        if leaf.endswith(f"_{ch}") and leaf[: -len(ch) - 1] in ("psnr", "ssim"):
            parts.append(name)
    return f"{key} ({', '.join(parts)})" if parts else key


def constant_series(keys: Sequence[str], series: dict[str, _Series]) -> list[str]:
    """Keys outside evaluation and training whose series has two or more rounds, all with one finite value."""
    out = []
    for k in keys:
        if _prefix(k).split("_", 1)[0] in _EVAL_OR_TRAIN:
            continue
        v = series[k].values
        if len(v) >= 2 and bool(np.all(np.isfinite(v))) and bool(np.all(v == v[0])):
            out.append(k)
    return out


def sized_keys(keys: Sequence[str], test_sizes: dict[str, tuple[int, int]]) -> dict[tuple[str, str], dict[tuple[int, int], str]]:
    """``{(test set prefix, leaf): {(H, W): key}}`` for metrics logged at several input sizes: ``test_96x72/pckh``
    is ``test`` at 96x72, and ``test/pckh`` joins it at the size ``partition.json`` gives ``test`` (only when
    some sized key exists: a run at one size has no family)."""
    fams: dict[tuple[str, str], dict[tuple[int, int], str]] = {}
    for k in keys:
        if k.count("/") != 1:
            continue
        prefix, leaf = k.split("/")
        m = _SIZED.match(prefix)
        if m and prefix in test_sizes:
            fams.setdefault((m.group(1), leaf), {})[test_sizes[prefix]] = k
    for (base, leaf), members in fams.items():
        key = f"{base}/{leaf}"
        if base in test_sizes and key in keys:
            members.setdefault(test_sizes[base], key)
    return {f: dict(sorted(m.items(), key=lambda kv: -kv[0][0] * kv[0][1])) for f, m in fams.items() if len(m) >= 2}


def _size_text(size: tuple[int, int]) -> str:
    return f"{size[0]}x{size[1]}"


def _rung_of(size: tuple[int, int], ladder: Sequence[tuple[int, int]]) -> str:
    return f" (rung {ladder.index(size)})" if size in ladder else " (unseen)"


def plan_panels(keys: Sequence[str], series: dict[str, _Series], direction: Callable[[str], bool | None],
                groups: Callable[[Sequence[str]], list[tuple[str, list[str]]]], *, task: str | None = None,
                primary: str | None = None, partition: dict[str, Any] | None = None,
                style: Callable[[int], dict[str, Any]]) -> tuple[list[Panel], list[str]]:
    """The panels of one run's curves and the note line's parts (see the module docstring). ``groups``: the
    generic grouping of the keys left over (``plots._panel_groups``); ``style(i)``: the i-th line's style."""
    keys = list(keys)
    notes: list[str] = []
    dup = duplicate_channels(keys, series)
    if dup:
        notes.append("; ".join(f"{k} = {t}" for k, t in dup.items()) + " (drawn once)")
    keys = [k for k in keys if k not in dup]
    const = constant_series(keys, series)
    if len(const) == len(keys):  # nothing else to draw: draw them
        const = []
    if const:
        parts = []
        for k in const:
            u = metric_unit(k, task, primary)
            parts.append(f"{k} = {human(float(series[k].values[0]), u)}")
        notes.append("constant every round: " + ", ".join(parts))
    keys = [k for k in keys if k not in const]

    part = partition or {}
    test_sizes = {}
    sets = part.get("test_sets")
    for split, info in (sets if isinstance(sets, dict) else {}).items():
        size = info.get("size") if isinstance(info, dict) else None
        if isinstance(size, list) and len(size) == 2 and all(isinstance(v, int) for v in size):
            test_sizes[str(split)] = (size[0], size[1])
    rungs = part.get("ladder")
    ladder = [tuple(s) for s in (rungs if isinstance(rungs, list) else []) if isinstance(s, list) and len(s) == 2]
    fams = sized_keys(keys, test_sizes)
    panels: list[Panel] = []
    if fams:
        panels += _resolution_panels(fams, series, direction, task, primary, ladder, part, style)
        taken = {k for members in fams.values() for k in members.values()}
        keys = [k for k in keys if k not in taken]

    bytes_keys = [k for k in keys if _prefix(k) == "cost" and "bytes" in k]
    keys = [k for k in keys if k not in bytes_keys]
    rest: list[Panel] = []
    for title, ks in groups(keys):
        unit = {metric_unit(k, task, primary) for k in ks}
        u = unit.pop() if len(unit) == 1 else ""
        lines = [Line(channel_label(k), series[k].rounds, series[k].values, style(i)) for i, k in enumerate(ks)]
        stems = {k.rsplit("/", 1)[-1].split("_")[0] for k in ks}
        ylabel = "seconds" if u == "s" else (ks[0] if len(ks) == 1 else stems.pop() if len(stems) == 1 else "value")
        if u in ("%", "dB"):
            ylabel = f"{ylabel} ({u})"
        rest.append(_scaled(Panel(title, ylabel, lines, keys=list(ks)), u))
    if bytes_keys:  # where the cost panels are, else before training and time, else last
        at = next((i for i, p in enumerate(rest) if p.keys and _prefix(p.keys[0]) in ("cost", "train", "time")),
                  len(rest))
        rest[at:at] = _bytes_panels(bytes_keys, series, style)
    return panels + rest, notes


def _scaled(panel: Panel, unit: str) -> Panel:
    """Bytes and FLOPs drawn in a prefixed unit (MB, GFLOP) named in the y label."""
    from .units import scale_for

    if unit not in ("B", "FLOP"):
        return panel
    factor, label = scale_for([float(np.nanmax(np.abs(ln.y))) for ln in panel.lines if len(ln.y)], unit)
    for ln in panel.lines:
        ln.y = ln.y / factor
    panel.ylabel = f"{panel.lines[0].label} ({label})" if len(panel.lines) == 1 else label
    return panel


def _bytes_panels(keys: Sequence[str], series: dict[str, _Series], style: Callable[[int], dict[str, Any]]) -> list[Panel]:
    """Per-round and cumulative communication, one panel each; down dashed with square markers, up solid with
    circles, and "(up = down)" in the title when they are the same at every round."""
    out = []
    for total, title in ((False, "Communication per round (lower is better)"),
                         (True, "Cumulative communication (lower is better)")):
        ks = [k for k in keys if ("total" in k) == total]
        if not ks:
            continue
        lines = []
        for i, k in enumerate(ks):
            st = dict(style(i))
            if "down" in k:
                st.update(linestyle="--", marker="s")
            elif "up" in k:
                st.update(linestyle="-", marker="o")
            lines.append(Line(k, series[k].rounds, series[k].values, st))
        ups = [k for k in ks if "up" in k.rsplit("/", 1)[-1]]
        downs = [k for k in ks if "down" in k.rsplit("/", 1)[-1]]
        if len(ups) == 1 and len(downs) == 1 and _same(series[ups[0]], series[downs[0]]):
            title = title.replace(" (", " (up = down, ")
        out.append(_scaled(Panel(title, "value", lines, keys=list(ks)), "B"))
    return out


def _resolution_panels(fams: dict[tuple[str, str], dict[tuple[int, int], str]], series: dict[str, _Series],
                       direction: Callable[[str], bool | None], task: str | None, primary: str | None,
                       ladder: Sequence[tuple[int, int]], part: dict[str, Any],
                       style: Callable[[int], dict[str, Any]]) -> list[Panel]:
    panels = []
    prim_leaf = primary.rsplit("/", 1)[-1] if primary else None
    order = sorted(fams, key=lambda f: (f[0] != "test", f[1] != prim_leaf, f[1] == "loss"))
    for base, leaf in order:
        members = fams[(base, leaf)]
        first = next(iter(members.values()))
        unit = metric_unit(first, task, primary)
        better = _direction_text(direction(first))
        name = f"{base}/{leaf}" + (f" ({unit})" if unit in ("%", "dB") else "")
        title = f"{name} by input size" + (f" ({better})" if better else "")
        lines = [Line(_size_text(size) + _rung_of(size, ladder), series[k].rounds, series[k].values, style(i))
                 for i, (size, k) in enumerate(members.items())]
        panels.append(Panel(title, name, lines))
    if prim_leaf and ("test", prim_leaf) in fams:
        members = fams[("test", prim_leaf)]
        better = _direction_text(direction(next(iter(members.values()))))
        panels.insert(0, _against_size(members, series, task, primary, ladder, part, better))
    return panels


def _against_size(members: dict[tuple[int, int], str], series: dict[str, _Series], task: str | None,
                  primary: str | None, ladder: Sequence[tuple[int, int]], part: dict[str, Any], better: str) -> Panel:
    """The primary metric against the input size (smallest left), at the last evaluated round (solid) and the first
    (dashed, when it differs); the ladder's rungs shaded and labelled with their clients."""
    sizes = sorted(members, key=lambda s: s[0] * s[1])
    x = np.arange(len(sizes), dtype=np.float64)
    leaf = (primary or "").rsplit("/", 1)[-1]
    unit = metric_unit(members[sizes[0]], task, primary)
    ends: dict[str, list[float]] = {"last": [], "first": []}
    rounds: dict[str, set[int]] = {"last": set(), "first": set()}
    for s in sizes:
        ser = series[members[s]]
        ends["last"].append(float(ser.values[-1]))
        ends["first"].append(float(ser.values[0]))
        rounds["last"].add(int(ser.rounds[-1]))
        rounds["first"].add(int(ser.rounds[0]))
    lines = [Line(f"round {'/'.join(map(str, sorted(rounds['last'])))} (last evaluated)", x, np.array(ends["last"]),
                  {"color": "C0", "linestyle": "-", "marker": "o"})]
    if rounds["first"] != rounds["last"]:
        lines.append(Line(f"round {'/'.join(map(str, sorted(rounds['first'])))} (first evaluated)", x,
                          np.array(ends["first"]), {"color": "0.55", "linestyle": "--", "marker": "s"}))
    spans = []
    client_rungs = part.get("client_rungs") if isinstance(part.get("client_rungs"), list) else []
    for r, size in enumerate(ladder):
        if size in sizes:
            who = [str(k) for k, cr in enumerate(client_rungs) if cr == r]
            text = f"rung {r}" + (f": client{'s' if len(who) > 1 else ''} {', '.join(who)}" if who else ": no client")
            i = sizes.index(size)
            spans.append((i - 0.4, i + 0.4, text))
    ylabel = f"{leaf} ({unit})" if unit in ("%", "dB") else leaf
    title = f"test/{leaf} against input size" + (f" ({better})" if better else "")
    return Panel(title, ylabel,
                 lines, x="size", xticks=[_size_text(s) for s in sizes], spans=spans)
