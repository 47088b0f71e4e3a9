"""Plots, summaries and cross-run comparison tables for FedSight run directories.

A run directory is written by an engine (format and readers: ``fedsight.runs``) and read here::

    RUN_DIR/config.json     resolved config; top-level "seed" and "run" ({"name": ..., ...}) plus the
                            experiment (task, data, partition, model, train, server, recipe, eval, ...)
    RUN_DIR/run.json        every metric's direction ({"test/acc": true, "test/loss": false,
                            "cost/*": false, "clients/*": null, ...}) and the primary metric
    RUN_DIR/metrics.jsonl   one JSON object per line with "round" (1-based) and "stage", plus float
                            metrics such as "train/loss", "test/acc", "local/worst10", "time/round_s";
                            evaluation keys appear only on rounds where evaluation ran; lines with an
                            "event" key are log events, not metrics
    RUN_DIR/plots/          written here (``plot_run``, ``plot_client_weights``)
    RUN_DIR/summary.md      written here (``write_summary``)

Conventions used throughout:

- ``round`` counts globally across stages. If a round appears more than once for a metric (a resumed
  run that re-logged rounds after its last checkpoint), the last line wins.
- Whether higher or lower values of a metric are better comes from the run's ``run.json``: an exact key
  wins over a ``prefix/*`` family, a longer family over a shorter one (``fedsight.metrics.direction``);
  a key it does not list, or lists as null, has no direction. A run written before ``run.json`` existed
  gets the table its config would record. Runs compared together that disagree on a metric's
  direction leave it without one. The default comparison puts the runs' primary metric first.
- "final" is the value at the last round where the metric was logged in that run; "best" is the max
  (or min, for lower-is-better metrics) over all logged rounds, and absent for a metric with no
  direction, which is never bold in a comparison either, and for a budget metric (bytes, FLOPs, seconds,
  privacy epsilon: ``fedsight.metric_table.is_budget``), whose "best" would be its first round.
- A comparison picks one value per run by a selection protocol (``selection``): final (default), best (the
  best round, selected on the split it is measured on: "selected on the test set" for test metrics) or
  last:N (the mean of the last N evaluations). Every group but the baseline (default the first; a sweep
  variant's name compares at each grid point) is compared with it on every metric with a direction: the
  per-seed paired differences, their mean, 95% Student-t CI and a verdict (``paired``).
- Runs whose configs are equal apart from top-level "seed", "run" and "engine" and whose seeds differ form one
  group of replicates (several seeds of one experiment); tables show mean ± sample std (ddof=1) over the runs
  of a group. Runs of one config that share a seed (the same run in-process and on Flower, or run twice) are
  not replicates: they are rows of their own, labelled with their backend (``run.json``) or directory.
- A sweep's grid point is the ``[...]`` at the end of a run name (``fedavg[alpha=0.1]``); the best final value
  of a metric is bold among the rows of one grid point (rows without one form one set).
- Plots give every curve of a panel its own (colour, line style, marker) (``plots.line_style``), and axes
  never show matplotlib's offset text: a power-of-ten multiplier goes into the axis label.

- A report (``report``) splits the runs into sections, one per task (and dataset where the datasets log
  different metrics: ``sections``), each with its own table, comparisons and curves, and writes ``report.md``,
  ``report.html`` (one self-contained page: ``html``) and a curves PNG per section (``document``).

Modules: ``runs_view`` (loading runs, series, directions, grouping), ``fmt`` (formatting), ``units`` (metric
units, numbers in human units: 2.50 GB, 18.9 GFLOP), ``plots`` (curves), ``run_panels`` (which panels one run's
curves have), ``summary`` (``summary.md``), ``compare`` (comparison tables), ``sections`` and ``document``
(reports), ``html`` (``report.html``), ``selection`` (the protocols), ``paired`` (paired differences and their
confidence intervals), ``export`` (every metric as CSV), ``client_weights`` and ``partition`` (who was trusted,
and the data each client holds).
"""

from __future__ import annotations

from ..runs import read_config, read_metrics
from .client_weights import client_weight_matrix, plot_client_weights
from .compare import ComparisonRow, ComparisonTable, PairedComparison, compare, plot_comparison, provenance
from .document import report
from .export import write_csv
from .paired import PairedDifference, paired_difference
from .partition import plot_partition_heatmap, read_partition
from .plots import mean_curve, plot_run
from .runs_view import RunGroup, group_runs
from .selection import Selection
from .summary import write_summary

__all__ = [
    "ComparisonRow",
    "ComparisonTable",
    "PairedComparison",
    "PairedDifference",
    "RunGroup",
    "Selection",
    "client_weight_matrix",
    "compare",
    "group_runs",
    "mean_curve",
    "paired_difference",
    "plot_client_weights",
    "plot_comparison",
    "plot_partition_heatmap",
    "plot_run",
    "provenance",
    "read_config",
    "read_metrics",
    "read_partition",
    "report",
    "write_csv",
    "write_summary",
]
