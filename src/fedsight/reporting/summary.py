"""One run's ``summary.md``: name and seed, a config digest, final and best value of every metric."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..safe_write import atomic_write_text
from .client_weights import CLIENT_WEIGHTS_FILE
from .fmt import _fmt_duration, _md_escape, _metric_label
from .last_window import window_section
from .partition import read_partition
from .plots import CURVES_FILE, plot_run
from .run_panels import channel_label, duplicate_channels
from .units import human, metric_unit
from .runs_view import StrPath, _best_direction, _display_order, _Run

SUMMARY_FILE = "summary.md"


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


def _events_section(records: list[dict]) -> list[str]:
    """A table of the run's events (lost or rejected clients, skipped rounds, ...): how many, in which rounds,
    and the most frequent reasons."""
    from collections import Counter

    events = [r for r in records if "event" in r]
    if not events:
        return []
    lines = ["## Events", "", "| event | count | rounds | most frequent reasons |", "|---|---:|---|---|"]
    for kind in sorted({str(e["event"]) for e in events}):
        mine = [e for e in events if e["event"] == kind]
        rounds = sorted({e.get("round") for e in mine if isinstance(e.get("round"), int)})
        span = "—" if not rounds else (str(rounds[0]) if len(rounds) == 1 else f"{rounds[0]}–{rounds[-1]} ({len(rounds)})")
        reasons = Counter(str(e["reason"]).split(":")[0] for e in mine if e.get("reason"))
        why = "; ".join(f"{_md_escape(r)} ×{n}" for r, n in reasons.most_common(3)) or "—"
        lines.append(f"| {_md_escape(kind)} | {len(mine)} | {span} | {why} |")
    return lines + [""]


#: events that take updates out of a round -> the cause they give a round that was then skipped
_SKIP_CAUSES = {"rejected_update": "rejected updates", "client_lost": "lost clients", "model_refused": "refused models",
                "too_few_clients": "too few clients", "dp_release_skipped": "an incomplete DP release"}


def skipped_rounds(records: list[dict]) -> dict[int, str]:
    """Round -> why it was skipped (a ``round_skipped`` event: nothing aggregated, the global model left as it
    was), from that round's events: "non-finite updates" for rejections of non-finite values, the other ways
    updates were lost, and the skip's own reason when it is more than "no valid client update"."""
    events: dict[int, list[dict]] = {}
    for e in records:
        if "event" in e and isinstance(e.get("round"), int):
            events.setdefault(e["round"], []).append(e)
    out: dict[int, str] = {}
    for r in sorted(events):
        if not any(e["event"] == "round_skipped" for e in events[r]):
            continue
        causes: list[str] = []
        for e in events[r]:
            kind, reason = str(e["event"]), str(e.get("reason", ""))
            if kind == "rejected_update" and "non-finite" in reason:
                cause = "non-finite updates"
            elif kind == "round_skipped":
                cause = None if reason in ("", "no valid client update") else reason.split(":")[0]
            else:
                cause = _SKIP_CAUSES.get(kind)
            if cause and cause not in causes:
                causes.append(cause)
        out[r] = ", ".join(causes) or "no valid client update"
    return out


def skipped_status(records: list[dict]) -> dict[str, Any]:
    """``status.json``'s account of the skipped rounds (none: ``{}``): ``skipped_rounds`` (sorted) and
    ``skipped_causes`` (cause -> rounds)."""
    skipped = skipped_rounds(records)
    causes: dict[str, list[int]] = {}
    for r, cause in sorted(skipped.items()):
        causes.setdefault(cause, []).append(r)
    return {"skipped_rounds": sorted(skipped), "skipped_causes": causes} if skipped else {}


def _skipped_line(causes: dict[str, list[int]], total: int) -> str:
    """"N of R rounds were skipped (cause): rounds a, b", one clause per cause (``skipped_status``)."""
    n = sum(len(rs) for rs in causes.values())
    clauses = [f"({c}): round{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}" for c, rs in causes.items()]
    if len(clauses) == 1:
        return f"{n} of {total} rounds were skipped {clauses[0]}"
    return f"{n} of {total} rounds were skipped: " + "; ".join(f"{len(rs)} {cl}" for rs, cl in zip(causes.values(), clauses))


def _privacy_noise(run_dir: Path) -> str | None:
    """The last session's ``privacy_noise`` in ``run.json`` (``simulated: the noise is derivable from the seed
    (...)`` or ``secret: ...``), None when the run draws no protecting noise or predates the field."""
    from ..runs import read_run_meta

    sessions = (read_run_meta(run_dir) or {}).get("sessions") or []
    last = sessions[-1] if sessions and isinstance(sessions[-1], dict) else {}
    value = last.get("privacy_noise")
    return value if isinstance(value, str) else None


