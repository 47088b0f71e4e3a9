"""The ``fedsight`` command line: run, resume, report, list, partition, pretrain."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import click
import numpy as np
import typer
from rich.markup import escape
from rich.table import Table

from . import cli_common as term
from .cli_common import DEBUG_ENV, fail, find_runs, guard, progress, say
from .errors import ConfigError, OutputPathError, describe_error
from .help_text import reflow_help
from .run_lines import complete_variants

app = typer.Typer(
    add_completion=True,
    no_args_is_help=True,
    help="FedSight: federated learning for real-world vision tasks under heterogeneity.",
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from . import __version__

        import torch

        term.console.print(f"fedsight {__version__} (torch {torch.__version__}, Python {sys.version.split()[0]})",
                      highlight=False)
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version (and torch's and Python's) and exit.")] = False,
) -> None:
    """FedSight: federated learning for real-world vision tasks under heterogeneity."""


SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", help="Override a config value: key.path=value (TOML value). Repeatable."),
]


def _spec_label(spec: Any, index: int | None = None, count: int = 1) -> str:
    """A sweep member as the progress shows it: ``run k/N`` in a sweep, its run name (the variant and grid point)
    and seed."""
    from .live import run_label

    return run_label(spec.config.run.name, spec.seed, index, count)


def _execute_with_progress(cfg: Any, run_dir: Path, label: str, **kwargs: Any):
    """``api.execute`` with live progress (``fedsight.live``): a bar and a phase line on a terminal; off one
    (nohup, SLURM, a pipe), whole lines, never a bar cut to the width."""
    from .api import execute, progress_keys
    from .live import RunView
    from .runs import RunDir

    done = int(RunDir(run_dir).read_status().get("round", 0)) if RunDir(run_dir).exists() else 0
    with progress() if term.console.is_terminal else contextlib.nullcontext() as shown:
        view = RunView(shown, say, label, cfg.server.rounds, progress_keys(cfg), done=done)
        out = execute(cfg, run_dir, on_round=view.round, on_phase=view.phase, **kwargs)
        view.finish(out.status)
        return out


NprocOpt = Annotated[int, typer.Option(min=1, help="Split each round's clients over this many processes (ranks) "
                                                "on this machine.")]
DistBackendOpt = Annotated[Optional[str], typer.Option(help='The ranks\' process group: "gloo" (default) or "nccl".')]


@app.command()
def run(
    config: Annotated[Path, typer.Argument(help="TOML config file; it may define a sweep (seeds, grid, variants).")],
    set_: SetOpt = None,
    overwrite: Annotated[bool, typer.Option(help="Replace existing run directories of a different config.")] = False,
    stop_after: Annotated[Optional[int], typer.Option(min=1, help="Stop after this round (resume later).")] = None,
    variant: Annotated[Optional[list[str]], typer.Option(
        help="Run only this variant of the config (repeatable; a shell-style pattern such as 'fedavg_dct_*' picks "
             "every variant it matches).", autocompletion=complete_variants)] = None,
    jobs: Annotated[int, typer.Option(min=1, help="Run this many of the sweep's runs at once, each in its own process "
                                               "with its engine.threads (auto: 1).")] = 1,
    smoke: Annotated[bool, typer.Option(help="A smoke test of every variant: first seed, at most 2 rounds a stage, 2 local "
                                             "steps a round, one evaluation, into OUTPUT_DIR/smoke.")] = False,
    device: Annotated[Optional[str], typer.Option(help='Run on this device ("cpu", "cuda", "cuda:N"; default: the '
                                                       "config's engine.device).")] = None,
    nproc: NprocOpt = 1,
    dist_backend: DistBackendOpt = None,
) -> None:
    """Run a config: every variant x grid point x seed, each into its own run directory, then a comparison table.

    Re-running the same config resumes unfinished runs and skips finished ones. --set reaches every variant,
    grid point, seed and stage (stages.NAME.key=value sets one stage's key); an override that cannot reach every
    run (a key the grid varies, seed next to sweep.seeds, a key a stage sets itself, server.rounds of a staged
    run) is an error saying what to write instead.
    """
    from . import sweep as S
    from .distributed.launch import dispatch
    from .reporting import report
    from .run_lines import again_command, device_override, interrupted_lines

    if smoke and stop_after is not None:
        fail("--smoke with --stop-after: a smoke run is already at most 2 rounds a stage; pass one of them")
    again = again_command(config, set_ or [], variant or [], device)
    specs: list[Any] = []
    try:
        sets = [*(set_ or []), *([device_override(device)] if device is not None else [])]
        specs = S.load(config, sets, variant or [], smoke=smoke)
        if (code := dispatch(nproc, dist_backend, jobs, [s.config for s in specs])) is not None:
            raise typer.Exit(code)  # the ranks' exit code (--nproc), or a worker rank's end (docs/distributed.md)
        dirs = _run_specs(config, sets, variant or [], specs, jobs, overwrite, stop_after, smoke)
    except ConfigError as exc:
        fail(str(exc))
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (main): which run stopped where, and how to go on
        for line in interrupted_lines([s.run_dir for s in specs], again, device):
            say(line)
        raise typer.Exit(130) from None
    if stop_after is not None:
        say(f"stopped after round {stop_after}; continue with: {again}")
        return
    group = Path(os.path.commonpath([d.parent for d in dirs]))  # the sweep's folder
    rep = report(dirs, group)
    rep.print(term.console)
    say(f"runs: {', '.join(str(d) for d in dirs)}")
    costs = [str(group / s.cost_curves) for s in rep.sections if s.cost_curves]
    say(f"report: {group / 'report.md'}  {group / 'report.html'}  curves: "
         + ", ".join(str(group / s.curves) for s in rep.sections) + (f"  cost: {', '.join(costs)}" if costs else ""))


def _run_specs(config: Path, sets: list[str], variants: list[str], specs: list[Any], jobs: int, overwrite: bool,
               stop_after: int | None, smoke: bool) -> list[Path]:
    """``fedsight run``'s runs, one after the other with a progress bar each, or ``--jobs`` at once; first, with
    ``[sweep] share_stages``, the stages runs share (``fedsight.shared_stages``), one run at a time."""
    from .shared_stages import share

    def shared(i: int, r: int) -> Any:
        label = f"{_spec_label(specs[i], i, len(specs))} (stages shared up to round {r})"
        return _execute_with_progress(specs[i].config, specs[i].run_dir, label, stop_after=r)

    share(specs, shared, say, overwrite=overwrite, stop_after=stop_after)
    if jobs > 1 and len(specs) > 1:
        return _run_jobs(config, sets, variants, specs, jobs, overwrite, stop_after, smoke)
    dirs = []
    for i, spec in enumerate(specs):
        label = _spec_label(spec, i, len(specs))
        try:
            out = _execute_with_progress(spec.config, spec.run_dir, label, overwrite=overwrite, stop_after=stop_after)
        except (ConfigError, FileNotFoundError, ValueError) as exc:
            fail(str(exc), 2 if isinstance(exc, (ConfigError, OutputPathError)) else 1)
        if out.status == "skipped":
            say(f"{label}: already complete in {out.run_dir}")
        dirs.append(out.run_dir)
    return dirs


def _run_jobs(config: Path, sets: list[str], variants: list[str], specs: list[Any], jobs: int, overwrite: bool,
              stop_after: int | None, smoke: bool) -> list[Path]:
    """``run --jobs``: the sweep's runs in ``jobs`` processes (``fedsight.parallel``), with a bar per run (or,
    off a terminal, a line per round); the run directories, or exit 1 naming every run that failed. Runs already
    complete are skipped here, as a serial sweep skips them, before any worker starts (a worker takes seconds to
    start; none starts when the whole sweep is complete)."""
    from .api import is_complete, progress_keys
    from .live import RunView
    from .parallel import run_parallel

    labels = [_spec_label(s, i, len(specs)) for i, s in enumerate(specs)]
    done = [] if overwrite else [i for i, s in enumerate(specs) if is_complete(s.config, s.run_dir)]
    results = [(i, _execute_with_progress(specs[i].config, specs[i].run_dir, labels[i]).status, None) for i in done]
    members = [i for i in range(len(specs)) if i not in done]
    keys, start = progress_keys(specs[0].config), time.monotonic()
    with progress() if term.console.is_terminal else contextlib.nullcontext() as shown:
        views = {i: RunView(shown, say, labels[i], specs[i].config.server.rounds, keys, start=start,
                            phase="waiting for a worker" if shown is not None else "") for i in members}

        def on_message(msg: Any) -> None:
            kind, i, r, row = msg
            if kind == "phase":
                views[i].phase(str(row["phase"]))
            else:
                views[i].round(r, row)

        ran = run_parallel(config, sets, variants, members, jobs, overwrite=overwrite, stop_after=stop_after,
                           smoke=smoke, on_message=on_message) if members else []
        for i, status, _ in ran:
            views[i].finish(status)
    results = sorted(results + ran)
    failed = [(labels[i], err) for i, status, err in results if status == "failed"]
    for i, status, _ in results:
        if status == "skipped":
            say(f"{labels[i]}: already complete in {specs[i].run_dir}")
    if any(status == "interrupted" for _, status, _ in results):
        raise KeyboardInterrupt
    if failed:
        fail("; ".join(f"{label}: {err}" for label, err in failed), 1)
    return [s.run_dir for s in specs]


@app.command()
def resume(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by `fedsight run`.")],
    stop_after: Annotated[Optional[int], typer.Option(min=1, help="Stop after this round.")] = None,
    device: Annotated[Optional[str], typer.Option(help='Continue on this device ("cpu", "cuda", "cuda:N"; default: the run\'s engine.device).')] = None,
    nproc: NprocOpt = 1,
    dist_backend: DistBackendOpt = None,
) -> None:
    """Continue an interrupted run from its last checkpoint; the result equals an uninterrupted run (on
    another device: to float tolerance)."""
    from .api import load_run_config
    from .distributed.launch import dispatch
    from .reporting import write_summary
    from .run_lines import finished, interrupted_lines, resume_command

    try:
        cfg = load_run_config(run_dir, {"device": device} if device is not None else None)
        if (code := dispatch(nproc, dist_backend, 1, [cfg])) is not None:
            raise typer.Exit(code)
        out = _execute_with_progress(cfg, run_dir, f"{cfg.run.name} seed {cfg.seed}", resume=True, stop_after=stop_after)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        fail(str(exc), 2 if isinstance(exc, OutputPathError) else 1)
    except KeyboardInterrupt:
        for line in interrupted_lines([run_dir], None, device):
            say(line)
        raise typer.Exit(130) from None
    if out.status == "skipped":
        say(f"{run_dir} is already complete")
        write_summary(run_dir)
    if out.status in ("complete", "skipped"):  # as `fedsight run` ends: the table, then where the files are
        table, lines = finished(out.run_dir)
        term.console.print(table.to_rich())
        for line in lines:
            say(line)
    else:
        say(f"stopped at round {out.last_row['round'] if out.last_row else 0}; continue with: "
             f"{resume_command(run_dir, device)}")


from .evaluate_cli import evaluate  # noqa: E402  (a run's model again: its own data, other sites, a matrix)

app.command()(evaluate)


@app.command()
def report(
    paths: Annotated[list[Path], typer.Argument(help="Run directories, or folders searched for runs.")],
    out: Annotated[Path, typer.Option(help="Where report.md, report.html and the curves go.")] = Path("report"),
    metric: Annotated[Optional[list[str]], typer.Option(help="Metrics to tabulate (default: all eval metrics).")] = None,
    csv: Annotated[Optional[Path], typer.Option(help="Also write every metric of every run and round to this CSV "
                                                     "file (one row per run and round).")] = None,
    baseline: Annotated[Optional[str], typer.Option(help="The group every other is compared with: a row's run name, "
                                                         "or a sweep variant's name (compared at each grid point). "
                                                         "Default: each section's first.")] = None,
    select: Annotated[str, typer.Option(help="Which evaluation stands for a run: final (its last), best (its best "
                                             "round, selected on the test set for test metrics) or last:N (the "
                                             "mean of its last N).")] = "final",
    target: Annotated[Optional[list[str]], typer.Option(help="Tabulate rounds, bytes and FLOPs to first reach "
                                                         "VALUE (primary metric) or METRIC=VALUE.")] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing report file or --csv file (not needed "
                                             "for the unchanged files of an earlier report into the same --out)."
                                        )] = False,
) -> None:
    """Compare runs, a section per task: overlaid curves, a table of final/best values, mean +- std over runs that
    differ only by seed (the best per metric in bold within each grid point), and every run against the baseline:
    the per-seed paired difference of each metric with a direction, its mean, 95% CI (Student t), n and a verdict
    (better, worse, within noise). Writes report.md, report.html (one self-contained page, with the partitions and
    the runs' pictures), the curves and the metric against cumulative bytes and client FLOPs into --out."""
    from .reporting import write_csv
    from .reporting.document import plan_report, write_report
    from .reporting.outputs import RECORD, Outputs
    from .safe_write import check_output, check_output_folder

    runs = find_runs(paths)
    guard(check_output_folder, out, "--out", force=force)
    try:
        rep = plan_report(runs, metric or None, baseline=baseline, select=select, targets=target)
    except ConfigError as exc:  # a bad --baseline, --select or --target: nothing written
        fail(str(exc))
    except (FileNotFoundError, ValueError) as exc:
        fail(str(exc), 1)
    before = Outputs(out)  # what an earlier report into `out` wrote, unchanged, it replaces without --force
    for name in rep.files:
        guard(check_output, out / name, force=force, exists_ok=before.ours(out / name))
    guard(check_output, out / RECORD, exists_ok=True)
    if csv is not None:
        guard(check_output, csv, "--csv", force=force, exists_ok=before.ours(csv))
    try:
        written = write_report(rep, out)
        if csv is not None:
            write_csv(runs, csv)
        before.remove_stale(written)
        before.record([*written, *([csv] if csv is not None else [])])
    except (FileNotFoundError, ValueError) as exc:
        fail(str(exc), 1)
    rep.print(term.console)
    say(f"wrote {', '.join(str(p) for p in written)}" + (f" and {csv}" if csv is not None else ""))



@app.command("list")
def list_(
    kind: Annotated[Optional[str], typer.Argument(help="Only this kind, as its heading or singular (models, datasets, optimizers, component).")] = None,
) -> None:
    """List registered tasks, datasets, models, partitioners and recipe parts with their parameters."""
    from .listing import registry_tables

    try:
        tables = registry_tables(kind)
    except ValueError as exc:
        fail(str(exc))
    for table in tables:
        term.console.print(table)


@app.command()
def partition(
    config: Annotated[Path, typer.Argument(help="TOML config (its data, validation and partition sections are used).")],
    set_: SetOpt = None,
    out: Annotated[Optional[Path], typer.Option(help="Heatmap PNG path (default: the sweep's folder: partition.png, "
                                                     "or partition-POINT.png per distinct partition).")] = None,
    variant: Annotated[Optional[list[str]], typer.Option(
        help="Only this variant of the config (repeatable; a shell-style pattern picks every variant it matches).")] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing --out file.")] = False,
) -> None:
    """Show how a config partitions its data: per-client statistics and a clients x classes heatmap.

    A sweep shows every distinct partition of its variants and grid points (of its first seed), each with its
    own heatmap in the sweep's folder, named by the point (partition-alpha=0.1.png); points with the same data
    and partition (the variants of a grid point) share one.
    """
    import json

    from . import sweep as S
    from .api import build_task
    from .safe_write import check_output

    if out is not None:
        guard(check_output, out, "--out", force=force)

    try:
        specs = S.load(config, set_ or [], variant or [])
    except ConfigError as exc:
        fail(str(exc))
    specs = [s for s in specs if s.seed == specs[0].seed]
    group = Path(os.path.commonpath([s.run_dir.parent for s in specs]))  # the sweep's folder
    points: dict[str, list[Any]] = {}  # the sections that decide a task's partition -> the points sharing it
    for spec in specs:
        dump = spec.config.model_dump(mode="json")
        key = json.dumps({k: dump.get(k) for k in ("seed", "data", "partition", "task", "validation", "pretrain")},
                         sort_keys=True)
        points.setdefault(key, []).append(spec)
    paths, shown = [], []
    for same in points.values():
        wheres = [s.run_dir.parent.relative_to(group) for s in same]
        slug, point = _shared_point(wheres, len(points))
        if any(path.name == f"partition-{slug}.png" for path in paths):  # two partitions, one name: the full one
            slug = "-".join(wheres[0].parts)
        shown.append(point)
        if len(points) == 1:
            path = out or group / "partition.png"
        else:  # the sweep's folder, where every variant sharing it finds it
            path = out.with_name(f"{out.stem}-{slug}{out.suffix}") if out else group / f"partition-{slug}.png"
        for target in (path, path.with_name(path.stem + "_classes.png")):  # all checked before anything is written
            guard(check_output, target, "--out" if target == out else "", force=force, exists_ok=out is None)
        paths.append(path)
    for same, path, point in zip(points.values(), paths, shown):
        spec = same[0]
        names = [str(s.run_dir.parent.relative_to(group)) for s in same if s.run_dir.parent != group]
        if names:
            say(f"-- {', '.join(names)} (seed {spec.seed})")
        try:
            task = build_task(spec.config)  # the same data, validation carve-out and partition a run uses
        except (ConfigError, FileNotFoundError, ValueError) as exc:
            fail(str(exc), 2 if isinstance(exc, ConfigError) else 1)
        _show_partition(spec.config, task, path, point)


def _shared_point(wheres: list[Path], distinct: int) -> tuple[str, str]:
    """A partition shared by the sweep points ``wheres`` (their folders under the sweep's): its file-name slug and
    the words its heatmap's title gives it. The variants of one grid point (``fedavg/alpha=0.1``,
    ``prox/alpha=0.1``) share the grid point: ``alpha=0.1``, "alpha=0.1, shared by fedavg, prox"."""
    parts = [w.parts for w in wheres]
    common: tuple[str, ...] = ()
    while len(common) < min(map(len, parts)) and len({p[len(p) - len(common) - 1:] for p in parts}) == 1:
        common = parts[0][len(parts[0]) - len(common) - 1:]
    if len(parts) > 1 and common:
        heads = ["/".join(p[:len(p) - len(common)]) for p in parts]
        return "-".join(common), f"{'/'.join(common)}, shared by {', '.join(h for h in heads if h)}"
    return "-".join(parts[0]) or "all", ", ".join("/".join(p) for p in parts) if distinct > 1 else ""


def _show_partition(cfg: Any, task: Any, path: Path, point: str = "") -> None:
    """``fedsight partition`` of one config: the clients' table, the summary line, the heat map(s) at ``path``
    (``point``: the sweep points it shows, for the plots' titles)."""
    from .data.partition_stats import partition_summary
    from .reporting import plot_partition_heatmap

    describe = getattr(task, "data_description", None)
    if describe is None:
        fail(f"task {cfg.task.name!r} has no per-client label statistics to show", 1)
    info = describe()
    counts = np.asarray(info["client_label_counts"])
    key = info.get("partition_key", "class")  # what the partition deals out: classes, or (segmentation) domains
    p = cfg.partition
    table = Table(title=escape(f"{p.name} partition of {cfg.data.name}: {p.num_clients} clients, seed {cfg.seed}"))
    for col in ("client", "train", "local test", f"{key}s" if key != "class" else "classes", f"largest {key} share"):
        table.add_column(col, justify="right")
    for k, row in enumerate(counts):
        table.add_row(str(k), str(task.num_train_examples(k)), str(task.num_test_examples(k)), str(int((row > 0).sum())),
                      f"{row.max() / max(row.sum(), 1):.2f}")
    term.console.print(table)
    summary = partition_summary(counts)
    if key != "class":
        summary = {k.replace("classes", f"{key}s").replace("label", key): v for k, v in summary.items()}
    say("  ".join(f"{k}: {v:.3g}" if isinstance(v, float) else f"{k}: {v}" for k, v in summary.items()))
    if info.get("validation"):
        from .reporting.partition import describe_split

        say(f"server validation set: {describe_split(info['validation'])}")
    path.parent.mkdir(parents=True, exist_ok=True)
    title = f"{cfg.data.name} / {p.name}" + (f" ({point})" if point else "")
    plot_partition_heatmap(counts, path, class_names=info.get("class_names"), title=title, key=key)
    say(f"heatmap: {path}")
    if "client_class_pixels" in info:  # segmentation: how the classes' pixels are spread over the clients
        from .tasks.seg_visuals import plot_class_distribution

        dist = path.with_name(path.stem + "_classes.png")
        plot_class_distribution(np.asarray(info["client_class_pixels"]), info["pixel_class_names"], dist,
                                title=f"{title}: class pixel shares of {len(counts)} clients")
        say(f"class distribution: {dist}")


from .pretrain_cli import pretrain_  # noqa: E402  (the server's feature extractor, fedsight.pretrain)

app.command("pretrain")(pretrain_)

from .calibrate_cli import calibrate_  # noqa: E402  (the softmax temperature after Fed3R, fedsight.calibrate)

app.command("calibrate")(calibrate_)

from .start_cli import init, schema  # noqa: E402  (starting configs, the config's JSON Schema)

app.command()(init)
app.command()(schema)

from .flower.cli import flower_app  # noqa: E402  (flwr itself is imported only when a command runs)

app.add_typer(flower_app, name="flower")

from .etlc_cli import etlc_app  # noqa: E402  (encryption-then-lossy-compression of images, PPFL-RDSN)

app.add_typer(etlc_app, name="etlc")

from .weights_cli import weights_app  # noqa: E402  (published checkpoints into FedSight's names)

app.add_typer(weights_app, name="weights")

from .bench_cli import bench  # noqa: E402  (speed and memory of the engines)

app.command()(bench)
reflow_help(app)  # every command's help paragraphs joined (fedsight.help_text)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _interrupted_line(argv: list[str]) -> str:
    """What Ctrl-C on a command other than ``run`` / ``resume`` (which name the round and the resume command)
    says: the command it stopped; a file it writes is written whole or not at all, so running it again is the
    way on (only a training run resumes)."""
    words = [w for w in argv if not w.startswith("-")][:2]
    name = " ".join(["fedsight", *(words[:2] if words[:1] == ["flower"] else words[:1])])
    return f"interrupted: `{name}` stopped before it finished; run it again to finish"


def main() -> None:
    """The ``fedsight`` entry point: every error a command lets through becomes one line on stderr (exit 2
    for configuration errors, 1 otherwise); ``FEDSIGHT_DEBUG=1`` shows the traceback instead. A torchrun rank
    (``--nproc``) ends through ``distributed.world.finish`` (no C++ teardown of its process group)."""
    try:
        _entry()
    except SystemExit as exc:
        from .distributed.world import finish

        finish(exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1))
        raise


