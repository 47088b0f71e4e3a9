"""Regression tests for ``fedsight report``: curve styles beyond 10 groups, offset texts over panel titles,
same-seed runs (other backends) kept apart, metrics of some runs only, bold per sweep grid point, and the
CSV export. Run directories are written here as the engines write them (config.json, run.json,
metrics.jsonl)."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest

from fedsight.reporting import compare, group_runs, plot_comparison, plot_run, report, write_csv
from fedsight.reporting.export import ID_COLUMNS
from fedsight.reporting.plots import line_style

DIRECTIONS = {"test/acc": True, "test/loss": False, "test/psnr": True, "test/ssim": True, "train/*": False,
              "time/*": False, "clients/*": None}


def config(name: str, seed: int, *, task: str = "classification", lr: float = 0.1, alpha: float = 0.3,
           device: str = "cpu") -> dict:
    return {
        "seed": seed,
        "run": {"name": name, "output_dir": "runs", "checkpoint_keep": 2},
        "task": {"name": task},
        "data": {"name": "digits"},
        "partition": {"name": "dirichlet", "alpha": alpha, "num_clients": 10},
        "model": {"name": "cnn_small"},
        "train": {"lr": lr, "epochs": 1},
        "server": {"rounds": 4},
        "engine": {"device": device, "threads": 1},
    }


def write_run(root: Path, rel: str, cfg: dict, rows: list[dict], *, backend: str | None = "in-process",
              directions: dict = DIRECTIONS, primary: str = "test/acc") -> Path:
    """A run directory at ``root/rel``: ``rows`` are metrics.jsonl lines ("round" and "stage" added when
    missing); ``backend`` goes into run.json's session as the engines record it (None: not recorded)."""
    d = root / rel
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    session = {"started": "2025-01-01T00:00:00+00:00"} | ({"backend": backend} if backend else {})
    meta = {"format": 1, "primary": primary, "metrics": directions, "sessions": [session]}
    (d / "run.json").write_text(json.dumps(meta))
    lines = [json.dumps({"stage": "fed", **r}) for r in rows]
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return d


def acc_rows(accs: list[float], **extra: float) -> list[dict]:
    return [{"round": i, "test/acc": a, "test/loss": 1 - a, "train/loss": 1 / i, "time/round_s": 1.0, **extra}
            for i, a in enumerate(accs, start=1)]


