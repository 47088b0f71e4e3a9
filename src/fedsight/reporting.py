"""Plots, summaries and cross-run comparison tables for FedSight run directories.

A run directory is written by an engine and read here::

    RUN_DIR/config.json     resolved config; top-level "seed" and "run" ({"name": ..., ...}) plus the
                            experiment (task, data, partition, model, train, server, recipe, eval, ...)
    RUN_DIR/metrics.jsonl   one JSON object per line with "round" (1-based) and "stage", plus float
                            metrics such as "train/loss", "test/acc", "local/worst10", "time/round_s";
                            evaluation keys appear only on rounds where evaluation ran; lines with an
                            "event" key are log events, not metrics
    RUN_DIR/plots/          written here (``plot_run``)
    RUN_DIR/summary.md      written here (``write_summary``)

Conventions used throughout:

- ``round`` counts globally across stages. If a round appears more than once for a metric (a resumed
  run that re-logged rounds after its last checkpoint), the last line wins.
- A metric is lower-is-better when the last part of its key contains "loss" or its key starts with
  "time" or "cost" (``higher_is_better``).
- "final" is the value at the last round where the metric was logged in that run; "best" is the max
  (or min, for lower-is-better metrics) over all logged rounds.
- Runs whose configs are equal apart from top-level "seed" and "run" form one group (usually several
  seeds of one experiment); tables show mean ± sample std (ddof=1) over the runs of a group.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "ComparisonRow",
    "ComparisonTable",
    "RunGroup",
    "compare",
    "group_runs",
    "higher_is_better",
    "mean_curve",
    "plot_client_weights",
    "plot_comparison",
    "plot_run",
    "read_config",
    "read_metrics",
    "report",
    "write_summary",
]

StrPath = str | os.PathLike[str]

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
SUMMARY_FILE = "summary.md"
_DPI = 120
_RESERVED = ("round", "stage", "event")


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


def higher_is_better(key: str) -> bool:
    """Whether larger values of metric ``key`` are better.

    Lower is better when the last ``/``-part contains "loss" (``test/loss``, ``train/kd_loss``) or the
    key starts with "time" or "cost" (``time/round_s``, ``cost/total_flops``); everything else (accuracy,
    mIoU, PSNR, ...) is higher.
    """
    return not ("loss" in key.rsplit("/", 1)[-1] or key.startswith(("time", "cost")))


def _run_file(run_dir: StrPath, name: str) -> tuple[Path, str]:
    """(path, text) of a run directory's file; a missing one says the folder may not be a run."""
    path = Path(run_dir) / name
    try:
        return path, path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file (is {Path(run_dir)} a FedSight run directory?)") from None


def read_config(run_dir: StrPath) -> dict[str, Any]:
    """The resolved config of a run: the parsed ``RUN_DIR/config.json``.

    Raises ``FileNotFoundError`` or ``ValueError`` naming the file when it is missing, is not valid
    JSON, or is not a JSON object.
    """
    path, text = _run_file(run_dir, CONFIG_FILE)
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def read_metrics(run_dir: StrPath) -> list[dict[str, Any]]:
    """All records of ``RUN_DIR/metrics.jsonl``, in file order, event lines included.

    Blank lines are skipped. A line that is not a JSON object, or a metrics line (one without
    ``"event"``) whose ``"round"`` is not an integer, raises ``ValueError`` naming ``file:line``.
    """
    path, text = _run_file(run_dir, METRICS_FILE)
    lines = text.splitlines()
    records: list[dict[str, Any]] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
        if "event" not in rec:
            rnd = rec.get("round")
            if not isinstance(rnd, int) or isinstance(rnd, bool):
                raise ValueError(f"{path}:{lineno}: metrics line needs an integer 'round', got {rnd!r}")
        records.append(rec)
    return records


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class _Series:
    rounds: np.ndarray  # int, strictly increasing
    values: np.ndarray  # float

    def final(self) -> tuple[float, int]:
        return float(self.values[-1]), int(self.rounds[-1])

    def best(self, key: str) -> tuple[float, int]:
        """Best value and the first round it was reached (NaNs ignored)."""
        vals = self.values
        if np.all(np.isnan(vals)):
            return math.nan, int(self.rounds[-1])
        i = int(np.nanargmax(vals) if higher_is_better(key) else np.nanargmin(vals))
        return float(vals[i]), int(self.rounds[i])


