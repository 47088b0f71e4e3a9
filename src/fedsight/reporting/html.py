"""``report.html``: the whole report in one self-contained file, to open in any browser or attach to a mail.

Choices:

* One file, no network and no JavaScript: every picture is a ``data:image/png;base64`` URI, the CSS sits in a
  ``<style>`` element, and links are in-page anchors only. Every text that comes from runs, configs or the
  command line goes through ``html.escape``.
* The same sections as ``report.md`` (``fedsight.reporting.document``): per task (and dataset where the metrics
  differ) the comparison table (mean ± std, best in bold), the paired comparisons with the baseline (Δ, 95% CI,
  verdict), the groups and their run folders, the curves, the cost to each ``--target`` and the metric against
  cumulative cost (``cost_target``); then, per section, the partition heat maps
  drawn from the runs' ``partition.json`` (one per distinct partition, naming the groups that share it) and
  every PNG the runs wrote under ``plots/`` (task visuals, those of sub-folders such as ``plots/visuals/`` after
  the top-level ones, the run's own curves last), in a collapsed ``<details>`` per group and run, so the page
  stays short for any number of runs.
* Size: a run contributes at most ``MAX_IMAGES_PER_RUN`` pictures of at most ``MAX_IMAGE_BYTES`` each, and the
  runs' pictures at most ``MAX_RUN_IMAGE_BYTES`` in all, task pictures before the runs' own curves (``_Budget``);
  what is left out is listed by path with the reason, never dropped silently. A section draws at most
  ``MAX_HEATMAPS`` heat maps.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .compare import provenance_values
from .fmt import _metric_label
from .paired import CONFIDENCE
from .runs_view import _Run

__all__ = ["report_html"]

MAX_IMAGES_PER_RUN = 12
MAX_IMAGE_BYTES = 4 << 20
MAX_RUN_IMAGE_BYTES = 16 << 20
MAX_HEATMAPS = 12

_CSS = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:0 auto;
max-width:1280px;padding:0 24px 48px;color:#1d232b;background:#fff}
h1{font-size:26px;margin:24px 0 6px}h2{font-size:21px;margin:36px 0 8px;padding-top:10px;border-top:2px solid #d6dbe1}
h3{font-size:17px;margin:22px 0 6px}h4{font-size:15px;margin:14px 0 4px}
p.note,p.meta{color:#4a5561;font-size:13.5px;max-width:1100px}
nav ul{margin:4px 0 0;padding-left:22px}
table{border-collapse:collapse;margin:8px 0 12px;font-size:14px}
th,td{border:1px solid #d6dbe1;padding:4px 9px;text-align:left;vertical-align:top}
th{background:#eef1f4}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tbody tr:first-child td{border-top:2px solid #b9c1ca}
.better{color:#0f6b2f;font-weight:600}.worse{color:#a3231b;font-weight:600}.noise{color:#5b6570}
.better,.worse,.noise{white-space:nowrap}img.heat{max-width:760px}
img{max-width:100%;height:auto;border:1px solid #e3e7eb;display:block;margin:6px 0}
figure{margin:8px 0 16px}figcaption{font-size:13px;color:#4a5561}
.pics{display:flex;flex-wrap:wrap;gap:4px 18px;align-items:flex-start}.pics figure{max-width:100%}
details{margin:6px 0;border:1px solid #e3e7eb;border-radius:4px;padding:4px 10px}
summary{cursor:pointer;font-weight:600;padding:2px 0}
code{font-size:13px;background:#f3f5f7;padding:0 3px;border-radius:3px;overflow-wrap:anywhere}
ul.left{color:#4a5561;font-size:13.5px}
"""


