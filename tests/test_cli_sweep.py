"""Sweeps from the command line: --set wins over variants, what the sweep would shadow is an error,
--variant picks a subset, --stop-after prints a command that continues exactly what was stopped, and
paths and names are printed as written."""

import json
import re
import shlex

import pytest
import tomli_w
from typer.testing import CliRunner

from fedsight.cli import app
from fedsight.config import ConfigError
from fedsight.sweep import expand

from helpers import tiny

runner = CliRunner()


def _sweep(**over):
    raw = tiny(**{"server.rounds": 2, **over})
    raw["variants"] = [{"name": "long", "server": {"rounds": 31}, "train": {"lr": 0.2}},
                       {"name": "plain"}]
    return raw


def test_set_wins_over_a_variants_value_and_keeps_the_variants_other_settings():
    specs = expand(_sweep(), "c.toml", ["server.rounds=4"])
    assert {s.variant: s.config.server.rounds for s in specs} == {"long": 4, "plain": 4}
    assert {s.variant: s.config.train.lr for s in specs} == {"long": 0.2, "plain": 0.1}
    # a component switched on the command line replaces the variant's component with its parameters
    raw = _sweep()
    raw["variants"][0]["partition"] = {"name": "dirichlet", "alpha": 0.05, "num_clients": 6}
    (long, plain) = expand(raw, "c.toml", ["partition.name=iid"])
    assert long.config.partition.name == plain.config.partition.name == "iid"


@pytest.mark.parametrize("override, grid, seeds, what", [
    ("server.rounds=4", {"server.rounds": [3, 5]}, [], "sweep.grid sets server.rounds"),
    ('partition={name = "iid", num_clients = 6}', {"partition.alpha": [0.1, 1.0]}, [], "sweep.grid sets partition.alpha"),
    ("partition.alpha=0.3", {"partition": ["iid", "dirichlet"]}, [], "sweep.grid sets partition"),
    ("seed=3", {}, [0, 1], "sweep.seeds = [0, 1] decides the seeds"),
])
def test_an_override_the_sweep_would_shadow_is_an_error(override, grid, seeds, what):
    raw = tiny()
    raw["sweep"] = {"grid": grid, "seeds": seeds}
    with pytest.raises(ConfigError, match=re.escape(f"--set {override.split('=')[0]}: c.toml's {what}")):
        expand(raw, "c.toml", [override])
    raw["sweep"] = {}
    assert expand(raw, "c.toml", [override])  # without the sweep the same override applies


def test_variant_picks_a_subset_and_an_unknown_name_lists_the_variants():
    assert [s.variant for s in expand(_sweep(), "c.toml", only=["plain"])] == ["plain"]
    with pytest.raises(ConfigError, match=r"--variant lng: is no variant of c.toml \(it has: long, plain\)"):
        expand(_sweep(), "c.toml", only=["lng"])
    # a shell-style pattern picks every variant it matches, in the config's order; one that matches none is an error
    raw = _sweep()
    raw["variants"] += [{"name": "dct_e1"}, {"name": "dct_e8_tau22"}, {"name": "odd[1]"}]
    assert [s.variant for s in expand(raw, "c.toml", only=["dct_*", "plain"])] == ["plain", "dct_e1", "dct_e8_tau22"]
    assert [s.variant for s in expand(raw, "c.toml", only=["*_tau??"])] == ["dct_e8_tau22"]
    assert [s.variant for s in expand(raw, "c.toml", only=["odd[1]"])] == ["odd[1]"]  # a name is always itself
    with pytest.raises(ConfigError, match=r"--variant dp_\*: matches no variant of c.toml"):
        expand(raw, "c.toml", only=["dp_*"])


def test_stop_after_prints_a_command_that_continues_exactly_what_was_stopped(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text(tomli_w.dumps(_sweep()))
    args = ["run", "c.toml", "--set", "server.rounds=3", "--set", "run.name=my[run]", "--variant", "long"]
    res = runner.invoke(app, [*args, "--stop-after", "1"])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if "continue with: " in x)
    again = shlex.split(line.split("continue with: ", 1)[1])
    assert again[:2] == ["fedsight", "run"]
    res = runner.invoke(app, again[1:])
    assert res.exit_code == 0, res.output
    run_dir = tmp_path / "runs" / "my[run]" / "long" / "seed0"
    assert json.loads((run_dir / "status.json").read_text()) == {"state": "complete", "round": 3, "rounds": 3}
    assert not (tmp_path / "runs" / "my[run]" / "plain").exists()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]


