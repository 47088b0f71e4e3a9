"""``fedsight bench``: the plain loop does the engine's work, and the command prints and records every row (no
assertion on speed: tests never time anything). The command runs through the console script's function in this
process (``fuzz_helpers.cli``): a fresh interpreter would add its start-up to each case."""

from __future__ import annotations

import json
import os

import pytest

from fedsight.api import build_simulation
from fedsight.bench import cnn_workload, plain_round
from fedsight.config import validate
from fuzz_helpers import cli
from helpers import close


def test_the_plain_loop_does_what_a_sequential_client_does():
    """Same batches, same SGD: the plain loop's model after client c's round is the global model plus c's delta."""
    raw = cnn_workload(4, 2)
    raw["model"] = {"name": "cnn", "channels": [8], "hidden": 16}
    raw["train"].update(momentum=0.9, weight_decay=1e-3)
    sim = build_simulation(validate({**raw, "engine": {"vectorize": False}}))
    gstate = {k: v.clone() for k, v in sim.global_model.state_dict().items()}
    model = sim.task.build_model()
    for cid in range(4):
        res, _ = sim.runtime.run(1, cid, gstate)
        assert res.num_steps > 0
        plain_round(sim.task, model, gstate, [cid], 1, 0, sim.local)
        for k, p in model.named_parameters():
            close(p, gstate[k] + res.delta[k], atol=1e-6, rtol=1e-5)


def test_bench_prints_and_records_every_engine_and_the_memory_runs(tmp_path):
    out = tmp_path / "bench.json"
    proc = cli(["bench", "-w", "cnn", "--clients", "3", "--rounds", "2", "--no-flower", "--memory-clients", "5,30",
                "--memory-rounds", "1", "--json", str(out)], env={"COLUMNS": "120"})
    assert proc.code == 0, proc.show()
    assert "small CNN on digits: 3 clients a round" in proc.out and "peak RSS" in proc.out
    got = json.loads(out.read_text())
    rows = got["workloads"]["cnn"]
    engines = {(r["engine"], r["threads"]) for r in rows}
    for t in got["threads"]:
        assert {("plain loop", t), ("sequential engine", t), ("vectorised engine", t)} <= engines
    for r in rows:
        assert r["seconds"] > 0 and abs(r["updates_per_s"] - 3 / r["seconds"]) < 1e-9
    assert [m["clients"] for m in got["memory"]] == [5, 30]
    for m in got["memory"]:
        assert m["peak_rss_mb"] > 50 and 1 <= m["with_state"] <= m["clients"]


@pytest.mark.parametrize("args, says", [
    (["-w", "gan"], "error: --workload 'gan': expected one of cnn, sr, paper-cls, paper-seg, paper-sr, paper-vsr, paper-pose"),
    (["--memory-clients", "100,x"], "error: --memory-clients '100,x': expected comma-separated integers"),
    (["--memory-clients", "0"], "error: --memory-clients '0': every count must be >= 1"),
    (["--rounds", "1"], "error: Invalid value for '--rounds': 1 is not in the range x>=2."),
    (["--clients", "0"], "error: Invalid value for '--clients': 0 is not in the range x>=1."),
    (["--device", "tpu"], "error: config: engine.device = 'tpu': expected \"auto\", \"cpu\", \"cuda\" or \"cuda:N\""),
])
def test_bench_refuses_bad_arguments_in_one_line_before_measuring(args, says):
    proc = cli(["bench", "--no-flower", "--no-memory", *args])
    assert proc.code == 2, proc.show()
    assert proc.err.splitlines()[0].startswith(says), proc.show()
    assert proc.out == ""


@pytest.mark.parametrize("kind", ["file", "fifo", "symlink"])
def test_bench_refuses_a_json_path_it_may_not_write_before_measuring(tmp_path, kind):
    """``--json`` passes the output guard of every verb (``fedsight.safe_write``) before minutes of measuring: an
    existing file needs --force, a FIFO or a symbolic link is never written through; nothing is changed."""
    out = tmp_path / "bench.json"
    if kind == "file":
        out.write_text("earlier results\n")
    elif kind == "fifo":
        os.mkfifo(out)
    else:
        (tmp_path / "target.json").write_text("kept\n")
        out.symlink_to(tmp_path / "target.json")
    def snapshot():  # each entry: a link or not, and a regular file's text
        return {p.name: (p.is_symlink(), p.read_text() if p.is_file() and not p.is_symlink() else None)
                for p in tmp_path.iterdir()}

    before = snapshot()
    proc = cli(["bench", "--no-flower", "--no-memory", "--json", str(out)])
    assert proc.code == 2, proc.show()
    line = proc.err.splitlines()[0]
    assert line.startswith("error: --json") and str(out) in line, proc.show()
    assert ("pass --force" in line) == (kind == "file")
    assert proc.out == ""
    assert snapshot() == before


def test_bench_without_flower_says_how_to_get_it(monkeypatch):
    """No flwr: the Flower row says how to install it instead of failing the benchmark."""
    import builtins

    from fedsight.bench import time_flower

    real = builtins.__import__

    def no_flwr(name, *args, **kwargs):
        if name == "flwr" or name.startswith("flwr."):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_flwr)
    row = time_flower(cnn_workload(3, 2), 3)
    assert row.seconds is None and row.note == 'not installed: pip install -c constraints.txt -e ".[flower]"'


def test_every_paper_workload_is_a_valid_config_of_a_paper_model_at_its_papers_size():
    """The paper-* workloads (issue 46): one per task, each a seed paper's model at the size its paper uses."""
    from fedsight.bench import WORKLOADS
    from fedsight.config import validate
    from fedsight.models import build_model
    from fedsight.models.base import ModelIO

    papers = {name: build(4, 2) for name, (_, build, _) in WORKLOADS.items() if name.startswith("paper-")}
    assert sorted(validate(raw).task.name for raw in papers.values()) == sorted(
        ["classification", "segmentation", "image_sr", "video_sr", "keypoints"])
    # torchvision's MobileNetV2 (3,504,872) less its 1000-class head (1,281,000) and 2 of the stem's 3 input channels
    # (576), plus a 10-class head (12,810); EDSR-PyTorch's baseline x2; BasicSR's BasicVSR
    sizes = {"paper-cls": 3_504_872 - 1_281_000 - 576 + 12_810, "paper-sr": 1_369_859, "paper-vsr": 6_291_311}
    for name, count in sizes.items():
        cfg = validate(papers[name])
        task = cfg.task.name
        io = ModelIO(task, in_channels=1 if task == "classification" else 3, num_outputs=10 if task == "classification" else 3,
                     image_size=8, scale=getattr(cfg.data, "scale", None), num_frames=getattr(cfg.data, "num_frames", None))
        model = build_model(cfg.model.name, {k: v for k, v in cfg.model.model_dump().items() if k != "name"}, io=io)
        assert sum(p.numel() for p in model.parameters()) == count, name


def test_the_plain_loop_moves_a_tasks_dict_of_targets_to_the_device():
    """Keypoint batches carry their targets as a dict (heatmaps, weights): the plain loop of paper-pose failed on
    them with "'dict' object has no attribute 'to'"."""
    import torch

    from fedsight.bench import _to

    y = {"heatmaps": torch.zeros(2, 3), "weights": {"joints": torch.ones(2)}, "meta": "kept"}
    moved = _to(y, torch.device("meta"))
    assert moved["heatmaps"].device.type == "meta" and moved["weights"]["joints"].device.type == "meta"
    assert moved["meta"] == "kept" and _to(torch.zeros(1), torch.device("meta")).device.type == "meta"