@dataclass
class _Run:
    """One run directory, read once."""

    path: Path
    config: dict[str, Any]
    records: list[dict[str, Any]]

    @classmethod
    def load(cls, run_dir: StrPath) -> _Run:
        return cls(Path(run_dir), read_config(run_dir), read_metrics(run_dir))

    @property
    def name(self) -> str:
        run = self.config.get("run")
        name = run.get("name") if isinstance(run, dict) else None
        return str(name) if name else self.path.name

    @property
    def seed(self) -> int | None:
        seed = self.config.get("seed")
        return seed if isinstance(seed, int) else None

    @cached_property
    def metric_records(self) -> list[dict[str, Any]]:
        return [r for r in self.records if "event" not in r]

    @cached_property
    def series(self) -> dict[str, _Series]:
        """Numeric key -> series over rounds, keys in order of first appearance; last line wins."""
        by_key: dict[str, dict[int, float]] = {}
        for rec in self.metric_records:
            rnd = rec["round"]
            for k, v in rec.items():
                if k in _RESERVED or not _is_number(v):
                    continue
                by_key.setdefault(k, {})[rnd] = float(v)
        out = {}
        for k, d in by_key.items():
            rounds = np.array(sorted(d), dtype=np.int64)
            out[k] = _Series(rounds, np.array([d[r] for r in rounds], dtype=np.float64))
        return out

    @property
    def n_rounds(self) -> int:
        return max((r["round"] for r in self.metric_records), default=0)

    @property
    def stages(self) -> list[tuple[str, int]]:
        """(stage, first round) for each change of stage, in round order."""
        first: dict[int, str] = {}
        for rec in self.metric_records:
            first.setdefault(rec["round"], str(rec.get("stage", "")))
        out: list[tuple[str, int]] = []
        for rnd in sorted(first):
            if not out or out[-1][0] != first[rnd]:
                out.append((first[rnd], rnd))
        return out


_PREFIX_RANK = {"test": 0, "val": 1, "local": 2, "train": 4, "time": 5}


def _display_order(keys: Iterable[str]) -> list[str]:
    """Evaluation metrics first (test, val, local, others), then train, then time; stable otherwise."""
    keys = list(keys)
    return sorted(keys, key=lambda k: (_PREFIX_RANK.get(k.split("/", 1)[0] if "/" in k else "", 3), keys.index(k)))


def _load_all(run_dirs: Iterable[StrPath]) -> list[_Run]:
    runs = [_Run.load(d) for d in run_dirs]
    if not runs:
        raise ValueError("no run directories given")
    return runs


# --------------------------------------------------------------------------------------------------
# Formatting helpers
# --------------------------------------------------------------------------------------------------


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


def _metric_label(key: str) -> str:
    return f"{key} {'↑' if higher_is_better(key) else '↓'}"


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


# --------------------------------------------------------------------------------------------------
# Single run: curves and summary
# --------------------------------------------------------------------------------------------------

_EVAL_PREFIXES = ("test", "val", "local")
_PREFIX_TITLES = {
    "test": "Test",
    "val": "Validation",
    "local": "Per-client (local) evaluation",
    "train": "Training",
    "time": "Time per round",
}


def _panel_groups(keys: Sequence[str], series: dict[str, _Series]) -> list[tuple[str, list[str]]]:
    """Split metric keys into subplots: by prefix, losses apart from the rest, and (except for time)
    values more than 10x apart in magnitude on separate axes (accuracy vs PSNR)."""
    buckets: dict[tuple[str, bool], list[str]] = {}
    for k in keys:
        prefix = k.split("/", 1)[0] if "/" in k else ""
        is_loss = "loss" in k.rsplit("/", 1)[-1]
        buckets.setdefault((prefix, is_loss), []).append(k)
    panels: list[tuple[str, list[str]]] = []
    for (prefix, is_loss), ks in buckets.items():
        base = _PREFIX_TITLES.get(prefix, prefix.capitalize() if prefix else "Other")
        if prefix == "time":
            panels.append((f"{base} (s, lower is better)", ks))
            continue
        title = f"{base} loss" if is_loss else (base if prefix in ("local", "") else f"{base} metrics")
        if is_loss:
            title += " (lower is better)"
        elif prefix in _EVAL_PREFIXES:
            title += " (higher is better)"
        # cluster by magnitude so small-range metrics are not flattened by large-range ones; magnitudes
        # below 0.1 count as 0.1 so an all-zero or tiny series joins its neighbours
        mags = {k: max(float(np.nanmax(np.abs(v))) if np.any(np.isfinite(v := series[k].values)) else 0.0, 0.1)
                for k in ks}
        clusters: list[list[str]] = []
        for k in sorted(ks, key=lambda k: mags[k]):
            if clusters and mags[k] <= 10 * mags[clusters[-1][0]]:
                clusters[-1].append(k)
            else:
                clusters.append([k])
        order = {k: i for i, k in enumerate(ks)}
        for c in sorted(clusters, key=lambda c: min(order[k] for k in c)):
            c.sort(key=order.__getitem__)
            panels.append((title, c))
    return panels


def _new_figure(n_panels: int, title: str) -> tuple[Any, list[Any]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(3, n_panels)
    nrows = math.ceil(n_panels / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(max(5.0 * ncols, 6.5), 3.6 * nrows + 0.5), squeeze=False,
                             layout="constrained")
    flat = list(axes.ravel())
    for ax in flat[n_panels:]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=13)
    return fig, flat[:n_panels]


def _style_axes(ax: Any, title: str, ylabel: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title, fontsize=10.5)
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, dpi=_DPI, format="png")
    plt.close(fig)
    os.replace(tmp, path)
    return path


