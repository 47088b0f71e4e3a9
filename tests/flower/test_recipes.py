"""Every registered recipe part runs over the Flower adapter exactly as in the in-process simulator:
each config below goes through the ServerApp/ClientApp (messages delivered by ``DirectGrid``, each
node with its own client store) and must give bit-identical global tensors and equal metrics rows.

Together with test_adapter.py (SCAFFOLD; personal heads with shared BatchNorm statistics; data-size and
uniform weighting, mean, sgd, global sharing) the configs cover every recipe component (attack, ditto, dwt_loss, elastic, fed3r, fedalt,
feddyn, fedncm, fednova, fedprox, local_adam, oll, pfedme, scaffold), aggregator (krum, mean, median,
trimmed_mean), weighting (data_size, fedvg, fedvsr, uniform), server optimizer (fedadagrad, fedadam,
fedavgm, fedyogi, sgd), parameter sharing (fedbn with client and fresh test statistics, global,
local, personal head/backbone, silobn), frozen groups, temperature and stages, and both tasks."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fedsight.api import execute
from fedsight.config import validate

from flower_direct import run_direct
from helpers import pipeline_config, tiny

pytestmark = pytest.mark.flower

BASE = {"partition.num_clients": 4, "server.clients_per_round": 3, "server.rounds": 2, "eval.every": 1, "engine.threads": 1}

CONFIGS = {
    "feddyn+fedprox+attack, trimmed mean, FedYogi": {
        "recipe.components": ["feddyn", "fedprox", "attack"], "recipe.aggregator": "trimmed_mean", "server.optimizer": "fedyogi"},
    "fednova+local_adam, random local steps, FedAdam": {
        "recipe.components": ["fednova", "local_adam"], "train.steps_range": [2, 5], "train.epochs": None,
        "server.optimizer": "fedadam"},
    "pfedme, krum": {"recipe.components": ["pfedme"], "recipe.aggregator": "krum", "partition.num_clients": 6,
                     "server.clients_per_round": 5},
    "elastic, SiloBN, FedAvgM": {"recipe.components": ["elastic"], "recipe.sharing": "silobn", "model.norm": "batch",
                                "server.optimizer": "fedavgm"},
    "fedalt, personal backbone, FedAdagrad": {"recipe.components": ["fedalt"], "recipe.sharing": {"name": "personal", "part": "backbone"},
                                              "server.optimizer": "fedadagrad"},
    "ditto, FedBN fresh statistics, median": {"recipe.components": ["ditto"], "recipe.sharing": {"name": "fedbn", "test_stats": "fresh"},
                                              "model.norm": "batch", "recipe.aggregator": "median"},
    "FedBN (global test on the clients' mean norm entries)": {"recipe.sharing": "fedbn", "model.norm": "batch"},
    "fedvg weighting (server-held validation set), fedprox": {"recipe.components": ["fedprox"], "recipe.weighting": "fedvg",
                                                             "validation.source": "carve"},
    "fedncm statistics pass": {"recipe.components": ["fedncm"]},
    "stages: fed3r, FT(phi), FedSim, FP, OLL": "pipeline",
    "video SR: fedvsr weighting, dwt_loss": "video",
}


def _pipeline():
    return pipeline_config(**{"engine.threads": 1})


def _video(tmp_path):
    return {
        "seed": 0, "run": {"name": "vsr", "output_dir": str(tmp_path), "checkpoint_keep": 1, "plots": False}, "task": {"name": "video_sr"},
        "data": {"name": "synthetic_video", "sources": ["astronaut", "coffee", "chelsea", "rocket"], "test_sources": ["china"],
                 "clips_per_source": 2, "test_clips_per_source": 2, "clip_length": 5, "frame_size": 48, "scale": 4,
                 "num_frames": 3, "patch_size": 6},
        "partition": {"name": "iid", "num_clients": 4, "local_test_fraction": 0.0},
        "model": {"name": "basicvsr", "channels": 6, "blocks": 1, "flow_channels": 4, "flow_levels": 2},
        "train": {"steps": 2, "batch_size": 2, "lr": 0.05}, "server": {"rounds": 2, "clients_per_round": 2},
        "eval": {"every": 1}, "engine": {"threads": 1},
        "recipe": {"weighting": "fedvsr", "components": [{"name": "dwt_loss", "lambda_hifr": 0.5}]},
    }


def _rows(path):
    # timings differ by nature (time/*, fedvg/score_s); flower/* exist only on Flower
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(("time/", "flower/")) and not k.endswith("_s")}
            for x in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_recipe_over_flower_equals_in_process(name, tmp_path):
    over = CONFIGS[name]
    raw = _pipeline() if over == "pipeline" else _video(tmp_path) if over == "video" else tiny(**{**BASE, **over})
    cfg = validate(raw)
    execute(cfg, tmp_path / "inproc")
    run_direct(cfg, tmp_path / "flower", tmp_path / "nodes")
    a, b = load_file(str(tmp_path / "inproc" / "model.safetensors")), load_file(str(tmp_path / "flower" / "model.safetensors"))
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ra, rb = _rows(tmp_path / "inproc"), _rows(tmp_path / "flower")
    assert len(ra) == len(rb) and ra == rb
    assert not (tmp_path / "flower" / "client_state").exists()