def _entry() -> None:
    signal.signal(signal.SIGTERM, _interrupt)  # `kill`, a scheduler's time limit: stop as Ctrl-C does
    try:
        code = app(prog_name="fedsight", standalone_mode=False)  # click's usage errors come here, to be printed as one line
    except click.exceptions.NoArgsIsHelpError:  # `fedsight` alone: the help was shown
        sys.exit(2)
    except click.UsageError as exc:
        where = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx is not None else ""
        msg = exc.format_message()
        head, *hints = msg.split(" Did you mean ")  # typer and click each append the same suggestion
        msg = head + "".join(f" Did you mean {h}" for h in dict.fromkeys(h.strip() for h in hints))
        term.err_console.print(f"[bold red]error:[/] {escape(msg)}{escape(where)}", highlight=False,
                          soft_wrap=True)
        sys.exit(2)
    except (click.Abort, KeyboardInterrupt):  # `run` and `resume` say their own round and resume command first
        term.err_console.print(_interrupted_line(sys.argv[1:]), highlight=False, soft_wrap=True)
        sys.exit(130)
    except Exception as exc:  # the one error boundary: no traceback unless asked for
        if os.environ.get(DEBUG_ENV):
            raise
        term.err_console.print(f"[bold red]error:[/] {escape(describe_error(exc))}", highlight=False, soft_wrap=True)
        term.err_console.print(f"(set {DEBUG_ENV}=1 for the traceback)", style="dim", highlight=False)
        sys.exit(2 if isinstance(exc, ConfigError) else 1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