@pytest.fixture
def saved_figures(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every matplotlib figure saved while the test runs, as saved."""
    from matplotlib.figure import Figure

    figures = []
    original = Figure.savefig

    def savefig(self, *args, **kwargs):
        original(self, *args, **kwargs)
        figures.append(self)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figures


def drawn(fig):
    """``fig`` drawn again with the Agg canvas; its renderer."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


# ------------------------------------------------------------------------------------------ 1. styles


def test_25_groups_get_25_distinct_curve_styles(tmp_path: Path, saved_figures: list) -> None:
    dirs = [write_run(tmp_path, f"g{i}/seed0", config(f"g{i}", 0, lr=0.01 * (i + 1)),
                      acc_rows([0.1 + 0.01 * i, 0.2 + 0.01 * i, 0.3 + 0.01 * i])) for i in range(25)]
    plot_comparison(dirs, tmp_path / "cmp.png", metrics=["test/acc", "test/loss"])
    (fig,) = saved_figures
    from matplotlib.colors import to_hex

    for ax in [a for a in fig.axes if a.get_visible()]:
        lines = ax.get_lines()
        assert len(lines) == 25
        styles = [(to_hex(ln.get_color()), ln.get_linestyle(), ln.get_marker()) for ln in lines]
        assert len(set(styles)) == 25, styles
    # every group keeps its style across panels, and the legend shows the same styles
    per_axes = [[(to_hex(ln.get_color()), ln.get_linestyle(), ln.get_marker(), ln.get_label()) for ln in a.get_lines()]
                for a in fig.axes if a.get_visible()]
    assert per_axes[0] == per_axes[1]
    legend = fig.legends[0]
    shown = {(t.get_text(), to_hex(h.get_color()), h.get_linestyle(), h.get_marker())
             for t, h in zip(legend.get_texts(), legend.legend_handles)}
    assert shown == {(lab, c, ls, m) for c, ls, m, lab in per_axes[0]}


@pytest.mark.parametrize("n_groups, n_metrics", [(6, 2), (3, 1), (12, 5)])
def test_the_legend_stays_inside_the_figure(tmp_path: Path, saved_figures: list, n_groups: int,
                                            n_metrics: int) -> None:
    """Long group labels (``fedavg (server.rounds=3)``-like) never push the legend past the figure's edges (before:
    4 columns cut off on both sides of two squashed panels)."""
    dirs = [write_run(tmp_path, f"g{i}/seed0", config(f"a_long_variant_name_{i}[alpha=0.{i},mu=0.0{i}]", 0,
                                                      lr=0.01 * (i + 1)), acc_rows([0.1, 0.2])) for i in range(n_groups)]
    metrics = ["test/acc", "test/loss", "train/loss", "time/round_s", "test/acc"][:n_metrics]
    plot_comparison(dirs, tmp_path / "cmp.png", metrics=list(dict.fromkeys(metrics)) if n_metrics < 5 else metrics[:4])
    (fig,) = saved_figures
    renderer = drawn(fig)
    box, page = fig.legends[0].get_window_extent(renderer), fig.bbox
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0, (box, page)
    labels = [t.get_text().replace("\n", "") for t in fig.legends[0].get_texts()]
    assert sorted(labels) == sorted(f"a_long_variant_name_{i}[alpha=0.{i},mu=0.0{i}]" for i in range(n_groups))


def test_line_style_is_distinct_and_deterministic_for_any_number() -> None:
    colors = [f"C{i}" for i in range(10)]
    styles = [line_style(i, colors) for i in range(1200)]
    keys = [(s["color"], repr(s["linestyle"]), s["marker"]) for s in styles]
    assert len(set(keys)) == len(keys)
    assert [line_style(i, colors) for i in range(1200)] == styles
    assert line_style(7, ["red", "blue"]) == line_style(7, ["red", "blue"])
    # beyond the plain styles the dash patterns are valid for matplotlib
    from matplotlib.lines import Line2D

    for s in styles[::97]:
        Line2D([0, 1], [0, 1], **s)


# ------------------------------------------------------------------------------------- 2. offset texts


def _check_no_offset_text_over_titles(fig) -> int:
    """No axis shows an offset text, no title overlaps one, and every tick label (times the multiplier its
    axis label names) is the tick's value. Returns how many axis labels name a multiplier."""
    renderer = drawn(fig)
    multipliers = 0
    for ax in [a for a in fig.axes if a.get_visible()]:
        title = ax.title.get_window_extent(renderer)
        for axis in (ax.xaxis, ax.yaxis):
            off = axis.get_offset_text()
            if off.get_visible() and off.get_text():
                assert not title.overlaps(off.get_window_extent(renderer)), (ax.get_title(), off.get_text())
                pytest.fail(f"offset text {off.get_text()!r} on {ax.get_title()!r}")
            m = re.search(r"\(×1e(-?\d+)\)", axis.get_label_text())
            scale = 10.0 ** int(m.group(1)) if m else 1.0
            multipliers += m is not None
            lo, hi = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks():
                text = tick.label1.get_text().replace("\u2212", "-")
                if text and lo <= tick.get_loc() <= hi:
                    assert float(text) * scale == pytest.approx(tick.get_loc(), rel=1e-9, abs=1e-3 * (hi - lo))
    return multipliers


def test_offset_text_never_overprints_panel_titles(tmp_path: Path, saved_figures: list) -> None:
    # video-SR-like values: PSNR 28.1231.. and SSIM 0.91231.. changing in the 4th decimal (matplotlib
    # would label them "+2.812e1" above the axes), and a tiny training loss (a "1e-7" multiplier)
    rows = [{"round": r, "test/psnr": 28.1231 + 1e-4 * r, "test/ssim": 0.91231 + 1e-5 * r,
             "train/loss": 1e-7 + 1e-9 * r, "time/round_s": 100.001 + 1e-4 * r} for r in range(1, 41)]
    dirs = [write_run(tmp_path, f"vsr/seed{s}", config("vsr", s, task="video_sr"), rows, primary="test/psnr")
            for s in range(2)]
    plot_run(dirs[0])
    plot_comparison(dirs, tmp_path / "cmp.png", metrics=["test/psnr", "test/ssim", "train/loss", "time/round_s"])
    assert len(saved_figures) == 2
    for fig in saved_figures:
        assert _check_no_offset_text_over_titles(fig) == 1  # train/loss: its multiplier in its label


# ------------------------------------------------------------------------------- 3. same-seed replicates


def test_same_seed_runs_on_other_backends_are_not_pooled(tmp_path: Path) -> None:
    # seed 0 of one config in-process, on Flower over loopback and on Flower's Ray simulation
    inproc = write_run(tmp_path, "inproc/A/seed0", config("A", 0), acc_rows([0.5, 0.7]))
    loop = write_run(tmp_path, "loopback/A/seed0", config("A", 0, device="cuda"), acc_rows([0.5, 0.7]), backend="flower")
    ray = write_run(tmp_path, "ray/A/seed0", config("A", 0), acc_rows([0.5, 0.7]), backend="flower")
    groups = group_runs([inproc, loop, ray])
    assert [len(g.run_dirs) for g in groups] == [1, 1, 1]
    assert len({g.label for g in groups}) == 3
    assert "in-process" in groups[0].label
    assert "loopback" in groups[1].label and "ray" in groups[2].label
    table = report([inproc, loop, ray], tmp_path / "rep").table
    assert all(r.n_runs == 1 and r.final_std is None for r in table.rows)
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "±" not in md.split("## Groups")[0].split("\n", 3)[3]  # no mean ± std of one run
    groups_md = md.split("## Groups")[1]
    assert "same seed" in groups_md
    for g in groups:
        (line,) = [ln for ln in groups_md.splitlines() if ln.startswith(f"- **{g.label}**")]
        assert "seed 0" in line and str(g.run_dirs[0]) in line


def test_replicates_are_runs_of_one_config_with_distinct_seeds(tmp_path: Path) -> None:
    acc = acc_rows([0.5, 0.7])
    seeds = [write_run(tmp_path, f"sweep/A/seed{s}", config("A", s), acc) for s in range(3)]
    elsewhere = write_run(tmp_path, "again/A/seed0", config("A", 0), acc)  # the same run twice
    flower = write_run(tmp_path, "fl/A/seed0", config("A", 0), acc, backend="flower")
    other_seed = write_run(tmp_path, "fl/A/seed5", config("A", 5), acc, backend="flower")
    groups = group_runs([*seeds, elsewhere, flower, other_seed])
    for g in groups:
        assert len(set(g.seeds)) == len(g.seeds)  # never a seed twice in a group
    by_seeds = {g.seeds: g for g in groups}
    assert set(by_seeds) == {(0, 1, 2), (0,), (0, 5)}
    assert by_seeds[(0, 5)].backends == ("flower", "flower")
    assert len({g.label for g in groups}) == len(groups)
    # without a same-seed clash, runs of one config on different backends are replicates
    (g,) = group_runs([seeds[1], seeds[2], flower])
    assert g.seeds == (1, 2, 0) and g.label == "A"

    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(compare([*seeds, elsewhere, flower, other_seed]).to_rich())
    text = console.export_text()
    for g in groups:
        assert g.label in text
    assert "seeds 0, 1, 2" in text and "seeds 0, 5" in text


# ------------------------------------------------------------------------------------- 4. mixed metrics


def _value_rows(md: str) -> list[str]:
    """The rows of report.md's value tables (metric | run | n | rounds | final | best)."""
    return [ln for ln in md.splitlines() if re.match(r"\| \S+ [↑↓]? ?\| [^|]+ \| \d+ \| [\d–]+ \|", ln)]


def test_mixed_tasks_get_a_section_each_with_only_their_metrics(tmp_path: Path, saved_figures: list) -> None:
    """A folder of classification and SR runs: one table per task, no row of a metric the group never logs, a
    curves figure per task with that task's panels only; within a task a metric of some groups only is kept
    (— for the others)."""
    cls = [write_run(tmp_path, f"cls/seed{s}", config("cls", s), acc_rows([0.5, 0.6 + s / 10])) for s in range(2)]
    val = write_run(tmp_path, "val/seed0", config("val", 0, lr=0.2), acc_rows([0.5, 0.7], **{"val/acc": 0.6}))
    sr_rows = [{"round": r, "test/psnr": 20.0 + r, "test/ssim": 0.5 + r / 10, "time/round_s": 3.0} for r in (1, 2)]
    sr = write_run(tmp_path, "sr/seed0", config("sr", 0, task="video_sr"), sr_rows, primary="test/psnr")
    rep = report([*cls, sr, val], tmp_path / "rep")
    assert [s.title for s in rep.sections] == ["classification on digits", "video_sr on digits"]
    cls_table, sr_table = (s.table for s in rep.sections)
    assert set(cls_table.metrics) == {"test/acc", "test/loss", "val/acc", "time/round_s"}
    assert set(sr_table.metrics) == {"test/psnr", "test/ssim", "time/round_s"}
    rows = {(r.group, r.metric): r for r in cls_table.rows}
    assert rows["cls", "test/acc"].n_runs == 2 and rows["cls", "test/acc"].final_mean == pytest.approx(0.65)
    assert rows["cls", "val/acc"].n_runs == 0
    assert sr_table.rows[0].final_mean == pytest.approx(22.0)
    md = (tmp_path / "rep" / "report.md").read_text()
    table_rows = _value_rows(md)
    assert len(table_rows) == 2 * 4 + 1 * 3  # groups x their own section's metrics
    empty = [ln for ln in table_rows if ln.endswith("| — | — |")]
    assert empty == ["| val/acc | cls | 0 | 2 | — | — |"]  # one task's metric some groups lack: kept
    assert md.index("## classification on digits") < md.index("## video_sr on digits")
    assert "![comparison curves](curves-classification-on-digits.png)" in md
    assert "![comparison curves](curves-video-sr-on-digits.png)" in md
    assert sorted(p.name for p in (tmp_path / "rep").glob("*.png")) == [
        "curves-classification-on-digits.png", "curves-video-sr-on-digits.png"]
    panels = [sorted(ax.get_title().split(" ")[0] for ax in fig.axes if ax.get_title()) for fig in saved_figures[-2:]]
    assert panels == [["test/acc", "test/loss", "time/round_s", "val/acc"], ["test/psnr", "test/ssim", "time/round_s"]]
    assert all(r.n_runs > 0 for r in sr_table.rows) and sr_table.comparisons == ()  # one group: no baseline


def test_a_baseline_in_one_section_only_is_used_there_and_said_elsewhere(tmp_path: Path) -> None:
    a = [write_run(tmp_path, f"a/seed{s}", config("a", s), acc_rows([0.5, 0.6])) for s in range(2)]
    b = [write_run(tmp_path, f"b/seed{s}", config("b", s, lr=0.2), acc_rows([0.5, 0.7])) for s in range(2)]
    sr_rows = [{"round": 1, "test/psnr": 20.0, "time/round_s": 3.0}]
    sr = [write_run(tmp_path, f"{m}/seed0", config(m, 0, task="video_sr", lr=lr), sr_rows, primary="test/psnr")
          for m, lr in (("x", 0.1), ("y", 0.2))]
    rep = report([*a, *b, *sr], tmp_path / "rep", baseline="b")
    cls, vsr = rep.sections
    assert {c.baseline for c in cls.table.comparisons} == {"b"} and {c.group for c in cls.table.comparisons} == {"a"}
    assert {c.baseline for c in vsr.table.comparisons} == {"x"}
    assert vsr.note.startswith("The baseline b is not among these runs: compared with x.")
    assert vsr.note in (tmp_path / "rep" / "report.md").read_text()
    with pytest.raises(ValueError, match="sections"):
        rep.table  # noqa: B018


def test_asked_metrics_leave_out_the_sections_that_log_none_of_them(tmp_path: Path) -> None:
    cls = write_run(tmp_path, "cls/seed0", config("cls", 0), acc_rows([0.5, 0.6]))
    sr = write_run(tmp_path, "sr/seed0", config("sr", 0, task="video_sr"),
                   [{"round": 1, "test/psnr": 20.0, "time/round_s": 3.0}], primary="test/psnr")
    rep = report([cls, sr], tmp_path / "rep", metrics=["test/psnr"])
    assert [s.title for s in rep.sections] == ["video_sr on digits"] and rep.left_out == ("classification on digits",)
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "- not shown (they log none of the asked metrics): classification on digits" in md
    assert rep.files == ["report.md", "report.html", "curves-video-sr-on-digits.png"]
    rep = report([cls, sr], tmp_path / "rep2", metrics=["test/acc", "test/psnr"])
    assert [s.table.metrics for s in rep.sections] == [("test/acc",), ("test/psnr",)]
    assert [s.note for s in rep.sections] == ["Not logged here: test/psnr.", "Not logged here: test/acc."]


def test_experiments_sharing_a_name_are_labelled_by_what_differs(tmp_path: Path) -> None:
    """Not ``fedavg [b74bf6]``: the differing config keys, else (too long) the identity keys that tell
    them apart, else a hash."""
    rounds = [write_run(tmp_path, f"r{n}/seed0", config("fedavg", 0) | {"server": {"rounds": n}}, acc_rows([0.5]))
              for n in (3, 4)]
    assert [g.label for g in group_runs(rounds)] == ["fedavg (server.rounds=3)", "fedavg (server.rounds=4)"]
    many = {"data": {"name": "cifar10"}, "partition": {"name": "iid", "num_clients": 50},
            "model": {"name": "resnet8"}, "train": {"lr": 0.3, "epochs": 5}, "task": {"name": "video_sr"}}
    other = write_run(tmp_path, "other/seed0", config("fedavg", 0) | many, acc_rows([0.5]))
    labels = [g.label for g in group_runs([rounds[0], other])]
    assert labels == ["fedavg (task.name=classification)", "fedavg (task.name=video_sr)"]
    long = [write_run(tmp_path, f"long{i}/seed0", config("fedavg", 0) | {"train": {"lr": 0.1, "note": "x" * 60 + str(i)}},
                      acc_rows([0.5])) for i in range(2)]
    assert all(re.fullmatch(r"fedavg \[[0-9a-f]{6}\]", g.label) for g in group_runs(long))


# ------------------------------------------------------------------------------------ 5. bold per point


def test_best_is_bold_within_each_grid_point(tmp_path: Path) -> None:
    finals = {("fedavg", 1.0): 0.9, ("fedprox", 1.0): 0.85, ("fedavg", 0.1): 0.6, ("fedprox", 0.1): 0.7}
    dirs = []
    for (method, alpha), final in finals.items():
        label = f"alpha={alpha}"
        cfg = config(f"{method}[{label}]", 0, alpha=alpha, lr=0.1 if method == "fedavg" else 0.2)
        dirs.append(write_run(tmp_path, f"sweep/{method}/{label}/seed0", cfg, acc_rows([0.3, final])))
    # two runs outside the sweep: one comparison set of their own
    dirs.append(write_run(tmp_path, "x/seed0", config("x", 0, lr=0.5), acc_rows([0.3, 0.4])))
    dirs.append(write_run(tmp_path, "y/seed0", config("y", 0, lr=0.6), acc_rows([0.3, 0.5])))
    table = compare(dirs, metrics=["test/acc", "test/loss"])
    md = table.to_markdown().splitlines()

    def bold(metric: str) -> set[str]:
        return {ln.split(" | ")[1] for ln in md if ln.startswith(f"| {metric} ") and "**" in ln}

    assert bold("test/acc ↑") == {"fedavg[alpha=1.0]", "fedprox[alpha=0.1]", "y"}
    assert bold("test/loss ↓") == {"fedavg[alpha=1.0]", "fedprox[alpha=0.1]", "y"}  # loss = 1 - acc
    rich = table.to_rich()
    run_col, final_col = rich.columns[0], rich.columns[3]  # (each metric heads its rows in the run column)
    bold_rich = {g for g, f in zip(run_col._cells, final_col._cells) if "[bold]" in f}
    assert bold_rich == {"fedavg\\[alpha=1.0]", "fedprox\\[alpha=0.1]", "y"}
    assert {r.grid_point for r in table.rows} == {"alpha=1.0", "alpha=0.1", None}


# ---------------------------------------------------------------------------------------------- 6. CSV


def test_write_csv_has_every_metric_of_every_run_and_round(tmp_path: Path) -> None:
    a_rows = [{"round": 1, "train/loss": 0.9, "time/round_s": 1.5},
              {"round": 2, "train/loss": 0.7, "test/acc": 0.55, "test/iou/road": 0.25},
              {"event": "client_failed", "round": 2, "client": 3},
              {"round": 3, "train/loss": 0.6, "time/round_s": 1.25},
              {"round": 3, "stage": "finetune", "train/loss": 0.123456789012345678, "test/acc": float("nan")}]
    a = write_run(tmp_path, "A/seed0", config("A", 0), a_rows, backend="flower")
    b = write_run(tmp_path, "B/seed1", config("B", 1, task="video_sr"),
                  [{"round": 1, "test/psnr": 27.5}, {"round": 2, "test/psnr": 28.25}], backend=None)
    out = write_csv([a, b], tmp_path / "out" / "all.csv")
    assert out == tmp_path / "out" / "all.csv"
    with out.open(newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames
        rows = list(reader)
    assert header[: len(ID_COLUMNS)] == list(ID_COLUMNS)
    assert set(header[len(ID_COLUMNS):]) == {"train/loss", "time/round_s", "test/acc", "test/iou/road", "test/psnr"}
    assert "client" not in header
    assert [(r["run_dir"], r["round"]) for r in rows] == [(str(a), "1"), (str(a), "2"), (str(a), "3"),
                                                          (str(b), "1"), (str(b), "2")]
    labels = [g.label for g in group_runs([a, b])]
    assert [r["group"] for r in rows] == [labels[0]] * 3 + [labels[1]] * 2
    assert [r["seed"] for r in rows] == ["0"] * 3 + ["1"] * 2
    assert [r["backend"] for r in rows] == ["flower"] * 3 + [""] * 2
    assert rows[2]["stage"] == "finetune" and rows[0]["stage"] == "fed"
    r1, r2, r3, b1, b2 = rows
    assert r1["test/acc"] == "" and r2["test/acc"] == "0.55" and math.isnan(float(r3["test/acc"]))
    assert float(r3["train/loss"]) == 0.123456789012345678  # the last line of a round wins, exactly
    assert r3["time/round_s"] == "1.25" and r2["test/iou/road"] == "0.25"
    assert b2["test/psnr"] == "28.25" and b1["test/acc"] == "" and r1["test/psnr"] == ""
    assert all(r["run_name"] == n for r, n in zip(rows, ["A"] * 3 + ["B"] * 2))


def test_write_csv_errors_name_the_file(tmp_path: Path) -> None:
    d = write_run(tmp_path, "A/seed0", config("A", 0), [{"round": 1, "seed": 3.0}])
    with pytest.raises(ValueError, match=re.escape(str(d / "metrics.jsonl"))):
        write_csv([d], tmp_path / "x.csv")
    assert not (tmp_path / "x.csv").exists()
    ok = write_run(tmp_path, "B/seed0", config("B", 0), acc_rows([0.5]))
    (tmp_path / "folder.csv").mkdir()
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'folder.csv'}: cannot write")):
        write_csv([ok], tmp_path / "folder.csv")
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_grid_point_is_read_from_the_names_a_sweep_gives_its_runs() -> None:
    """The grid label that bold-per-point reads is the one the sweep expansion puts into run names (and
    run directories: output_dir/base/variant/label/seedN)."""
    from helpers import tiny

    from fedsight.reporting.runs_view import grid_point

    try:
        from fedsight.sweep import expand
    except ImportError:  # before sweeps moved out of fedsight.config
        from fedsight.config import expand
    raw = tiny()
    raw["sweep"] = {"seeds": [0, 1], "grid": {"partition.alpha": [0.1, 1.0], "train.lr": [0.05, 0.2]}}
    raw["variants"] = [{"name": "fedavg"}, {"name": "slow", "server": {"rounds": 2}}]
    specs = expand(raw, "sweep.toml")
    assert len(specs) == 16
    points = {grid_point(s.config.run.name) for s in specs}
    assert points == {s.run_dir.parent.name for s in specs} and len(points) == 4 and None not in points
    assert grid_point("fedavg") is None and grid_point("fedprox [a1b2c3]") is None


def test_many_default_metrics_plot_the_primary_at_every_split_and_tabulate_all(tmp_path: Path,
                                                                                saved_figures: list) -> None:
    """Keypoint runs log four metrics at five input sizes: the curves show the primary metric at each size
    (plus time/round_s), the table every metric; metrics asked for are all drawn."""
    splits = ["test", "test_64x48", "test_96x72", "test_160x120", "test_192x144"]
    names = ["pckh", "pck", "ap", "loss"]
    directions = {f"{s}/{n}": n != "loss" for s in splits for n in names} | {"time/round_s": False}
    rows = [{"round": r, "time/round_s": 1.0, **{f"{s}/{n}": 0.1 * r for s in splits for n in names}}
            for r in (1, 2)]
    runs = [write_run(tmp_path, f"g/{m}/seed0", config(m, 0, lr=lr), rows, directions=directions,
                      primary="test/pckh") for m, lr in (("a", 0.1), ("b", 0.2))]
    table = report(runs, tmp_path / "out").table
    assert len(table.metrics) == len(splits) * len(names) + 1
    titles = [ax.get_title() for ax in saved_figures[-1].axes if ax.get_title()]
    assert sorted(t.split(" ")[0] for t in titles) == sorted([f"{s}/pckh" for s in splits] + ["time/round_s"])
    plot_comparison(runs, tmp_path / "chosen.png", metrics=["test/ap", "test/pck"])
    assert sorted(ax.get_title().split(" ")[0] for ax in saved_figures[-1].axes if ax.get_title()) == [
        "test/ap", "test/pck"]


def test_flower_central_dp_runs_are_not_replicates_of_plain_runs(tmp_path: Path) -> None:
    """Central DP's options live in flower.json, not in the config: DP runs form their own group."""
    plain = [write_run(tmp_path, f"p/A/seed{s}", config("A", s), acc_rows([0.5, 0.9])) for s in (0, 1)]
    dp = []
    for s in (2, 3):
        d = write_run(tmp_path, f"dp/A/seed{s}", config("A", s), acc_rows([0.4, 0.6]), backend="flower")
        (d / "flower.json").write_text(json.dumps({"options": {"dp_noise_multiplier": 0.8, "dp_clipping_norm": 1.0,
                                                               "run_dir": str(d)}}))
        dp.append(d)
    groups = group_runs(plain + dp)
    assert sorted(len(g.run_dirs) for g in groups) == [2, 2]
    assert {frozenset(g.run_dirs) for g in groups} == {frozenset(plain), frozenset(dp)}
    assert len({g.label for g in groups}) == 2


def test_a_group_names_its_runs_that_have_not_reached_their_last_round(tmp_path: Path) -> None:
    """A run still running (or stopped) compares its last logged round as "final": the group's line says which
    seed stopped where, in the terminal caption and in report.md alike; finished groups say nothing of it."""
    dirs = [write_run(tmp_path, f"a/seed{s}", config("a", s), acc_rows([0.3, 0.4, 0.5, 0.6])) for s in (0, 1)]
    dirs.append(write_run(tmp_path, "a/seed2", config("a", 2), acc_rows([0.3, 0.45])))  # 2 of 4 rounds
    dirs += [write_run(tmp_path, f"b/seed{s}", config("b", s, lr=0.2), acc_rows([0.3, 0.4, 0.5, 0.7])) for s in (0, 1)]
    table = compare(dirs)
    lines = dict(zip([g.label for g in table.groups], table.group_lines()))
    assert lines["a"].endswith("; not finished: seed 2 at round 2 of 4 (final = that round's value)"), lines
    assert "not finished" not in lines["b"]
    report(dirs, tmp_path / "out")
    assert "not finished: seed 2 at round 2 of 4" in (tmp_path / "out" / "report.md").read_text()
