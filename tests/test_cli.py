"""The command line as a user drives it: run, resume, report, list, partition and bad input."""

import json

import tomli_w
from typer.testing import CliRunner

from fedsight.cli import app

from helpers import tiny

runner = CliRunner()


def write_cfg(path, raw):
    path.write_text(tomli_w.dumps(raw))
    return path


def test_run_sweep_then_rerun_skips_then_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = tiny(**{"server.rounds": 2})
    raw["sweep"] = {"seeds": [0, 1]}
    raw["variants"] = [{"name": "fedavg"}, {"name": "fedyogi", "server": {"optimizer": {"name": "fedyogi"}}}]
    cfg = write_cfg(tmp_path / "c.toml", raw)
    res = runner.invoke(app, ["run", str(cfg)])
    assert res.exit_code == 0, res.output
    assert "fedavg" in res.output and "fedyogi" in res.output and "test/acc" in res.output
    for v in ("fedavg", "fedyogi"):
        for s in (0, 1):
            d = tmp_path / "runs" / "tiny" / v / f"seed{s}"
            assert json.loads((d / "status.json").read_text())["state"] == "complete"
    assert (tmp_path / "runs/tiny/report.md").is_file() and (tmp_path / "runs/tiny/curves.png").is_file()
    sweep_md = (tmp_path / "runs/tiny/report.md").read_text()  # the sweep compares each variant with the first
    assert "## Compared with the baseline (fedavg)" in sweep_md and "| 95% CI | verdict |" in sweep_md
    assert "| test/acc ↑ | fedyogi | fedavg | final | 2 |" in sweep_md
    again = runner.invoke(app, ["run", str(cfg)])
    assert again.exit_code == 0 and again.output.count("already complete") == 4
    rep = runner.invoke(app, ["report", "runs/tiny", "--out", "cmp"])
    assert rep.exit_code == 0, rep.output
    md = (tmp_path / "cmp/report.md").read_text()
    assert "fedavg" in md and "fedyogi" in md and "over 2 seeds" in md


def test_stop_after_then_resume_completes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = write_cfg(tmp_path / "c.toml", tiny(**{"server.rounds": 3}))
    res = runner.invoke(app, ["run", str(cfg), "--stop-after", "1"])
    assert res.exit_code == 0, res.output
    run_dir = tmp_path / "runs/tiny/seed0"
    assert json.loads((run_dir / "status.json").read_text()) == {"state": "stopped", "round": 1, "rounds": 3}
    res = runner.invoke(app, ["resume", str(run_dir)])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert (run_dir / "summary.md").is_file()


def test_bad_config_is_one_clear_line_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = write_cfg(tmp_path / "c.toml", tiny(**{"train.lr": 0}))
    res = runner.invoke(app, ["run", str(cfg)])
    assert res.exit_code == 2
    assert "train.lr" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "runs").exists()
    res = runner.invoke(app, ["run", str(cfg), "--set", "train.lr=0.1", "--set", "server.rounds=oops"])
    assert res.exit_code == 2 and "server.rounds" in res.output


def test_changed_config_does_not_clobber_existing_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = write_cfg(tmp_path / "c.toml", tiny(**{"server.rounds": 1}))
    assert runner.invoke(app, ["run", str(cfg)]).exit_code == 0
    before = (tmp_path / "runs/tiny/seed0/metrics.jsonl").read_text()
    res = runner.invoke(app, ["run", str(cfg), "--set", "train.lr=0.2"])
    assert res.exit_code == 2 and "different config" in res.output  # a configuration error (pick another name)
    assert (tmp_path / "runs/tiny/seed0/metrics.jsonl").read_text() == before


def test_resume_of_a_non_run_directory_names_it(tmp_path):
    res = runner.invoke(app, ["resume", str(tmp_path)])
    assert res.exit_code == 1 and str(tmp_path) in res.output.replace("\n", "")


