"""``fedsight calibrate``: the softmax temperature for fine-tuning after Fed3R by minimum training cross-entropy
(``fedsight.calibrate``). Output through ``fedsight.cli``'s console and error line (imported when it runs:
``fedsight.cli`` registers this command)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer


def calibrate_(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (its last checkpoint: e.g. after a fed3r stage).")],
    grid: Annotated[Optional[str], typer.Option(
        help="Candidate temperatures, ascending, comma-separated (default 0.01,0.02,0.05,...,5,10).")] = None,
    refine: Annotated[int, typer.Option(
        help="Golden-section steps between the grid minimum's neighbours (one more pass each).")] = 0,
) -> None:
    """The softmax temperature after Fed3R, by minimum training cross-entropy.

    Thesis Fig. 3.3: the run's last global model on every client's training data; each client sends its CE sums per
    temperature, the server adds them. Prints the curve and the choice; writes RUN_DIR/temperature.json and
    RUN_DIR/plots/temperature.png. Set train.temperature of the fine-tuning stages to the value chosen. See
    docs/fed3r.md."""
    from rich.table import Table

    from . import cli_common as C
    from .calibrate import calibrate_run
    from .errors import ConfigError, OutputPathError
    from .functional.temperature import DEFAULT_GRID

    if not (run_dir / "config.json").is_file():
        C.fail(f"{run_dir}: not a run directory (no config.json)")
    taus = DEFAULT_GRID
    if grid is not None:
        try:
            taus = tuple(float(t) for t in grid.split(",") if t.strip())
        except ValueError:
            C.fail(f"--grid {grid!r}: expected numbers separated by commas, e.g. 0.05,0.1,0.2")
    if refine < 0:
        C.fail(f"--refine {refine}: expected a number of steps >= 0")
    try:
        from .functional.temperature import check_grid

        check_grid(taus)
    except ValueError as exc:
        C.fail(f"--grid: {exc}")
    try:
        cal = calibrate_run(run_dir, taus, refine)
    except (ConfigError, OutputPathError) as exc:
        C.fail(str(exc))
    except (FileNotFoundError, ValueError) as exc:
        C.fail(str(exc), 1)
    table = Table()
    table.add_column("tau", justify="right")
    table.add_column("mean train CE", justify="right")
    rows = sorted([(t, v, "") for t, v in zip(cal.grid, cal.grid_ce)] + [(t, v, " (refine)") for t, v in cal.refined])
    for t, v, what in rows:
        mark = " ←" if t == cal.tau else ""
        table.add_row(f"{t:.4g}{what}", f"{v:.5g}{mark}")
    C.say(f"{run_dir}: round {cal.round} (stage {cal.stage}), {cal.clients} clients, {cal.examples} training examples")
    C.console.print(table)
    C.say(f"tau = {cal.tau:.4g} (mean training CE {cal.ce:.5g}): --set train.temperature={cal.tau:.4g}")
    if cal.at_edge:
        C.say("the minimum is at an end of the grid: it may lie beyond it; widen --grid")
    C.say(f"wrote {Path(run_dir) / 'temperature.json'} and {Path(run_dir) / 'plots' / 'temperature.png'}")
