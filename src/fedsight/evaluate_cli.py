"""``fedsight evaluate``: a run's trained model evaluated again, on its own data or another site's
(``fedsight.crosseval``), and the matrix of models x sites over several runs.

One run and no ``--site``: one evaluation, its metrics printed and appended to ``RUN_DIR/evaluations.jsonl``.
Several runs (a sweep's folder) or any ``--site``: every run's model on every site, the headline metric's table
printed and written to ``--out`` (``crosseval.md``, ``.csv``, ``.json``), each evaluation appended to its run's
``evaluations.jsonl``. Every (run, site) is checked before anything is evaluated, and nothing is written
before every evaluation has succeeded. Wired into the main CLI as ``app.command()(evaluate)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import click
import typer
from rich.markup import escape
from rich.table import Table

#: ``fedsight.crosseval.MODELS``, spelled here so that ``fedsight --help`` imports neither torch nor the config
MODELS = ("last", "best")

SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", help="Override a config value: key.path=value (TOML value). Repeatable."),
]
SiteOpt = Annotated[
    Optional[list[str]],
    typer.Option("--site", help="A site: NAME:KEY=VALUE (data.*, partition.*); repeat for more keys or sites; "
                                "NAME alone: the runs' own data."),
]


def evaluate(
    paths: Annotated[list[Path], typer.Argument(help="Run directories, or folders searched for runs.")],
    set_: SetOpt = None,
    site: SiteOpt = None,
    model: Annotated[str, typer.Option(click_type=click.Choice(MODELS),
                                       help="last: the last checkpoint; best: best.safetensors.")] = "last",
    out: Annotated[Path, typer.Option(help="Folder of the models x sites matrix.")] = Path("crosseval"),
    force: Annotated[bool, typer.Option(help="Replace an existing matrix in --out.")] = False,
) -> None:
    """Evaluate trained models again, nothing trained: on their own data, on another site's data, or as a
    models x sites matrix.

    --set may change evaluation settings (e.g. recipe.sharing.test_stats=domain) and the data: data.*,
    partition.*, validation.* evaluate on another dataset's or partition's clients, refused when its inputs or
    classes differ from the model's. One run: its metrics, appended to RUN_DIR/evaluations.jsonl.
    Several runs or --site: a models x sites matrix of the primary metric in --out (crosseval.md, .csv, .json),
    each evaluation appended to its run's evaluations.jsonl. See docs/evaluation.md."""
    from .cli_common import console, fail, find_runs, guard, say
    from .crosseval import MATRIX_FILES, SITE_SECTIONS, Site, append_matrix, cross_evaluate, evaluate_one, \
        parse_sites, write_matrix
    from .errors import ConfigError, OutputPathError
    from .safe_write import check_output_folder

    runs = find_runs(paths)
    try:
        sites = parse_sites(site or [])
    except ConfigError as exc:
        fail(str(exc))
    if len(runs) == 1 and not sites:
        try:
            checked, ev = evaluate_one(runs[0], set_ or [], model)
        except (ConfigError, FileNotFoundError, ValueError) as exc:
            fail(str(exc), 2 if isinstance(exc, (ConfigError, OutputPathError)) else 1)
        what = f" with {', '.join(set_)}" if set_ else ""
        say(f"{runs[0]}: the {model} model, round {ev.round}{what}")
        table = Table()
        table.add_column("metric")
        table.add_column("value", justify="right")
        for k, v in ev.metrics.items():
            if k.count("/") <= 1:  # headline metrics; per-class families are in evaluations.jsonl
                table.add_row(k, f"{v:.4g}")
        console.print(table)
        if not checked.own_clients:
            why = ("the selected model is a global model" if model == "best"
                   else "the site's clients are not the run's")
            say(f"clients: global model only ({why}: no client's personal state is used; docs/evaluation.md)")
        say(f"appended to {runs[0] / 'evaluations.jsonl'}")
        return
    if not sites:  # several runs, one site: what --set makes of each run's data
        named = any(s.split("=", 1)[0].strip().split(".")[0] in SITE_SECTIONS for s in set_ or [])
        sites = [Site("set" if named else "own")]
    guard(check_output_folder, out, "--out", files=MATRIX_FILES, force=force)
    try:
        matrix = cross_evaluate(runs, sites, set_ or [], model)
        written = write_matrix(matrix, out)
        append_matrix(matrix)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        fail(str(exc), 2 if isinstance(exc, (ConfigError, OutputPathError)) else 1)
    say(f"{matrix.headline} of each run's {model} model (rows) on each site (columns):")
    table = Table()
    table.add_column("model \\ site")
    for s in matrix.sites:
        table.add_column(escape(s.name), justify="right")
    for i, label in enumerate(matrix.labels):
        vals = [matrix.value(i, j, matrix.headline) for j in range(len(matrix.sites))]
        table.add_row(escape(label), *["-" if v is None else f"{v:.4g}" for v in vals])
    console.print(table)
    say(f"wrote {', '.join(map(str, written))}; appended each evaluation to its run's evaluations.jsonl")