def test_list_shows_registered_parts():
    res = runner.invoke(app, ["list"])
    assert res.exit_code == 0
    for name in ("digits", "imagefolder", "npz", "cnn", "resnet18", "mobilenetv2", "dirichlet", "fedadam", "fedyogi",
                 "fedadagrad", "fedavgm", "data_size"):
        assert name in res.output, name


def test_list_shows_metrics_and_capabilities(monkeypatch):
    """What a task measures (with directions), what it and each model provide, what each part needs."""
    from rich.console import Console

    monkeypatch.setattr("fedsight.cli_common.console", Console(width=1000))  # one line per entry
    res = runner.invoke(app, ["list", "task"])
    line = next(x for x in res.output.splitlines() if "video_sr" in x)
    assert "psnr ↑" in line and "loss ↓" in line and "primary psnr" in line and "provides: image_outputs" in line
    res = runner.invoke(app, ["list", "component"])
    line = next(x for x in res.output.splitlines() if x.strip("│ ").startswith("oll"))
    assert "needs: class_labels, linear_head" in line
    res = runner.invoke(app, ["list", "model"])
    line = next(x for x in res.output.splitlines() if x.strip("│ ").startswith("resnet8"))
    assert "provides: linear_head, norm_layers, norm_stats, parameter_groups" in line  # default norm: batch


def test_partition_prints_stats_and_writes_heatmap(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = write_cfg(tmp_path / "c.toml", tiny())
    res = runner.invoke(app, ["partition", str(cfg), "--out", "p.png"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "dirichlet" in res.output and "6 clients" in res.output


def test_unreadable_data_file_is_named_and_leaves_no_run_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.npz").write_text("garbage")
    cfg = write_cfg(tmp_path / "c.toml", tiny(**{"data": {"name": "npz", "path": "bad.npz"}}))
    res = runner.invoke(app, ["run", str(cfg)])
    assert res.exit_code == 1 and "bad.npz" in res.output
    assert not (tmp_path / "runs" / "tiny" / "seed0").exists()


def test_error_text_with_brackets_is_printed_verbatim(tmp_path):
    """Errors go through rich; a bracketed word in a path or value must not vanish as markup."""
    from typer.testing import CliRunner

    from fedsight.cli import app

    res = CliRunner().invoke(app, ["run", str(tmp_path / "[flower]" / "missing.toml")])
    assert res.exit_code == 2 and "[flower]" in res.output


def test_flower_commands_without_flower_installed_say_how_to_get_it(monkeypatch):
    import sys

    from typer.testing import CliRunner

    from fedsight.cli import app

    monkeypatch.setitem(sys.modules, "flwr", None)  # as if the flower extra were not installed
    monkeypatch.setitem(sys.modules, "flwr.app", None)
    res = CliRunner().invoke(app, ["flower", "simulate", "examples/quickstart.toml"])
    assert res.exit_code == 2 and 'pip install -c constraints.txt -e ".[flower]"' in res.output


def _commands(group, path=()):
    for info in group.registered_commands:
        yield (*path, info.name or info.callback.__name__.removesuffix("_cmd").replace("_", "-")), info
    for sub in group.registered_groups:
        yield from _commands(sub.typer_instance, (*path, sub.name))


def test_help_paragraphs_are_reflowed_so_help_at_80_columns_reads_evenly():
    """Typer joins the lines of a command's first help paragraph only and kept the others' line breaks, which
    ``--help`` at 80 columns wrapped again into ragged lines ("--set reaches every variant," alone on a line)."""
    commands = dict(_commands(app))
    assert ("run",) in commands and ("flower", "local") in commands
    for name, info in commands.items():
        for para in (info.help or "").split("\n\n"):
            lines = para.splitlines()
            assert len(lines) <= 1 or any(x[:1].isspace() or x.lstrip().startswith(("- ", "* ", "\b")) for x in lines), \
                (name, para)
    res = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "80", "TERM": "dumb"}, terminal_width=80)
    assert res.exit_code == 0
    assert any("--set reaches every variant, grid point" in line for line in res.output.splitlines()), res.output