def _selected(run: _Run) -> list[str]:
    """The line of a run with a model selection (``eval.select = "best"``: ``best.json``): the round selected on
    validation, its validation value and its test metrics (the last row's ``selected/test/*``)."""
    from ..model_selection import BEST_WEIGHTS, SELECTED, read_best, selected_line

    record = read_best(run.path)
    if record is None:
        return []
    final = next((r for r in reversed(run.metric_records) if f"{SELECTED}/round" in r), {})
    return [f"- **selected on validation:** {_md_escape(selected_line(record, final))} (`{BEST_WEIGHTS}`)"]


def write_summary(run_dir: StrPath, *, plot: bool = True) -> Path:
    """Write ``RUN_DIR/summary.md`` and return its path.

    The summary has the run name and seed, a short config digest (data, partition, model, rounds,
    clients per round, recipe: whichever exist), a table of the final and best value of every metric
    with the rounds where they occurred, the total time (sum of ``time/round_s``), and a link to
    ``plots/curves.png``. "Best" is the max or min over rounds as the run's ``run.json`` directs; a
    metric with no direction has none ("—"), nor has a budget metric (bytes, FLOPs, seconds, privacy
    epsilon: ``fedsight.metric_table.is_budget``). With ``plot=True`` (default) the curves are (re)drawn first
    so the link is never stale.
    """
    run = _Run.load(run_dir)
    series = run.series
    if plot and series:
        plot_run(run.path)
    lines = [f"# {run.name}", ""]
    lines.append(f"- **seed:** {run.seed if run.seed is not None else 'not set'}")
    privacy = _privacy_noise(run.path)
    if privacy:  # where the DP noise and keys came from (run.json; fedsight.secret)
        lines.append(f"- **privacy noise:** {_md_escape(privacy)}")
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
    skipped = skipped_status(run.records)
    if skipped:
        lines.append(f"- **skipped rounds:** {_md_escape(_skipped_line(skipped['skipped_causes'], run.n_rounds))}")
    if "time/round_s" in series:
        total = float(np.nansum(series["time/round_s"].values))
        lines.append(f"- **total time:** {_fmt_duration(total)} (sum of time/round_s over "
                     f"{len(series['time/round_s'].rounds)} rounds)")
    else:
        lines.append("- **total time:** not recorded (no time/round_s)")
    lines += _selected(run)
    lines.append("")
    if series:
        lines += ["## Metrics", "",
                  "| metric | final | at round | best | at round |",
                  "|---|---:|---:|---:|---:|"]
        task = run.config.get("task")
        task_name = task.get("name") if isinstance(task, dict) else task if isinstance(task, str) else None
        twins = duplicate_channels(list(series), series)
        for k in _display_order(series):
            s = series[k]
            higher = run.direction(k)
            fv, fr = s.final()
            bv, br = s.best(_best_direction(k, higher))
            unit = metric_unit(k, task_name, run.primary)
            label = _metric_label(channel_label(k, unit), higher)
            if k in twins:
                label += f", = {twins[k]}"
            lines.append(f"| {_md_escape(label)} | {human(fv, unit)} | {fr} | {'—' if bv is None else human(bv, unit)} | "
                         f"{'—' if br is None else br} |")
        lines += ["", "Final = value at the last round where the metric was logged; "
                  "↑ higher is better, ↓ lower is better; no arrow: no direction, so no best; budget "
                  "metrics (bytes, FLOPs, seconds, privacy epsilon) have no best either. Bytes and FLOPs in "
                  "decimal prefixes (1 MB = 10^6 B)."
                  + (" (Y): on BT.601 luma, (RGB): on the RGB channels; psnr and ssim are the task's reported channel."
                     if any(channel_label(k) != k for k in series) else ""), ""]
    else:
        lines += ["No metrics recorded.", ""]
    lines += window_section(run.config, series, run.n_rounds)
    lines += _events_section(run.records)
    if (run.path / "plots" / CURVES_FILE).is_file():  # (run.plots = false draws none)
        lines += ["## Curves", "", f"![training curves](plots/{CURVES_FILE})", ""]
    if (run.path / "plots" / CLIENT_WEIGHTS_FILE).is_file():
        lines += ["## Client weights", "", f"![client weights](plots/{CLIENT_WEIGHTS_FILE})", ""]
    if (run.path / "plots" / "class_split.png").is_file():  # eval.class_split (fedsight.class_split, Fig. 4.7)
        lines += ["## Own vs other classes", "", "![class-wise accuracy, own vs other classes](plots/class_split.png)", ""]
    path = run.path / SUMMARY_FILE
    atomic_write_text(path, "\n".join(lines))
    return path