def plot_run(run_dir: StrPath, keys: list[str] | None = None) -> Path:
    """Plot the metrics of one run against round into ``RUN_DIR/plots/curves.png``; return its path.

    ``keys`` defaults to every numeric key present except "round". Keys share a subplot by prefix
    (``test/*``, ``local/*``, ``train/*``, ``time/*``), with losses on their own axes and metrics of very
    different magnitude (accuracy vs PSNR) split apart. Stage changes are marked with dashed lines.
    Event lines are ignored.
    """
    run = _Run.load(run_dir)
    series = run.series
    if keys is None:
        keys = list(series)
    missing = [k for k in keys if k not in series]
    if missing:
        raise ValueError(f"{run.path / METRICS_FILE}: no numeric values for {', '.join(missing)}")
    if not keys:
        raise ValueError(f"{run.path / METRICS_FILE}: no metrics to plot")

    panels = _panel_groups(_display_order(keys), series)
    stages = run.stages
    title = run.name + (f", seed {run.seed}" if run.seed is not None else "")
    if len(stages) > 1:
        title += f"  (stages: {' → '.join(s for s, _ in stages)}, dashed lines)"
    fig, axes = _new_figure(len(panels), title)
    for ax, (title, ks) in zip(axes, panels):
        for k in ks:
            s = series[k]
            ax.plot(s.rounds, s.values, label=k, marker="o" if len(s.rounds) <= 30 else None, markersize=3,
                    linewidth=1.5)
        if len(stages) > 1:
            for stage, start in stages[1:]:
                ax.axvline(start - 0.5, color="0.5", linestyle="--", linewidth=0.8)
                ax.text(start - 0.5, 0.98, f" {stage}", transform=ax.get_xaxis_transform(), fontsize=7,
                        color="0.35", ha="left", va="top")
        ylabel = "seconds" if title.startswith(_PREFIX_TITLES["time"]) else (ks[0] if len(ks) == 1 else "value")
        _style_axes(ax, title, ylabel)
        ax.legend(fontsize=8, loc="best")
    return _save(fig, run.path / "plots" / CURVES_FILE)