def test_paths_and_names_with_brackets_are_printed_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = tiny(**{"server.rounds": 1, "run.name": "exp[bold]", "run.output_dir": "out[red]"})
    (tmp_path / "c.toml").write_text(tomli_w.dumps(raw))
    res = runner.invoke(app, ["run", "c.toml"])
    assert res.exit_code == 0, res.output
    assert "out[red]/exp[bold]/seed0" in res.output
    assert (tmp_path / "out[red]" / "exp[bold]" / "seed0" / "summary.md").is_file()
    again = runner.invoke(app, ["run", "c.toml"])
    assert "exp[bold] seed 0: already complete in out[red]/exp[bold]/seed0" in again.output


def test_version_names_fedsight_and_torch():
    import torch

    from fedsight import __version__

    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0
    assert f"fedsight {__version__} (torch {torch.__version__}" in res.output


def test_run_json_records_versions_the_command_line_and_the_git_commit(tmp_path, monkeypatch):
    import subprocess
    from importlib import metadata

    monkeypatch.chdir(tmp_path)
    subprocess.run(["git", "init", "-q", "."], check=True)
    (tmp_path / "c.toml").write_text(tomli_w.dumps(tiny(**{"server.rounds": 1})))
    subprocess.run(["git", "add", "c.toml"], check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "exp"], check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    monkeypatch.setattr("sys.argv", ["/venv/lib/fedsight/__main__.py", "run", "c.toml"])  # python -m fedsight
    assert runner.invoke(app, ["run", "c.toml"]).exit_code == 0
    session = json.loads((tmp_path / "runs/tiny/seed0/run.json").read_text())["sessions"][0]
    assert session["command"] == ["fedsight", "run", "c.toml"]
    assert session["git"]["cwd"] == {"commit": head, "dirty": False}
    assert session["packages"]["scikit-learn"] == metadata.version("scikit-learn")
    assert session["threads"] >= 1 and session["device"] == "cpu"


