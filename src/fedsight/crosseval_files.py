"""The models x sites matrix of ``fedsight.crosseval.cross_evaluate`` as files: ``crosseval.md`` (the headline
metric's table, ``local/wma``'s, each client's where few, the sites and the provenance of the runs and of this
evaluation), ``crosseval.csv`` (long format) and ``crosseval.json`` (every evaluation with all its metrics).

Values are printed with 4 significant digits in Markdown and in full (``repr``) in CSV and JSON. The Markdown
table shows the clients as sites of their own only up to ``MAX_CLIENT_COLUMNS`` columns, so that it stays
readable; the CSV and JSON always hold every client.
"""

from __future__ import annotations

import csv
import io
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _table(matrix: Any, key: str) -> list[str]:
    head = ["model \\ site", *[s.name for s in matrix.sites]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, label in enumerate(matrix.labels):
        rnd = matrix.cells[i, 0][1].round
        vals = [_fmt(matrix.value(i, j, key)) for j in range(len(matrix.sites))]
        lines.append("| " + " | ".join([f"`{label}` (round {rnd})", *vals]) + " |")
    return lines


#: the most client columns ``crosseval.md`` shows (every client's value is in the CSV and JSON)
MAX_CLIENT_COLUMNS = 12


def _client_columns(matrix: Any) -> list[tuple[int, str]]:
    """(site index, client id) of every client with a local test set on any run's evaluation of the site."""
    cols = []
    for j in range(len(matrix.sites)):
        ids = {c for i in range(len(matrix.runs)) for c in matrix.cells[i, j][1].clients}
        cols += [(j, c) for c in sorted(ids, key=int)]
    return cols


def _client_table(matrix: Any) -> list[str]:
    """Each client of each site as a site of its own (NVFlare's sites): the primary metric on its local test set."""
    cols = _client_columns(matrix)
    if not cols:
        return []
    key = matrix.headline.split("/", 1)[1]
    if len(cols) > MAX_CLIENT_COLUMNS:
        return ["## Each client", "", f"`{key}` of every model on each of the sites' {len(cols)} clients' local test "
                "sets: in crosseval.csv and crosseval.json.", ""]
    head = ["model \\ client", *[f"{matrix.sites[j].name} {c}" for j, c in cols]]
    lines = ["## Each client", "", f"`{key}` on each site's client's local test set.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, label in enumerate(matrix.labels):
        vals = [_fmt(matrix.cells[i, j][1].clients.get(c, {}).get(key)) for j, c in cols]
        lines.append("| " + " | ".join([f"`{label}`", *vals]) + " |")
    return lines + [""]


def matrix_markdown(matrix: Any, command: Sequence[str] | None = None) -> str:
    """``crosseval.md``: the headline metric of every model on every site, WMA over the sites' clients, what
    each site is, the client-state rule and the provenance of the runs and of this evaluation."""
    from .provenance import provenance as here
    from .reporting.compare import provenance as run_provenance

    better = {True: "higher is better", False: "lower is better"}.get(matrix.higher_is_better, "")
    model = "the selected best global model (best.safetensors)" if matrix.model == "best" else "the last checkpoint"
    lines = ["# Cross-site evaluation", "",
             f"Rows: each run's model ({model}); columns: sites (data configurations). Each cell is "
             f"`{matrix.headline}` on the site's global test set" + (f" ({better})." if better else "."), "",
             *_table(matrix, matrix.headline), ""]
    if any("local/wma" in ev.metrics for _, ev in matrix.cells.values()):
        lines += ["## Over the site's clients", "",
                  "`local/wma`: the example-weighted mean of the primary metric over each site's clients' local test "
                  "sets.", "", *_table(matrix, "local/wma"), ""]
    lines += _client_table(matrix)
    lines += ["## Sites", ""]
    common = f" (and for every site: {', '.join(f'`{c}`' for c in matrix.common)})" if matrix.common else ""
    for j, site in enumerate(matrix.sites):
        sets = ", ".join(f"`{o}`" for o in site.overrides) or "the run's own data"
        rules = sorted({matrix.cells[i, j][1].client_rule for i in range(len(matrix.runs))})
        lines.append(f"- **{site.name}**: {sets}; client state: {', '.join(rules)}")
    lines += ["", f"Sites set with `--site`{common}. \"global model only\": the site's clients are not the run's, so "
              "no client's personal state is used (docs/evaluation.md).", ""]
    info = here()
    git = info.get("git", {}).get("fedsight")
    lines += ["## This evaluation", ""]
    if git:
        dirty = " (with uncommitted changes)" if git.get("dirty") else ""
        lines.append(f"- FedSight commit: `{git['commit'][:12]}{dirty}`")
    lines.append(f"- command: `{shlex.join(command if command is not None else ['fedsight', *sys.argv[1:]])}`")
    lines.append(f"- torch {torch.__version__}, Python {sys.version.split()[0]}")
    lines += ["", run_provenance(matrix.runs).replace("## Provenance", "## Provenance of the runs", 1)]
    return "\n".join(lines).rstrip() + "\n"


def matrix_rows(matrix: Any) -> list[dict[str, Any]]:
    """One record per (run, site): run, site, model, round, client rule, the site's settings and every metric,
    with each client's local metrics."""
    rows = []
    for (i, j), (checked, ev) in sorted(matrix.cells.items()):
        rows.append({"run": str(matrix.runs[i]), "label": matrix.labels[i], "site": matrix.sites[j].name,
                     "set": [*matrix.common, *matrix.sites[j].overrides], "model": matrix.model, "round": ev.round,
                     "clients": ev.client_rule, "metrics": ev.metrics, "client_metrics": ev.clients})
    return rows


def matrix_csv(matrix: Any) -> str:
    """Long format: run, site, client, model, round, clients (the client-state rule), metric, value: the headline
    metric and ``local/wma`` of each site (client empty), then the primary metric on each client's local test set
    (metric ``local/<primary>``)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["run", "site", "client", "model", "round", "clients", "metric", "value"])
    primary = matrix.headline.split("/", 1)[1]
    for (i, j), (_, ev) in sorted(matrix.cells.items()):
        where = [matrix.labels[i], matrix.sites[j].name]
        for key in (matrix.headline, "local/wma"):
            if key in ev.metrics:
                w.writerow([*where, "", matrix.model, ev.round, ev.client_rule, key, repr(float(ev.metrics[key]))])
        for c in sorted(ev.clients, key=int):
            if primary in ev.clients[c]:
                w.writerow([*where, c, matrix.model, ev.round, ev.client_rule, f"local/{primary}",
                            repr(float(ev.clients[c][primary]))])
    return buf.getvalue()


#: what ``write_matrix`` writes into its folder
MATRIX_FILES = ("crosseval.md", "crosseval.csv", "crosseval.json")


def write_matrix(matrix: Any, out: Path, command: Sequence[str] | None = None) -> list[Path]:
    """``out/crosseval.md``, ``.csv`` and ``.json`` (each written atomically)."""
    from .runs import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    md, table, js = (out / name for name in MATRIX_FILES)
    atomic_write_text(md, matrix_markdown(matrix, command))
    atomic_write_text(table, matrix_csv(matrix))
    atomic_write_text(js, json.dumps({"headline": matrix.headline, "sites": [
        {"name": s.name, "set": list(s.overrides)} for s in matrix.sites], "common": list(matrix.common),
        "evaluations": matrix_rows(matrix)}, indent=1) + "\n")
    return [md, table, js]
