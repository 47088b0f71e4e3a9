"""Cross-site evaluation (``fedsight evaluate --set data...``, ``--site``): a trained model evaluated on another
data configuration's clients, refused where the data's model inputs or classes differ, and the models x sites
matrix of a sweep, each value equal to a direct evaluation."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from fedsight.api import build_task, execute
from fedsight.crosseval import evaluate_run
from fedsight.cli import app
from fedsight.config import ConfigError, validate
from fedsight.crosseval import evaluate_one, parse_sites
from fedsight.runs import unpack_state

from helpers import tiny

runner = CliRunner()

#: a tiny digits federation that learns something in 3 rounds (about 3 s a run)
BASE = {"server.rounds": 3, "eval.every": 3, "train.epochs": 2, "train.batch_size": 16, "engine.threads": 1,
        "partition.num_clients": 4, "server.clients_per_round": 4, "model.channels": [16], "model.hidden": 32}
#: another site of the same dataset: another train/test split, three clients of another label skew
OTHER = ["data.split_seed=1", "partition.num_clients=3", "partition.alpha=100.0"]


def _raw(overrides: list[str], raw: dict) -> dict:
    """``raw`` with ``--set`` style overrides (what a site makes of a run's config), sampling fitted to it."""
    from fedsight.config import parse_override, set_path

    raw = json.loads(json.dumps(raw))
    for text in overrides:
        path, value = parse_override(text)
        set_path(raw, path, value)
    raw["server"].pop("clients_per_round", None)
    return raw


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> dict[str, Path]:
    """Two trained runs in one folder: FedAvg, and FedBN over a CNN with BatchNorm (per-client statistics)."""
    root = tmp_path_factory.mktemp("xsite") / "sweep"
    runs = {}
    for name, over in (("fedavg", {}), ("fedbn", {"model.norm": "batch", "recipe.sharing": "fedbn"})):
        cfg = validate(tiny(**{**BASE, **over, "run.output_dir": str(root)}))
        runs[name] = execute(cfg, root / name).run_dir
    return runs


def _model(run_dir: Path, task, weights: dict | None = None):
    model = task.build_model()
    model.load_state_dict(weights or load_file(str(run_dir / "model.safetensors")))
    return model.eval()


def _local(task, model) -> tuple[dict[str, float], float]:
    """Each client's local-test accuracy and their example-weighted mean (WMA), computed directly."""
    accs, ns = {}, {}
    for c in range(task.num_clients):
        if task.num_test_examples(c):
            accs[str(c)], ns[str(c)] = task.evaluate(model, c)["acc"], task.num_test_examples(c)
    return accs, sum(accs[c] * ns[c] for c in accs) / sum(ns.values())


def test_a_model_is_evaluated_on_another_sites_clients(sweep):
    """The FedAvg model on another split and partition of digits: test/acc is the model's accuracy on that
    site's global test set and local/* are over the site's three clients, exactly as evaluated directly; the
    row appended says what was set and that the global model stood for every client."""
    run = sweep["fedavg"]
    checked, ev = evaluate_one(run, OTHER)
    site = build_task(validate(_raw(OTHER, json.loads((run / "config.json").read_text()))))
    model = _model(run, site)
    assert site.num_clients == 3 and not checked.own_clients
    assert ev.metrics["test/acc"] == pytest.approx(site.evaluate(model, "test")["acc"], abs=1e-12)
    accs, wma = _local(site, model)
    assert {c: m["acc"] for c, m in ev.clients.items()} == pytest.approx(accs, abs=1e-12)
    assert ev.metrics["local/wma"] == pytest.approx(wma, abs=1e-12)
    own = build_task(validate(json.loads((run / "config.json").read_text())))
    assert site.evaluate(model, "test")["acc"] != own.evaluate(model, "test")["acc"]  # another test set indeed
    row = json.loads((run / "evaluations.jsonl").read_text().splitlines()[-1])
    assert row["set"] == {"data.split_seed": 1, "partition.num_clients": 3, "partition.alpha": 100.0}
    assert row["clients"] == "global model only" and row["test/acc"] == ev.metrics["test/acc"]
    r, metrics = evaluate_run(run, OTHER)  # the Python API: the same numbers
    assert r == 3 and metrics == ev.metrics


def test_the_runs_own_data_named_again_is_the_runs_own_evaluation(sweep):
    """Site keys that resolve to the run's own data (the default split_seed, set explicitly) keep the run's
    clients and their state: the FedBN run's last evaluation, number for number."""
    run = sweep["fedbn"]
    checked, ev = evaluate_one(run, ["data.split_seed=0"])
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert checked.own_clients
    for key in ("test/acc", "local/wma", "local/worst10"):
        assert ev.metrics[key] == pytest.approx(last[key], abs=1e-12), key


def test_fedbn_on_another_site_uses_the_run_clients_average_statistics(sweep):
    """Per-client state belongs to the run's clients: on another site every split is evaluated with the global
    model whose BatchNorm entries are the example-weighted average over the run's four clients (weights: their
    training examples in the run, from partition.json), never with a run client's own entries."""
    run = sweep["fedbn"]
    _, ev = evaluate_one(run, OTHER)
    counts = np.asarray(json.loads((run / "partition.json").read_text())["client_label_counts"]).sum(axis=1)
    files = sorted((run / "client_state" / "personal").glob("*.safetensors"))
    assert len(files) == len(counts) == 4
    weights = load_file(str(run / "model.safetensors"))
    entries = [load_file(str(f)) for f in files]
    for k in entries[0]:
        if entries[0][k].is_floating_point():
            avg = sum(float(n) * e[k].double() for n, e in zip(counts, entries)) / float(counts.sum())
            weights[k] = avg.to(weights[k].dtype)
    site = build_task(validate(_raw(OTHER, json.loads((run / "config.json").read_text()))))
    model = _model(run, site, weights)
    assert ev.metrics["test/acc"] == pytest.approx(site.evaluate(model, "test")["acc"], abs=1e-12)
    accs, wma = _local(site, model)
    assert {c: m["acc"] for c, m in ev.clients.items()} == pytest.approx(accs, abs=1e-12)
    assert ev.metrics["local/wma"] == pytest.approx(wma, abs=1e-12)


def _tree(root: Path, classes, per_class: int = 6) -> Path:
    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(root / name / f"{i}.png")
    return root


@pytest.mark.parametrize("classes, extra, says", [
    ("abc", ["data.channels=1"], "has 3 classes (a, b, c), the model 10 (0, 1, 2, 3, 4, 5, ... (10))"),
    ("abcdefghij", ["data.channels=1"], "names its classes otherwise: class 0 is 'a', the model's '0'"),
    ([str(i) for i in range(10)], [], "has 3 input channels, the model 1"),
    ([str(i) for i in range(10)], ["data.channels=1", "data.image_size=16"], "has 16x16 images, the model 8x8"),
])
def test_data_whose_inputs_or_classes_differ_from_the_models_is_refused(sweep, tmp_path, classes, extra, says):
    """Another dataset whose classes (their number or names), channels or image size differ from what the model
    was trained on: one error naming the keys set, the two datasets and what differs; nothing written."""
    run = sweep["fedavg"]
    tree = _tree(tmp_path / "tree", classes)
    before = (run / "evaluations.jsonl").read_bytes() if (run / "evaluations.jsonl").exists() else None
    sets = ["data.name=imagefolder", f"data.train_dir={tree}", "data.image_size=8", "data.test_fraction=0.5", *extra,
            "partition.num_clients=2"]
    with pytest.raises(ConfigError) as err:
        evaluate_run(run, sets)
    msg = str(err.value)
    assert msg.startswith("--set data.name, data.train_dir, data.image_size") and "partition" not in msg.split(":")[0]
    assert "the site's data (imagefolder)" in msg and says in msg and "trained on digits" in msg, msg
    assert "\n" not in msg
    after = (run / "evaluations.jsonl").read_bytes() if (run / "evaluations.jsonl").exists() else None
    assert after == before


def test_a_sweep_times_two_sites_matrix_equals_direct_evaluations(sweep, tmp_path, monkeypatch):
    """``fedsight evaluate SWEEP --site own --site other:...``: every run's model on every site, written as
    Markdown, CSV and JSON with provenance; each value is the one a direct evaluation of that run on that site
    gives, and each evaluation is appended to its run's evaluations.jsonl."""
    monkeypatch.chdir(tmp_path)
    folder = sweep["fedavg"].parent
    sites = ["--site", "own", *[a for o in OTHER for a in ("--site", f"other:{o}")]]
    lines = {name: len((run / "evaluations.jsonl").read_text().splitlines()) if (run / "evaluations.jsonl").exists()
             else 0 for name, run in sweep.items()}
    again = os.path.relpath(sweep["fedavg"])  # the FedAvg run named twice, the second time by a relative path
    res = runner.invoke(app, ["evaluate", str(folder), again, *sites, "--out", "xe"])
    assert res.exit_code == 0, res.output
    with open("xe/crosseval.csv") as fh:
        table = {(r["run"], r["site"], r["client"], r["metric"]): float(r["value"]) for r in csv.DictReader(fh)}
    assert len(table) == 2 * 2 * 2 + 2 * (4 + 3)  # runs x sites x (test/acc, local/wma), runs x clients of the sites
    for name, run in sweep.items():
        for site, sets in (("own", []), ("other", OTHER)):
            _, ev = evaluate_one(run, sets)
            assert table[name, site, "", "test/acc"] == ev.metrics["test/acc"], (name, site)
            assert table[name, site, "", "local/wma"] == ev.metrics["local/wma"], (name, site)
            for c, values in ev.clients.items():  # each client of each site, a site of its own
                assert table[name, site, c, "local/acc"] == values["acc"], (name, site, c)
        rows = [json.loads(x) for x in (run / "evaluations.jsonl").read_text().splitlines()[lines[name]:]]
        assert [(r["site"], r["clients"]) for r in rows[:2]] == [("own", "own"), ("other", "global model only")]
    md = Path("xe/crosseval.md").read_text()
    assert "| model \\ site | own | other |" in md and "## Provenance of the runs" in md and "FedSight commit" in md
    assert "`data.split_seed=1`, `partition.num_clients=3`" in md
    assert "| model \\ client | own 0 | own 1 | own 2 | own 3 | other 0 | other 1 | other 2 |" in md
    data = json.loads(Path("xe/crosseval.json").read_text())
    assert data["headline"] == "test/acc" and len(data["evaluations"]) == 4
    assert sorted(data["evaluations"][1]["client_metrics"]) == ["0", "1", "2"]


def test_a_refused_site_in_a_matrix_writes_nothing(sweep, tmp_path, monkeypatch):
    """Every (run, site) is checked before any is evaluated: a site of other classes stops the matrix with one
    line (exit 2), and neither the runs nor --out get anything, not even the runs' own-data cells."""
    monkeypatch.chdir(tmp_path)
    tree = _tree(tmp_path / "tree", "abc")
    before = {n: (r / "evaluations.jsonl").read_bytes() if (r / "evaluations.jsonl").exists() else None
              for n, r in sweep.items()}
    bad = ["data.name=imagefolder", f"data.train_dir={tree}", "data.image_size=8", "data.channels=1"]
    res = runner.invoke(app, ["evaluate", str(sweep["fedavg"].parent), "--site", "own",
                              *[a for o in bad for a in ("--site", f"abc:{o}")], "--out", "xe"])
    assert res.exit_code == 2 and "has 3 classes" in res.output and "site abc" in res.output, res.output
    assert not Path("xe").exists()
    assert before == {n: (r / "evaluations.jsonl").read_bytes() if (r / "evaluations.jsonl").exists() else None
                      for n, r in sweep.items()}


def test_the_matrix_goes_to_crosseval_by_default_and_replaces_its_files_only_with_force(sweep, tmp_path, monkeypatch):
    """``--out`` defaults to ``crosseval/``; a second matrix into it is refused (one line, exit 2, the files as they
    were) until ``--force``."""
    monkeypatch.chdir(tmp_path)
    args = ["evaluate", str(sweep["fedavg"].parent), "--site", "own"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    before = {p.name: p.read_bytes() for p in Path("crosseval").iterdir()}
    assert {"crosseval.md", "crosseval.csv", "crosseval.json"} <= set(before)
    res = runner.invoke(app, args)
    assert res.exit_code == 2 and "--force" in res.output, res.output
    assert {p.name: p.read_bytes() for p in Path("crosseval").iterdir()} == before
    res = runner.invoke(app, [*args, "--force"])
    assert res.exit_code == 0, res.output


def test_site_data_that_cannot_be_loaded_is_one_error_naming_the_keys(sweep, tmp_path):
    with pytest.raises(ConfigError, match=r"^--set data.name, data.train_dir: the site's data \(imagefolder\): image "
                                          r"folder '.*nowhere' does not exist$"):
        evaluate_run(sweep["fedavg"], ["data.name=imagefolder", f"data.train_dir={tmp_path / 'nowhere'}"])


@pytest.mark.parametrize("text", ["seed=1", "train.lr=0.5", "model.hidden=8", "pretrain.epochs=3", "pretrain.weights=w"])
def test_what_made_the_model_stays_refused(sweep, text):
    """The seed, the model, training and the pre-training's own settings made the model: still refused, with
    the data keys now named among what may change."""
    with pytest.raises(ConfigError, match=rf"^--set {text.split('=')[0]}: changes what was trained; .* and the data "
                                          r"it evaluates on \(data, partition, validation, pretrain.source"):
        evaluate_run(sweep["fedavg"], [text])


@pytest.mark.parametrize("text", ["data.split_seed=1", "o th:data.split_seed=1", "other:split_seed", ":x=1"])
def test_a_malformed_site_is_one_error(text):
    with pytest.raises(ConfigError, match="--site"):
        parse_sites([text])


def test_the_selected_best_model_is_evaluated_when_the_run_has_one(sweep):
    """``--model best`` evaluates RUN_DIR/best.safetensors (the global model eval.select = "best" keeps), here
    round 1's global model written there by hand; a run without one is told so, and nothing is written."""
    run = sweep["fedavg"]
    before = (run / "evaluations.jsonl").read_bytes() if (run / "evaluations.jsonl").exists() else None
    with pytest.raises(FileNotFoundError, match="best.safetensors"):
        evaluate_run(run, model="best")
    assert before == ((run / "evaluations.jsonl").read_bytes() if (run / "evaluations.jsonl").exists() else None)
    marker = json.loads((run / "checkpoints" / "round-000001.json").read_text())
    round1 = unpack_state(marker["state"], load_file(str(run / "checkpoints" / "round-000001.safetensors")))["model"]
    save_file({k: v.contiguous() for k, v in round1.items()}, str(run / "best.safetensors"))
    (run / "best.json").write_text(json.dumps({"round": 1, "metric": "val/acc"}))
    try:
        r, metrics = evaluate_run(run, model="best")
    finally:
        (run / "best.safetensors").unlink()
        (run / "best.json").unlink()
    assert r == 1  # the round it was selected at (best.json)
    task = build_task(validate(json.loads((run / "config.json").read_text())))
    assert metrics["test/acc"] == pytest.approx(task.evaluate(_model(run, task, round1), "test")["acc"], abs=1e-12)
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert metrics["test/acc"] != last["test/acc"]  # round 1's model, not the last
    row = json.loads((run / "evaluations.jsonl").read_text().splitlines()[-1])
    assert row["model"] == "best" and row["clients"] == "global model only"


@pytest.mark.parametrize("task, sets, says", [
    ("image_sr", ["data.scale=4"], "has an upscaling factor of 4, the model 2"),
    ("video_sr", ["data.num_frames=3"], "has 3 frames per clip, the model 2"),
    ("keypoints", ["data.data_seed=1"], None),  # other figures, the same 16 MPII joints: a site of its own
])
def test_other_tasks_compare_scale_frames_and_joints(tmp_path, task, sets, says):
    """SR and video SR refuse a site of another upscaling factor or clip length; keypoint data generated from
    another seed keeps the model's joints and is accepted as another site. Checked from the run's config alone,
    before any checkpoint is read."""
    from fedsight.api import resolved
    from fedsight.crosseval import check
    from fedsight.runs import RunDir
    from test_conformance import TASKS

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(resolved(validate(TASKS[task]))))
    if says is None:
        checked = check(RunDir(run), sets)
        assert not checked.own_clients and len(checked.run_task.skeleton.joint_names) == 16
        return
    with pytest.raises(ConfigError, match=f"^--set {sets[0].split('=')[0]}: the site's data .*{says}"):
        evaluate_run(run, sets)
    assert not (run / "evaluations.jsonl").exists()


def test_the_documented_commands_run_as_written(tmp_path, monkeypatch):
    """docs/evaluation.md's commands and its Python example on the quickstart (shrunk to one round of four clients),
    with a folder of digit images as site_b: each exits 0 (the commands on a run of another kind, RUN_DIR, are
    run elsewhere: tests/segmentation/test_feddrive.py)."""
    import re
    import shlex

    docs = (Path(__file__).resolve().parents[1] / "docs" / "evaluation.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```\n(.*?)```", docs, re.S)
    commands = [line.split("  #")[0] for b in blocks for line in b.splitlines()
                if line.startswith("fedsight evaluate") and "RUN_DIR" not in line]
    assert len(commands) == 4
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").mkdir()
    quickstart = Path(__file__).resolve().parents[1] / "examples" / "quickstart.toml"
    (tmp_path / "examples" / "quickstart.toml").write_text(quickstart.read_text())
    shrink = ["server.rounds=1", "sweep.seeds=[0]", "partition.num_clients=6", "server.clients_per_round=6",
              "train.epochs=1", "eval.initial=false", "run.plots=false", "engine.threads=1"]
    res = runner.invoke(app, ["run", "examples/quickstart.toml", *[a for s in shrink for a in ("--set", s)]])
    assert res.exit_code == 0, res.output
    _tree(tmp_path / "site_b", [str(d) for d in range(10)])
    for line in commands:
        res = runner.invoke(app, shlex.split(line)[1:])
        assert res.exit_code == 0, (line, res.output)
    python = re.search(r"```python\n(.*?)```", docs, re.S).group(1)
    exec(compile(python, "docs/evaluation.md", "exec"), {"__name__": "docs"})
    assert (tmp_path / "crosseval" / "crosseval.md").is_file()