def test_partition_of_a_sweep_shows_every_distinct_partition_in_the_sweeps_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = tiny()
    raw["sweep"] = {"seeds": [0, 1], "grid": {"partition.alpha": [0.05, 100.0]}}
    raw["variants"] = [{"name": "fedavg"}, {"name": "prox", "recipe": {"components": [{"name": "fedprox"}]}}]
    (tmp_path / "c.toml").write_text(tomli_w.dumps(raw))
    res = runner.invoke(app, ["partition", "c.toml"])
    assert res.exit_code == 0, res.output
    pngs = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.png"))
    # in the sweep's folder, where both variants find it, named by the grid point they share (issue 45)
    assert pngs == ["runs/tiny/partition-alpha=0.05.png", "runs/tiny/partition-alpha=100.0.png"]
    assert "fedavg/alpha=0.05, prox/alpha=0.05 (seed 0)" in res.output  # the variants share the partition
    assert "heatmap: runs/tiny/partition-alpha=0.05.png" in res.output
    cells = [[c.strip() for c in line.strip().strip("│").split("│")] for line in res.output.splitlines()]
    shares = [float(c[-1]) for c in cells if len(c) == 5 and c[0].isdigit()]
    assert len(shares) == 12  # 6 clients per point
    assert max(shares[:6]) > 0.5 > max(shares[6:])  # alpha 0.05 concentrates labels, alpha 100 does not
    res = runner.invoke(app, ["partition", "c.toml", "--variant", "prox", "--set", "sweep.grid={}", "--out", "p.png"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "p.png").is_file()


def test_progress_off_a_terminal_is_whole_lines_with_the_metrics(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text(tomli_w.dumps(tiny(**{"server.rounds": 2, "run.name": "a-rather-long-run-name"
                                                                                         "-that-a-bar-would-cut"})))
    res = runner.invoke(app, ["run", "c.toml"])  # the runner's output is no terminal, as under nohup or SLURM
    assert res.exit_code == 0, res.output
    lines = [x for x in res.output.splitlines() if " round " in x]
    assert [x.split(" round ")[1].split()[0] for x in lines] == ["1/2", "2/2"]
    acc = json.loads((tmp_path / "runs/a-rather-long-run-name-that-a-bar-would-cut/seed0/metrics.jsonl")
                     .read_text().splitlines()[-1])["test/acc"]
    assert lines[1].startswith("a-rather-long-run-name-that-a-bar-would-cut seed 0 round 2/2  3 clients  "
                               f"acc {acc:.4f}")
    assert not any("…" in x or "━" in x for x in lines)
    assert "…" not in res.output  # the table wraps what does not fit, it cuts nothing


def test_jobs_runs_the_sweep_in_processes_with_the_serial_numbers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = tiny(**{"server.rounds": 2})
    raw["sweep"] = {"seeds": [0, 1]}
    (tmp_path / "c.toml").write_text(tomli_w.dumps(raw))
    res = runner.invoke(app, ["run", "c.toml", "--jobs", "2", "--set", "run.output_dir=par"])
    assert res.exit_code == 0, res.output
    assert "run 2/2 tiny seed 1 round 2/2" in res.output and "par/tiny/report.md" in res.output
    assert "run 2/2 tiny seed 1: loading data" in res.output  # a worker's phases reach the parent (issue 45)
    assert runner.invoke(app, ["run", "c.toml", "--set", "run.output_dir=ser"]).exit_code == 0

    def rows(root, seed):
        text = (tmp_path / root / "tiny" / f"seed{seed}" / "metrics.jsonl").read_text()
        return [{k: v for k, v in json.loads(x).items() if not k.startswith("time/")} for x in text.splitlines()]

    for seed in (0, 1):
        assert rows("par", seed) == rows("ser", seed)
    # a rerun skips the complete runs in this process, as a serial sweep does, and starts a worker only for the
    # others: none for a complete sweep (a worker takes seconds to start), one here for a run whose last round's
    # status was lost (a fake pool records what it is given)
    import fedsight.parallel

    given = []

    def pool(config, sets, variants, members, jobs, **kw):
        given.append(list(members))
        return [(i, "complete", None) for i in members]

    monkeypatch.setattr(fedsight.parallel, "run_parallel", pool)
    again = runner.invoke(app, ["run", "c.toml", "--jobs", "2", "--set", "run.output_dir=par"])
    assert again.exit_code == 0 and again.output.count("already complete") == 2 and given == []
    status = tmp_path / "par" / "tiny" / "seed1" / "status.json"
    status.write_text(json.dumps({**json.loads(status.read_text()), "state": "stopped"}))
    again = runner.invoke(app, ["run", "c.toml", "--jobs", "2", "--set", "run.output_dir=par"])
    assert again.exit_code == 0 and given == [[1]], again.output
    assert "run 1/2 tiny seed 0: already complete" in again.output and again.output.count("already complete") == 1


@pytest.mark.parametrize("section, key, allowed", [
    ("run", "tensorboardx", "(allowed: checkpoint_keep, mlflow, mlflow_experiment, mlflow_uri, name, output_dir, plots, tensorboard)"),
    ("sweep", "seedz", "(allowed: grid, seeds, share_stages)"),
])
def test_unknown_keys_of_run_and_sweep_list_their_own_allowed_keys(section, key, allowed):
    raw = tiny()
    raw.setdefault(section, {})[key] = 1
    with pytest.raises(ConfigError) as exc:
        expand(raw, "c.toml")
    assert str(exc.value) == f"c.toml: unknown key '{section}.{key}' {allowed}"


def test_a_sections_own_check_is_not_prefixed_with_the_section_twice():
    with pytest.raises(ConfigError) as exc:
        expand(tiny(**{"train.optimizer": "adam", "train.momentum": 0.9}), "c.toml")
    assert str(exc.value).startswith("c.toml: train.momentum = 0.9 with train.optimizer = 'adam'")