def _name_of(v: Any) -> str | None:
    """Readable name of a config component: a string, or a table's "name"/"type"."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict):
        for k in ("name", "type", "kind"):
            if isinstance(v.get(k), str):
                return v[k]
    return None


def _scalar_params(d: dict[str, Any], skip: Iterable[str] = ("name", "type", "kind")) -> str:
    skip = set(skip)
    items = [f"{k}={v}" for k, v in d.items() if k not in skip and isinstance(v, (str, int, float, bool))]
    return ", ".join(items)


def _component(v: Any, with_params: bool) -> str | None:
    name = _name_of(v)
    if name is None:
        return None
    if with_params and isinstance(v, dict):
        params = _scalar_params(v)
        return f"{name}({params})" if params else name
    return name


def _render_recipe(recipe: Any) -> str | None:
    """``slot: part(params) + part; slot: part`` for whatever shape the recipe table has."""
    if isinstance(recipe, str):
        return recipe
    if isinstance(recipe, list):
        parts = [p for p in (_component(x, True) for x in recipe) if p]
        return " + ".join(parts) or None
    if not isinstance(recipe, dict):
        return None
    if _name_of(recipe) is not None and not any(isinstance(v, (dict, list)) for v in recipe.values()):
        return _component(recipe, True)
    slots = []
    for slot, v in recipe.items():
        if isinstance(v, list):
            parts = [p for p in (_component(x, True) for x in v) if p]
            rendered = " + ".join(parts) if parts else None
        elif isinstance(v, dict):
            rendered = _component(v, True)
        elif isinstance(v, (str, int, float, bool)):
            rendered = str(v)
        else:
            rendered = None
        if rendered:
            slots.append(f"{slot}: {rendered}")
    return "; ".join(slots) or None


def _find(config: dict[str, Any], keys: Sequence[str], sections: Sequence[str]) -> Any:
    for sec in sections:
        table = config if sec == "" else config.get(sec)
        if isinstance(table, dict):
            for k in keys:
                if k in table and table[k] is not None:
                    return table[k]
    return None


def _config_digest(config: dict[str, Any]) -> list[tuple[str, str]]:
    """The few config facts a reader wants first; keys that are absent are simply left out."""
    out: list[tuple[str, str]] = []
    if (task := _name_of(config.get("task"))) is not None:
        out.append(("task", task))
    if (data := _name_of(config.get("data"))) is not None:
        out.append(("data", data))
    part = config.get("partition")
    if isinstance(part, (str, dict)) and (pname := _name_of(part)) is not None:
        text = pname
        if isinstance(part, dict):
            n = part.get("num_clients")
            # float parameters are the heterogeneity knobs (alpha, fractions); ints/bools are mostly
            # algorithm limits (max_tries, min_size) and would bury them
            params = ", ".join(f"{k}={v}" for k, v in part.items() if isinstance(v, float))
            text += f" ({params})" if params else ""
            text += f", {n} clients" if n is not None else ""
        out.append(("partition", text))
    n_clients = _find(config, ("num_clients",), ("data", "train", "server", ""))
    if n_clients is not None and not (isinstance(part, dict) and "num_clients" in part):
        out.append(("clients", str(n_clients)))
    if (model := _name_of(config.get("model"))) is not None:
        out.append(("model", model))
    sections = ("train", "server", "")
    if (rounds := _find(config, ("rounds", "num_rounds"), sections)) is not None:
        out.append(("rounds", str(rounds)))
    cpr = _find(config, ("clients_per_round", "num_clients_per_round"), sections)
    if cpr is None:
        cpr = _find(config, ("fraction", "client_fraction", "fraction_fit"), sections)
        if cpr is not None:
            out.append(("clients per round", f"fraction {cpr}"))
    else:
        out.append(("clients per round", str(cpr)))
    train = config.get("train")
    if isinstance(train, dict) and (params := _scalar_params(train)):
        out.append(("local training", params))
    server = config.get("server")
    if isinstance(server, dict) and (opt := _component(server.get("optimizer"), True)) is not None:
        out.append(("server optimizer", opt))
    if (recipe := _render_recipe(config.get("recipe"))) is not None:
        out.append(("recipe", recipe))
    return out


def write_summary(run_dir: StrPath, *, plot: bool = True) -> Path:
    """Write ``RUN_DIR/summary.md`` and return its path.

    The summary has the run name and seed, a short config digest (data, partition, model, rounds,
    clients per round, recipe: whichever exist), a table of the final and best value of every metric
    with the rounds where they occurred, the total time (sum of ``time/round_s``), and a link to
    ``plots/curves.png``. With ``plot=True`` (default) the curves are (re)drawn first so the link is
    never stale.
    """
    run = _Run.load(run_dir)
    series = run.series
    if plot and series:
        plot_run(run.path)
    lines = [f"# {run.name}", ""]
    lines.append(f"- **seed:** {run.seed if run.seed is not None else 'not set'}")
    for label, text in _config_digest(run.config):
        lines.append(f"- **{label}:** {_md_escape(text)}")
    stages = run.stages
    stage_text = f" (stages: {' → '.join(s for s, _ in stages)})" if len(stages) > 1 else ""
    val = (read_partition(run.path) or {}).get("validation")
    if val:
        hist = ", ".join(f"{n}: {c}" for n, c in zip(val.get("class_names", []), val.get("class_counts", [])))
        lines.append(f"- **server validation set:** {val['size']} examples ({val['source']}"
                     f"{', imbalance ' + str(val['imbalance']) if val.get('imbalance') else ''}); per class {hist}")
    lines.append(f"- **rounds completed:** {run.n_rounds}{stage_text}")
    if "time/round_s" in series:
        total = float(np.nansum(series["time/round_s"].values))
        lines.append(f"- **total time:** {_fmt_duration(total)} (sum of time/round_s over "
                     f"{len(series['time/round_s'].rounds)} rounds)")
    else:
        lines.append("- **total time:** not recorded (no time/round_s)")
    lines.append("")
    if series:
        lines += ["## Metrics", "",
                  "| metric | final | at round | best | at round |",
                  "|---|---:|---:|---:|---:|"]
        for k in _display_order(series):
            s = series[k]
            fv, fr = s.final()
            bv, br = s.best(k)
            lines.append(f"| {_md_escape(_metric_label(k))} | {_fmt(fv)} | {fr} | {_fmt(bv)} | {br} |")
        lines += ["", "Final = value at the last round where the metric was logged; "
                  "↑ higher is better, ↓ lower is better.", ""]
    else:
        lines += ["No metrics recorded.", ""]
    lines += ["## Curves", "", f"![training curves](plots/{CURVES_FILE})", ""]
    if (run.path / "plots" / CLIENT_WEIGHTS_FILE).is_file():
        lines += ["## Client weights", "", f"![client weights](plots/{CLIENT_WEIGHTS_FILE})", ""]
    path = run.path / SUMMARY_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines), encoding="utf-8")
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------------------------------
# Several runs: grouping, comparison table, overlaid curves
# --------------------------------------------------------------------------------------------------


def _canonical(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _canonical(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_canonical(x) for x in v]
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def _experiment_key(config: dict[str, Any]) -> str:
    exp = {k: v for k, v in config.items() if k not in ("seed", "run")}
    return json.dumps(_canonical(exp), sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class RunGroup:
    """Runs of one experiment: configs equal apart from top-level "seed" and "run".

    ``label`` is the ``run.name`` of the first run (plus ``[hash]`` of the config when two groups share
    a name); ``run_dirs`` and ``seeds`` are in the order the runs were given.
    """

    label: str
    run_dirs: tuple[Path, ...]
    seeds: tuple[int | None, ...]
    config: dict[str, Any] = field(compare=False, repr=False)


def _group(runs: Sequence[_Run]) -> list[tuple[RunGroup, list[_Run]]]:
    by_key: dict[str, list[_Run]] = {}
    for r in runs:
        by_key.setdefault(_experiment_key(r.config), []).append(r)
    names = [members[0].name for members in by_key.values()]
    out = []
    for (key, members), name in zip(by_key.items(), names):
        label = name
        if names.count(name) > 1:
            label = f"{name} [{hashlib.sha1(key.encode()).hexdigest()[:6]}]"
        config = {k: v for k, v in members[0].config.items() if k not in ("seed", "run")}
        group = RunGroup(label, tuple(r.path for r in members), tuple(r.seed for r in members), config)
        out.append((group, members))
    return out


def group_runs(run_dirs: Iterable[StrPath]) -> list[RunGroup]:
    """Group run directories by config minus top-level "seed" and "run", in order of first appearance."""
    return [g for g, _ in _group(_load_all(run_dirs))]


def _default_metrics(runs: Sequence[_Run]) -> list[str]:
    """Evaluation metrics (``test/*``, ``val/*``, ``local/*``) present in every run, ``test/acc`` first,
    then ``time/round_s`` if every run has it."""
    order: dict[str, int] = {}
    for r in runs:
        for k in r.series:
            order.setdefault(k, len(order))
    common = [k for k in order if all(k in r.series for r in runs)]
    evals = _display_order(k for k in common if k.split("/", 1)[0] in _EVAL_PREFIXES)
    evals.sort(key=lambda k: k != "test/acc")
    return evals + (["time/round_s"] if "time/round_s" in common else [])


def _mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), (float(arr.std(ddof=1)) if len(arr) >= 2 else None)


@dataclass(frozen=True)
class ComparisonRow:
    """One (group, metric) cell pair of a comparison: mean and sample std (None below 2 runs) of each
    run's final and best value. ``n_runs`` counts the runs that logged the metric; ``rounds`` holds
    each run's last round (all runs of the group)."""

    group: str
    metric: str
    higher_is_better: bool
    n_runs: int
    rounds: tuple[int, ...]
    seeds: tuple[int | None, ...]
    final_mean: float | None
    final_std: float | None
    best_mean: float | None
    best_std: float | None


@dataclass(frozen=True)
class ComparisonTable:
    """Final and best values per group and metric, as mean ± std over the runs of each group."""

    groups: tuple[RunGroup, ...]
    metrics: tuple[str, ...]
    rows: tuple[ComparisonRow, ...]

    def _leaders(self) -> set[tuple[str, str]]:
        """(group, metric) of the group with the best mean final per metric (>= 2 groups, no ties)."""
        out = set()
        for m in self.metrics:
            cands = [r for r in self.rows if r.metric == m and r.final_mean is not None
                     and not math.isnan(r.final_mean)]
            if len(cands) >= 2:
                sign = 1.0 if cands[0].higher_is_better else -1.0
                top = max(sign * r.final_mean for r in cands)  # type: ignore[operator]
                winners = [r for r in cands if sign * r.final_mean == top]  # type: ignore[operator]
                if len(winners) == 1:  # no bold on ties
                    out.add((winners[0].group, m))
        return out

    def _seeds_line(self) -> str:
        ns = sorted({len(g.run_dirs) for g in self.groups})
        n = str(ns[0]) if len(ns) == 1 else "N"
        unit = "seed" if n == "1" else "seeds"
        text = f"Values are mean ± std over {n} {unit}"
        if len(ns) > 1:
            text += " (N per group in column n)"
        return (text + "; std is the sample std (ddof=1), omitted for a single run. Final = each run's "
                "last logged round; best = max (↑) or min (↓) over rounds. Bold: best final per metric.")

    def _cells(self, r: ComparisonRow) -> tuple[str, str]:
        """Formatted (final, best), with decimals shared by all rows of the metric."""
        same = [x for x in self.rows if x.metric == r.metric]
        d = _decimals([x.final_mean for x in same] + [x.best_mean for x in same])
        return _fmt_mean_std(r.final_mean, r.final_std, d), _fmt_mean_std(r.best_mean, r.best_std, d)

    @staticmethod
    def _rounds_text(rounds: tuple[int, ...]) -> str:
        lo, hi = min(rounds), max(rounds)
        return str(lo) if lo == hi else f"{lo}–{hi}"

    def to_markdown(self) -> str:
        """A markdown table (one row per metric and group) preceded by a "mean ± std over N seeds" line."""
        lead = self._leaders()
        lines = [self._seeds_line(), "",
                 "| metric | run | n | rounds | final | best |",
                 "|---|---|---:|---:|---:|---:|"]
        for r in self.rows:
            final, best = self._cells(r)
            if (r.group, r.metric) in lead:
                final = f"**{final}**"
            lines.append(f"| {_md_escape(_metric_label(r.metric))} | {_md_escape(r.group)} | {r.n_runs} | "
                         f"{self._rounds_text(r.rounds)} | {final} | {best} |")
        return "\n".join(lines) + "\n"

    def to_rich(self) -> Any:
        """The same table as a ``rich.table.Table`` (one section per metric)."""
        from rich.markup import escape
        from rich.table import Table

        lead = self._leaders()
        table = Table(title="FedSight run comparison", caption=self._seeds_line(), caption_justify="left")
        table.add_column("metric", style="cyan", overflow="fold")
        table.add_column("run", overflow="fold")
        table.add_column("n", justify="right")
        table.add_column("rounds", justify="right")
        table.add_column("final", justify="right", no_wrap=True)
        table.add_column("best", justify="right", no_wrap=True)
        for i, r in enumerate(self.rows):
            first_of_metric = i == 0 or self.rows[i - 1].metric != r.metric
            last_of_metric = i + 1 == len(self.rows) or self.rows[i + 1].metric != r.metric
            final, best = self._cells(r)
            if (r.group, r.metric) in lead:
                final = f"[bold]{final}[/bold]"
            table.add_row(_metric_label(r.metric) if first_of_metric else "", escape(r.group), str(r.n_runs), self._rounds_text(r.rounds),
                          final, best, end_section=last_of_metric)
        return table


def _compare_runs(runs: Sequence[_Run], metrics: list[str] | None) -> tuple[ComparisonTable, list[list[_Run]]]:
    grouped = _group(runs)
    if metrics is None:
        metrics = _default_metrics(runs)
    else:
        absent = [m for m in metrics if not any(m in r.series for r in runs)]
        if absent:
            raise ValueError(f"metric(s) not logged by any run: {', '.join(absent)}")
    rows = []
    for m in metrics:
        for group, members in grouped:
            have = [r for r in members if m in r.series]
            fm, fs = _mean_std([r.series[m].final()[0] for r in have])
            bm, bs = _mean_std([r.series[m].best(m)[0] for r in have])
            rows.append(ComparisonRow(group.label, m, higher_is_better(m), len(have),
                                      tuple(r.n_rounds for r in members), group.seeds, fm, fs, bm, bs))
    table = ComparisonTable(tuple(g for g, _ in grouped), tuple(metrics), tuple(rows))
    return table, [members for _, members in grouped]


def compare(run_dirs: Iterable[StrPath], metrics: list[str] | None = None) -> ComparisonTable:
    """Compare groups of runs (see ``group_runs``) on final and best metric values.

    ``metrics`` defaults to the evaluation metrics (``test/*``, ``val/*``, ``local/*``) present in every
    run, ``test/acc`` first, then ``time/round_s``; pass other keys (``train/loss``, ``dp/epsilon``)
    explicitly. For each group and metric the table holds the mean and
    sample std (ddof=1; none for a single run) over the group's runs of:

    - final: each run's value at its own last round where the metric was logged, so a run that was
      interrupted early or evaluates every k rounds still contributes its last evaluation;
    - best: each run's max (higher-is-better) or min (lower-is-better) over its logged rounds.
    """
    return _compare_runs(_load_all(run_dirs), metrics)[0]


def _mean_curve_runs(runs: Sequence[_Run], metric: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    have = [r.series[metric] for r in runs if metric in r.series]
    if not have:
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
    common = have[0].rounds
    for s in have[1:]:
        common = np.intersect1d(common, s.rounds)
    stacked = np.stack([s.values[np.searchsorted(s.rounds, common)] for s in have])
    std = stacked.std(axis=0, ddof=1) if len(have) >= 2 else np.zeros(len(common))
    return common, stacked.mean(axis=0), std


def mean_curve(run_dirs: Iterable[StrPath], metric: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rounds, mean, std)`` of ``metric`` over the given runs (typically one group's seeds).

    Curves are aligned on the rounds where every run that logged the metric has a value, so a run
    interrupted early shortens the curve rather than skewing its tail. std is the sample std (ddof=1),
    zeros for a single run.
    """
    return _mean_curve_runs(_load_all(run_dirs), metric)


def _plot_groups(table: ComparisonTable, members: list[list[_Run]], path: Path) -> Path:
    metrics = list(table.metrics)
    if not metrics:
        raise ValueError("no metrics to plot")
    n_seeds = sorted({len(g.run_dirs) for g in table.groups})
    seeds_text = (f"{n_seeds[0]} seed{'s' if n_seeds[0] != 1 else ''}" if len(n_seeds) == 1
                  else f"{n_seeds[0]}–{n_seeds[-1]} seeds")
    fig, axes = _new_figure(len(metrics), f"Comparison: mean ± std over {seeds_text} per run group")
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    handles: dict[str, Any] = {}
    for ax, m in zip(axes, metrics):
        for gi, (group, runs) in enumerate(zip(table.groups, members)):
            rounds, mean, std = _mean_curve_runs(runs, m)
            if len(rounds) == 0:
                continue
            color = colors[gi % len(colors)]
            (line,) = ax.plot(rounds, mean, color=color, linewidth=1.6, label=group.label,
                              marker="o" if len(rounds) <= 30 else None, markersize=3)
            if len(runs) >= 2:
                ax.fill_between(rounds, mean - std, mean + std, color=color, alpha=0.2, linewidth=0)
            handles.setdefault(group.label, line)
        ylabel = "seconds" if m.startswith("time") else m.rsplit("/", 1)[-1]
        _style_axes(ax, f"{m} ({'higher' if higher_is_better(m) else 'lower'} is better)", ylabel)
    fig.legend(list(handles.values()), list(handles), loc="outside lower center",
               ncol=min(len(handles), 4), frameon=False)
    return _save(fig, path)


def plot_comparison(run_dirs: Iterable[StrPath], path: StrPath, metrics: list[str] | None = None) -> Path:
    """Overlay the groups' curves, one subplot per metric, and save a PNG at ``path``; return it.

    Each group is one line: the mean over its runs at the rounds all its runs logged, with a shaded
    ±std band (sample std) when it has two or more runs. ``metrics`` defaults as in ``compare``.
    """
    table, members = _compare_runs(_load_all(run_dirs), metrics)
    return _plot_groups(table, members, Path(path))


def report(run_dirs: Iterable[StrPath], out_dir: StrPath, metrics: list[str] | None = None) -> ComparisonTable:
    """Write ``out_dir/report.md`` (comparison table, group membership, curves link) and
    ``out_dir/curves.png`` for the given runs; return the table. ``metrics`` defaults as in ``compare``."""
    out = Path(out_dir)
    table, members = _compare_runs(_load_all(run_dirs), metrics)
    _plot_groups(table, members, out / CURVES_FILE)
    lines = ["# FedSight comparison", "", table.to_markdown(), "## Groups", ""]
    for g in table.groups:
        seeds = ", ".join("?" if s is None else str(s) for s in g.seeds)
        dirs = ", ".join(f"`{d}`" for d in g.run_dirs)
        lines.append(f"- **{_md_escape(g.label)}**: seeds {seeds} — {dirs}")
    lines += ["", "## Curves", "", f"![comparison curves]({CURVES_FILE})", ""]
    (out / "report.md").write_text("\n".join(lines), encoding="utf-8")
    return table


# --------------------------------------------------------------------------------------------------
# Client weights (who was trusted, and their data)
# --------------------------------------------------------------------------------------------------

CLIENT_WEIGHTS_FILE = "client_weights.png"
PARTITION_FILE = "partition.json"


def read_partition(run_dir: StrPath) -> dict[str, Any] | None:
    """``RUN_DIR/partition.json`` (per-client label counts, class names, the server validation set), or
    None when the run did not write one."""
    p = Path(run_dir) / PARTITION_FILE
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: invalid JSON ({exc})") from None


def client_weight_matrix(rows: Sequence[dict[str, Any]], num_clients: int | None = None) -> tuple[np.ndarray, np.ndarray, bool]:
    """([clients, rounds] weight relative to uniform, rounds, per_key) from ``client_weights.jsonl`` rows.

    Entry (k, t) is p_k^t * |S_t| (1 = the uniform weight of that round, NaN = client k not aggregated
    in round t). Per-tensor weights (FedVG layer/block granularity) are averaged over the tensors first.
    """
    rounds = sorted({int(r["round"]) for r in rows})
    col = {r: i for i, r in enumerate(rounds)}
    k_max = max((max(r["clients"], default=-1) for r in rows), default=-1) + 1
    n = max(k_max, num_clients or 0)
    out = np.full((n, len(rounds)), np.nan)
    per_key = False
    for r in rows:
        w = r["weights"]
        if isinstance(w, dict):
            per_key = True
            w = np.mean(np.array(list(w.values()), dtype=np.float64), axis=0) if w else []
        w = np.asarray(w, dtype=np.float64)
        m = len(r["clients"])
        for c, v in zip(r["clients"], w):
            out[int(c), col[int(r["round"])]] = v * m
    return out, np.array(rounds, dtype=np.int64), per_key


def plot_client_weights(run_dir: StrPath, label_counts: np.ndarray | Sequence[Sequence[int]] | None = None,
                        class_names: Sequence[str] | None = None) -> Path:
    """Draw ``RUN_DIR/plots/client_weights.png`` from ``RUN_DIR/client_weights.jsonl``; return its path.

    Left: each client's training label distribution (share of each class, clients down, with the
    client's size), from ``label_counts`` [clients, classes] or, by default, ``RUN_DIR/partition.json``.
    Middle: the normalised aggregation weight of each client in each round as a multiple of the
    uniform weight 1/|S_t| (red = trusted more than uniform, blue = less, grey = not aggregated that
    round). Right: each client's mean relative weight over the rounds it was aggregated, with its number
    of participations. Rows line up, so the plot shows who was trusted and what data they hold.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    run_path = Path(run_dir)
    wpath = run_path / "client_weights.jsonl"
    if not wpath.is_file():
        raise FileNotFoundError(f"{wpath}: no client weights logged")
    rows = [json.loads(line) for line in wpath.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{wpath}: no rounds logged")
    part = read_partition(run_path) if label_counts is None else None
    if label_counts is None and part is not None:
        label_counts = part.get("client_label_counts")
        class_names = class_names or part.get("class_names")
    counts = np.asarray(label_counts, dtype=np.float64) if label_counts is not None else None
    w, rounds, per_key = client_weight_matrix(rows, None if counts is None else counts.shape[0])
    n_clients, n_rounds = w.shape
    try:
        name = _Run.load(run_path).name
    except (FileNotFoundError, ValueError):
        name = run_path.resolve().name

    has_labels = counts is not None and counts.ndim == 2 and counts.shape[0] == n_clients
    n_classes = counts.shape[1] if has_labels else 0
    row_h = 0.17 if n_clients > 25 else 0.3
    height = max(4.0, 2.0 + n_clients * row_h)
    label_w = max(2.4, 0.32 * n_classes) if has_labels else 0.0
    weight_w = min(14.0, max(4.5, 0.09 * n_rounds + 2.5))
    ratios = ([label_w, 0.9] if has_labels else []) + [weight_w, 1.6]
    fig = plt.figure(figsize=(sum(ratios) + 1.8, height), layout="constrained")
    gs = fig.add_gridspec(1, len(ratios), width_ratios=ratios)
    axes = [fig.add_subplot(gs[0, i]) for i in range(len(ratios))]
    yt = _tick_positions_(n_clients, 50 if n_clients <= 60 else 30)

    i = 0
    if has_labels:
        ax_lab, ax_size = axes[0], axes[1]
        sizes = counts.sum(axis=1)
        share = counts / np.maximum(sizes[:, None], 1)
        ax_lab.imshow(share, aspect="auto", cmap="Greens", vmin=0, vmax=1, interpolation="nearest")
        names = [str(c) for c in (class_names or range(n_classes))]
        ax_lab.set_xticks(np.arange(n_classes), names, rotation=90 if n_classes > 12 or max(map(len, names)) > 3 else 0,
                          fontsize=8)
        ax_lab.set_yticks(yt, [str(k) for k in yt], fontsize=7 if n_clients > 25 else 8)
        ax_lab.set_xlabel("class")
        ax_lab.set_ylabel("client")
        ax_lab.set_title("label share per client", fontsize=10)
        ax_size.barh(np.arange(n_clients), sizes, height=0.8, color="0.5")
        ax_size.set_ylim(n_clients - 0.5, -0.5)
        ax_size.tick_params(axis="y", labelleft=False, left=False)
        ax_size.tick_params(axis="x", labelsize=7)
        ax_size.set_title("size", fontsize=10)
        ax_size.set_xlabel("examples", fontsize=8)
        i = 2
    ax_w, ax_mean = axes[i], axes[i + 1]
    finite = w[np.isfinite(w)]
    vmax = max(2.0, float(np.nanpercentile(finite, 99))) if finite.size else 2.0
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="0.88")
    im = ax_w.imshow(np.ma.masked_invalid(w), aspect="auto", cmap=cmap, norm=TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=vmax),
                     interpolation="nearest")
    xt = _tick_positions_(n_rounds, 12)
    ax_w.set_xticks(xt, [str(rounds[j]) for j in xt], fontsize=8)
    ax_w.set_yticks(yt, [str(k) for k in yt] if not has_labels else [], fontsize=7 if n_clients > 25 else 8)
    if not has_labels:
        ax_w.set_ylabel("client")
    ax_w.set_xlabel("round")
    what = "mean over tensors of " if per_key else ""
    ax_w.set_title(f"{what}weight x clients in round (1 = uniform; grey = not aggregated)", fontsize=10)
    fig.colorbar(im, ax=ax_w, shrink=0.6, pad=0.01, label="weight / uniform")

    mean = np.array([np.nanmean(r) if np.isfinite(r).any() else np.nan for r in w])
    times = np.isfinite(w).sum(axis=1)
    colors = ["#b2182b" if v > 1 else "#2166ac" for v in np.nan_to_num(mean, nan=1.0)]
    ax_mean.barh(np.arange(n_clients), np.nan_to_num(mean), height=0.8, color=colors)
    ax_mean.axvline(1.0, color="0.3", linewidth=0.8, linestyle="--")
    ax_mean.set_ylim(n_clients - 0.5, -0.5)
    ax_mean.tick_params(axis="y", labelleft=False, left=False)
    ax_mean.tick_params(axis="x", labelsize=7)
    ax_mean.set_title("mean (times)", fontsize=10)
    ax_mean.set_xlabel("weight / uniform", fontsize=8)
    top = float(np.nanmax(mean)) if np.isfinite(mean).any() else 1.0
    ax_mean.set_xlim(0, max(1.5, top) * 1.35)
    if n_clients <= 60:
        for k, (v, t) in enumerate(zip(mean, times)):
            if t:
                ax_mean.text(v, k, f" {v:.2f} ({t})", va="center", ha="left", fontsize=6 if n_clients > 25 else 7)
    for ax in axes:
        if ax is not ax_mean:
            ax.set_ylim(n_clients - 0.5, -0.5)
    fig.suptitle(f"{name}: client weights per round", fontsize=12)
    return _save(fig, run_path / "plots" / CLIENT_WEIGHTS_FILE)


def _tick_positions_(n: int, max_ticks: int) -> np.ndarray:
    step = max(1, int(math.ceil(n / max_ticks)))
    return np.arange(0, n, step)
