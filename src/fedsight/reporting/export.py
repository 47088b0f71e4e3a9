"""Every metric of every run and round as one CSV file (``write_csv``, ``fedsight report --csv FILE``)."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from pathlib import Path

from ..runs import METRICS_FILE
from ..safe_write import atomic_write_text
from .runs_view import StrPath, _display_order, _group, _load_all

#: the columns before the metrics, in this order
ID_COLUMNS = ("run_dir", "run_name", "group", "seed", "backend", "round", "stage")


def _cell(value: float | None) -> str:
    """A metric value as written: blank when not logged, else the shortest text that reads back to the
    same float (``repr``; NaN as ``nan``, infinities as ``inf``/``-inf``)."""
    return "" if value is None else repr(value)


def write_csv(run_dirs: Iterable[StrPath], path: StrPath) -> Path:
    """Write every metric the given runs logged to the CSV file ``path`` (wide format); return its path.

    One row per (run, round) that has a metrics line: runs in the order given, rounds ascending.
    Columns, with a header row:

    - ``run_dir`` (as given), ``run_name`` (``run.name`` of its config), ``group`` (its row label in the
      report: ``group_runs``), ``seed`` (blank if the config has none), ``backend`` (where the clients
      trained, from ``run.json``; blank if not recorded), ``round`` (1-based, global across stages),
      ``stage`` (of the round's last metrics line);
    - then one column per metric key logged by any of the runs: every numeric key of ``metrics.jsonl``,
      per-class families (``test/iou/road``) included, evaluation metrics first as in the report, then
      training, time and the rest. A cell is blank where that run did not log that key in that round
      (evaluation every k rounds, metrics of another task).

    Values are written so that they read back as the same floats (``repr``). Event lines are skipped; a
    round logged twice (a resumed run) keeps the last value of each key, as the report does. For the long
    format (one row per run, round and metric) melt the file, e.g. with pandas:
    ``pd.read_csv(path).melt(id_vars=list(ID_COLUMNS), var_name="metric").dropna(subset=["value"])``.
    A metric key equal to one of ``ID_COLUMNS`` is a ``ValueError`` naming the run's ``metrics.jsonl``; a
    file that cannot be written (a folder in the way) one naming ``path``. The file is replaced atomically.
    """
    runs = _load_all(run_dirs)
    label = {id(r): g.label for g, members in _group(runs) for r in members}
    order: dict[str, None] = {}
    for r in runs:
        for k in r.series:
            if k in ID_COLUMNS:
                raise ValueError(f"{r.path / METRICS_FILE}: metric {k!r} has the name of a CSV column "
                                 f"({', '.join(ID_COLUMNS)})")
            order.setdefault(k)
    keys = _display_order(order)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([*ID_COLUMNS, *keys])
    for r in runs:
        stage_of: dict[int, str] = {}
        for rec in r.metric_records:
            stage_of[int(rec["round"])] = str(rec.get("stage", ""))
        values: dict[int, dict[str, float]] = {rnd: {} for rnd in stage_of}
        for k, s in r.series.items():
            for rnd, v in zip(s.rounds.tolist(), s.values.tolist()):
                values[rnd][k] = v
        ident = [str(r.path), r.name, label[id(r)], "" if r.seed is None else str(r.seed), r.backend or ""]
        for rnd in sorted(values):
            writer.writerow([*ident, rnd, stage_of[rnd], *(_cell(values[rnd].get(k)) for k in keys)])
    out = Path(path)
    try:
        atomic_write_text(out, buf.getvalue())
    except OSError as exc:  # a folder in the way, no permission, a full disk
        raise ValueError(f"{out}: cannot write the CSV file ({exc.strerror or exc})") from None
    return out