def _count(n: int, noun: str) -> str:
    """``1 run``, ``2 runs``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _img(data: bytes, alt: str) -> str:
    return f'<img alt="{_e(alt)}" src="data:image/png;base64,{base64.b64encode(data).decode("ascii")}">'


def _figure(data: bytes, caption: str, cls: str = "") -> str:
    img = _img(data, caption).replace("<img ", f'<img class="{cls}" ', 1) if cls else _img(data, caption)
    return f"<figure>{img}<figcaption>{_e(caption)}</figcaption></figure>"


def _read_png(path: Path, limit: int) -> bytes | None:
    """The bytes of the PNG at ``path`` (bounded read of a regular file), None when it is not one."""
    from ..safe_read import read_bytes

    try:
        data = read_bytes(path, "PNG", limit=limit)
    except (OSError, ValueError):
        return None
    return data if data.startswith(b"\x89PNG\r\n\x1a\n") else None


# -- tables -------------------------------------------------------------------------------------------------


def _bold(cell: str) -> str:
    """A cell that ``ComparisonTable._cells`` wrapped in the NUL/SOH markers, escaped, with the markers as
    ``<strong>``."""
    return _e(cell).replace("\x00", "<strong>").replace("\x01", "</strong>")


def _values_table(table: Any) -> str:
    lead = table._leaders()
    heads = "".join(f"<th>{_e(h)}</th>" for h in table._headers())
    out = [f"<p class=note>{_e(table._seeds_line())}</p>",
           f"<table><thead><tr><th>metric</th><th>run</th><th>n</th><th>rounds</th>{heads}</tr></thead>"]
    by_metric: dict[str, list[Any]] = {}
    for r in table.rows:
        by_metric.setdefault(r.metric, []).append(r)
    for metric, rows in by_metric.items():
        out.append("<tbody>")
        for i, r in enumerate(rows):
            first = (f'<td rowspan="{len(rows)}">{_e(_metric_label(metric, r.higher_is_better))}</td>'
                     if i == 0 else "")
            cells = "".join(f"<td class=num>{_bold(c)}</td>" for c in table._cells(r, lead, ("\x00", "\x01")))
            out.append(f"<tr>{first}<td>{_e(r.group)}</td><td class=num>{r.n_runs}</td>"
                       f"<td class=num>{_e(table._rounds_text(r.rounds))}</td>{cells}</tr>")
        out.append("</tbody>")
    return "\n".join(out + ["</table>"])


_VERDICT_CLASS = {"better": "better", "worse": "worse"}


def _comparisons_table(table: Any) -> str:
    """The paired comparisons, a ``<tbody>`` per metric; the baseline and the selection are columns only where
    the rows differ in them (else the title and the note say them)."""
    if not table.comparisons:
        return ""
    rows = table.comparisons
    bases = list(dict.fromkeys(c.baseline for c in rows))
    many_sel = len({c.selection for c in rows}) > 1
    title = f"Compared with the baseline {bases[0]}" if len(bases) == 1 else "Compared with the baselines"
    heads = ["metric", "run", *(["baseline"] if len(bases) > 1 else []), *(["selection"] if many_sel else []),
             "n", "Δ", f"{CONFIDENCE:.0%} CI", "verdict", "Wilcoxon p"]
    out = [f"<h3>{_e(title)}</h3>", f"<p class=note>{_e(table.comparison_note(selection_column=many_sel))}</p>",
           "<table><thead><tr>" + "".join(f"<th>{h}</th>" for h in heads) + "</tr></thead>"]
    by_metric: dict[str, list[Any]] = {}
    for c in rows:
        by_metric.setdefault(c.metric, []).append(c)
    for metric, cs in by_metric.items():
        out.append("<tbody>")
        for i, c in enumerate(cs):
            delta, ci, verdict = table._comparison_cells(c)
            cells = [f'<td rowspan="{len(cs)}">{_e(_metric_label(metric, c.higher_is_better))}</td>'] if i == 0 else []
            cells += [f"<td>{_e(c.group)}</td>"] + ([f"<td>{_e(c.baseline)}</td>"] if len(bases) > 1 else [])
            cells += [f"<td>{_e(c.selection)}</td>"] if many_sel else []
            cells += [f"<td class=num>{c.stats.n}</td>", f"<td class=num>{_e(delta)}</td>",
                      f"<td class=num>{_e(ci)}</td>", f"<td class={_VERDICT_CLASS.get(verdict, 'noise')}>{_e(verdict)}</td>",
                      f"<td class=num>{_e(table._wilcoxon_cell(c))}</td>"]
            out.append("<tr>" + "".join(cells) + "</tr>")
        out.append("</tbody>")
    return "\n".join(out + ["</table>"])


def _groups_list(table: Any) -> str:
    items = []
    for g, text in zip(table.groups, table.group_lines()):
        dirs = ", ".join(f"<code>{_e(d)}</code>" for d in g.run_dirs)
        items.append(f"<li><strong>{_e(g.label)}</strong>{_e(text[len(g.label):])} — {dirs}</li>")
    return (f"<h3>Groups</h3><p class=note>{_e(table.grouping_note())}</p><ul>" + "".join(items) + "</ul>")


# -- pictures -----------------------------------------------------------------------------------------------


def _heatmaps(section: Any) -> str:
    """One heat map per distinct ``partition.json`` among the section's runs, captioned with the groups that
    share it; unreadable or malformed files are named, not drawn."""
    from .partition import partition_heatmap_png, read_partition

    seen: dict[str, tuple[dict[str, Any], list[str]]] = {}
    bad: list[str] = []
    for g, runs in zip(section.table.groups, section.members):
        for r in runs:
            try:
                doc = read_partition(r.path)
            except (OSError, ValueError) as exc:
                bad.append(f"{r.path}: {exc}")
                continue
            if doc is None or not isinstance(doc.get("client_label_counts"), list):
                continue
            drawn = [doc.get(k) for k in ("client_label_counts", "class_names", "partition_key")]
            key = hashlib.sha1(json.dumps(drawn, default=str).encode()).hexdigest()  # what the heat map shows
            labels = seen.setdefault(key, (doc, []))[1]
            if g.label not in labels:
                labels.append(g.label)
    if not seen and not bad:
        return ""
    figures = []
    for i, (doc, labels) in enumerate(seen.values()):
        if i == MAX_HEATMAPS:
            figures.append(f"<p class=note>{len(seen) - MAX_HEATMAPS} more distinct partitions not drawn "
                           f"(at most {MAX_HEATMAPS} a section).</p>")
            break
        try:
            counts = np.asarray(doc["client_label_counts"], dtype=np.int64)
            names = doc.get("class_names")
            png = partition_heatmap_png(counts, names if isinstance(names, list) else None,
                                        key=str(doc.get("partition_key", "class")))
        except (ValueError, TypeError, OverflowError) as exc:  # a damaged partition.json: e.g. 2**70 in int64
            bad.append(f"partition of {', '.join(labels)}: {exc}")
            continue
        figures.append(_figure(png, f"Partition of {', '.join(labels)}", "heat"))
    if bad:
        figures.append("<ul class=left>" + "".join(f"<li>not drawn: {_e(b)}</li>" for b in bad) + "</ul>")
    n = len(seen)
    return (f"<details><summary>Partition heat maps ({n} distinct partition{'s' if n != 1 else ''}: clients × "
            "classes or domains, from each run's partition.json)</summary>" + "".join(figures) + "</details>")


def _run_pngs(run: _Run) -> list[Path]:
    """The PNG files under ``RUN_DIR/plots``: the task's pictures first (top-level ones, then sub-folders'),
    the run's own ``curves.png`` last (the section's curves already compare its group), each by name."""
    plots = run.path / "plots"
    if not plots.is_dir() or plots.is_symlink():
        return []
    found = []
    for root, dirs, files in os.walk(plots):
        dirs.sort()
        depth = len(Path(root).relative_to(plots).parts)
        found += [(depth, Path(root) / f) for f in sorted(files) if f.lower().endswith(".png")]
    return [p for _, p in sorted(found, key=lambda t: (t[1] == plots / "curves.png", t[0]))]


class _Budget:
    """Which run pictures a report inlines: at most ``MAX_IMAGES_PER_RUN`` a run, then, over every run of the
    report, the task pictures before the runs' own curves, each of at most ``MAX_IMAGE_BYTES``, until
    ``MAX_RUN_IMAGE_BYTES`` are spent (so that a folder of many runs keeps the visuals of its last sections);
    ``why`` says why each other picture is only listed."""

    def __init__(self, runs: Sequence[_Run]) -> None:
        self.pictures = {id(r): _run_pngs(r) for r in runs}
        self.why: dict[Path, str] = {}
        ranked: list[tuple[bool, int, Path, int]] = []
        for r in runs:
            for i, p in enumerate(self.pictures[id(r)]):
                size = _png_size(p)
                if i >= MAX_IMAGES_PER_RUN:
                    self.why[p] = f"more than {MAX_IMAGES_PER_RUN} pictures in this run"
                elif size is None:
                    self.why[p] = f"not a readable PNG under {MAX_IMAGE_BYTES >> 20} MiB"
                else:
                    ranked.append((p.name == "curves.png" and p.parent.name == "plots", len(ranked), p, size))
        left = MAX_RUN_IMAGE_BYTES
        for _, _, p, size in sorted(ranked, key=lambda t: t[:2]):
            if size > left:
                self.why[p] = f"the report's {MAX_RUN_IMAGE_BYTES >> 20} MiB of run pictures are spent"
            left -= 0 if p in self.why else size


def _png_size(path: Path) -> int | None:
    """The size of the regular file at ``path`` when it is at most ``MAX_IMAGE_BYTES``, else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) and st.st_size <= MAX_IMAGE_BYTES else None


def _run_pictures(run: _Run, budget: _Budget) -> str:
    figures, skipped = [], []
    for p in budget.pictures[id(run)]:
        rel = p.relative_to(run.path).as_posix()
        data = None if p in budget.why else _read_png(p, MAX_IMAGE_BYTES)
        if data is None:
            skipped.append(f"{rel} ({budget.why.get(p, 'not a readable PNG')})")
        else:
            figures.append(_figure(data, rel))
    out = f"<div class=pics>{''.join(figures)}</div>" if figures else ""
    if skipped:
        out += "<ul class=left>" + "".join(f"<li>not inlined: {_e(s)}</li>" for s in skipped) + "</ul>"
    return out or "<p class=note>This run wrote no pictures under plots/.</p>"


def _visuals(section: Any, budget: _Budget) -> str:
    """Per group a collapsed ``<details>``, per run in it another, with the run's pictures."""
    out = []
    for g, runs in zip(section.table.groups, section.members):
        inner = "".join(f"<details><summary>{_e(r.path)}</summary>{_run_pictures(r, budget)}</details>"
                        for r in runs)
        out.append(f"<details><summary>{_e(g.label)} ({len(runs)} run{'s' if len(runs) != 1 else ''})</summary>"
                   f"{inner}</details>")
    return "<h3>Each run's pictures (plots/: curves and task visuals)</h3>" + "".join(out)


# -- the page ----------------------------------------------------------------------------------------------


def _section(s: Any, out: Path, budget: _Budget, heading: str) -> str:
    parts = [heading, _values_table(s.table)]
    if s.note:
        parts.append(f"<p class=note>{_e(s.note)}</p>")
    parts += [_comparisons_table(s.table), _groups_list(s.table), "<h3>Curves</h3>"]
    curves = _read_png(out / s.curves, 64 << 20)
    parts.append(_img(curves, f"comparison curves of {s.title}") if curves is not None
                 else f"<p class=note>{_e(s.curves)} could not be read.</p>")
    if s.targets:
        from .cost_target import targets_html

        parts += ["<h3>Cost to target</h3>", targets_html(s.targets)]
    if s.cost_curves:
        cost = _read_png(out / s.cost_curves, 64 << 20)
        parts += ["<h3>Metric against cost</h3>", _img(cost, f"metric against cost, {s.title}") if cost is not None
                  else f"<p class=note>{_e(s.cost_curves)} could not be read.</p>"]
    parts += [_heatmaps(s), _visuals(s, budget)]
    return "\n".join(p for p in parts if p)


def _provenance(runs: Sequence[_Run]) -> str:
    items = []
    for label, values in provenance_values(runs):
        if len(values) == 1:
            items.append(f"<li>{_e(label)}: <code>{_e(values[0][0])}</code></li>")
        else:
            sub = "".join(f"<li><code>{_e(v)}</code> ({n} run{'s' if n != 1 else ''})</li>" for v, n in values)
            items.append(f"<li>{_e(label)}:<ul>{sub}</ul></li>")
    return (f"<h2 id=provenance>Provenance</h2><p class=note>From the run.json of the {len(runs)} runs (every "
            "session of each).</p><ul>" + "".join(items) + "</ul>")


def report_html(rep: Any, out: Path) -> str:
    """The page of ``rep``, whose curves are already written into ``out``."""
    budget = _Budget([r for s in rep.sections for r in s.runs])
    body = ["<h1>FedSight comparison</h1>"]
    one = len(rep.sections) == 1 and not rep.left_out
    if not one:
        body.append(f"<p class=meta>{len(rep.runs)} runs in {len(rep.sections)} sections, one per task (and "
                    "dataset where the metrics differ); each compares only its own runs on the metrics they log, "
                    "with its own baseline.</p>")
    nav = [f'<li><a href="#s-{_e(s.slug)}">{_e(s.title)}</a>: {_count(len(s.table.groups), "group")}, '
           f'{_count(len(s.runs), "run")}</li>'
           for s in rep.sections]
    if rep.left_out:
        nav.append(f"<li>not shown (they log none of the asked metrics): {_e(', '.join(rep.left_out))}</li>")
    body.append("<nav><ul>" + "".join(nav) + '<li><a href="#provenance">Provenance</a></li></ul></nav>')
    for s in rep.sections:
        body.append(f'<section id="s-{_e(s.slug)}">'
                    + _section(s, out, budget, f"<h2>{_e(s.title)}</h2>") + "</section>")
    body.append(_provenance(rep.runs))
    title = "FedSight comparison" + ("" if one else f" ({len(rep.sections)} sections)")
    return ("<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
            '<meta name=viewport content="width=device-width, initial-scale=1">'
            f'<link rel=icon href="data:,"><title>{_e(title)}</title><style>{_CSS}</style></head>\n<body>\n'
            + "\n".join(body) + "\n</body></html>\n")
