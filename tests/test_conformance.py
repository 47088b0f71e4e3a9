"""Conformance: every registered model passes one generic test, every task runs a round with every
recipe part it is compatible with, and every incompatible pair is refused at config time, naming both
sides. New models, tasks and parts are picked up from the registries automatically."""

from __future__ import annotations

import copy
import math
import re
import typing
from typing import Any

import pytest
import torch
from torch import nn

from fedsight import registry as R
from fedsight.api import build_simulation
from fedsight.capabilities import resolve
from fedsight.config import ConfigError, set_path, validate
from fedsight.models.base import FedModel, ModelIO, detect_capabilities, load_weights, norm_keys, save_weights

from helpers import tiny


def builtin(registry: R.Registry[Any]) -> list[str]:
    """Registered names that ship with FedSight (other test modules register their own parts too)."""
    return [e.name for e in registry.entries() if getattr(e.factory, "__module__", "").startswith("fedsight.")]


# -- every model --------------------------------------------------------------------------------------------

#: per task family: the ModelIO a factory gets, an input batch and the expected output shape
FAMILIES: dict[str, tuple[ModelIO, Any, tuple[int, ...]]] = {
    "classification": (ModelIO("classification", in_channels=3, num_outputs=5, image_size=16),
                       lambda: torch.randn(2, 3, 16, 16), (2, 5)),
    "image_sr": (ModelIO("image_sr", in_channels=3, num_outputs=3, scale=2), lambda: torch.rand(2, 3, 8, 8), (2, 3, 16, 16)),
    "video_sr": (ModelIO("video_sr", in_channels=3, num_outputs=3, scale=2, num_frames=3),
                 lambda: torch.rand(1, 3, 3, 8, 8), (1, 3, 3, 16, 16)),
    "segmentation": (ModelIO("segmentation", in_channels=3, num_outputs=5),
                     lambda: torch.randn(2, 3, 32, 48), (2, 5, 32, 48)),
    # heatmaps at H/4; 64x48 is a multiple of ViTPose's patch 16 but not of SimpleBaseline's stride 32
    "keypoints": (ModelIO("keypoints", in_channels=3, num_outputs=4), lambda: torch.rand(2, 3, 64, 48), (2, 4, 16, 12)),
}


#: models whose default is a paper-size network too slow for every run of the suite: each of their variants also
#: runs at this small size (the same classes) always, the paper size under the slow flag only (SIBLING_CASES;
#: their published keys and shapes are checked on the meta device by their own tests)
SMALL_SIZE: dict[str, dict[str, Any]] = {
    "basicvsr_basicsr": {"num_feat": 8, "num_block": 1, "hr_feat": 8, "spynet_hidden": [4, 4, 4, 4]},
    "vitpose_s": {"dim": 16, "depth": 2, "heads": 2, "deconv_filters": 8},
    "vitpose_b": {"dim": 16, "depth": 1, "heads": 1, "head": "simple"},
    "rvrt": {"embed_dims": (8, 8, 8), "num_heads": (2, 2, 2), "num_blocks": (1, 1, 1), "window_size": (2, 4, 4),
             "deformable_groups": 4, "attention_heads": 2, "spynet_hidden": (4, 4, 4, 4)},
}


def variants(name: str) -> list[dict[str, Any]]:
    """The model's default parameters and, for a model with a ``norm`` choice, each choice."""
    field = R.MODELS.get(name).params.model_fields.get("norm")
    if field is None:
        return [{}]
    return [{"norm": c} for c in typing.get_args(field.annotation)]


MODEL_CASES = [(n, v) for n in builtin(R.MODELS) for v in variants(n)]
PAPER_SIZE = {(n, str(v)) for n, v in MODEL_CASES if n in SMALL_SIZE}
MODEL_CASES += [(n, {**SMALL_SIZE[n], **v}) for n, v in MODEL_CASES if n in SMALL_SIZE]
#: cases whose code another case runs at a smaller size (a deeper or wider sibling: the same classes), checked
#: with the suite's slow flag only; tests/models/test_weights.py loads every one of them
SIBLING_CASES = {("vit_b16", "{}"), ("resnet34_imagenet", "{'norm': 'batch'}"), ("resnet34_imagenet", "{'norm': 'group'}"),
                 ("resnet50_imagenet", "{'norm': 'group'}")} | PAPER_SIZE
#: and the CIFAR ResNet-18 (11M parameters; in float64 among the costliest vectorised cases), whose classes (``ResNet``
#: of BasicBlock stages) resnet8 runs at each norm
SIBLING_CASES |= {("resnet18", "{'norm': 'batch'}"), ("resnet18", "{'norm': 'group'}")}


def model_params(cases: list[tuple[str, dict]]) -> list[Any]:
    """``cases`` as pytest parameters (id ``name-params``), the sibling cases marked slow."""
    return [pytest.param(i, id=f"{n}-{v}", marks=[pytest.mark.slow] if (n, str(v)) in SIBLING_CASES else [])
            for i, (n, v) in enumerate(cases)]


def test_every_builtin_model_family_has_a_conformance_entry():
    assert {R.MODELS.get(n).task_family for n in builtin(R.MODELS)} <= set(FAMILIES)


@pytest.mark.parametrize("case", model_params(MODEL_CASES))
def test_model_conformance(case, tmp_path):
    name, params = MODEL_CASES[case]
    entry = R.MODELS.get(name)
    io, make_input, out_shape = FAMILIES[entry.task_family]
    p = entry.params(**params)
    torch.manual_seed(0)
    model = R.build(R.MODELS, name, p, io=io)
    assert isinstance(model, FedModel)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    x = make_input()
    out = model(x)
    # training mode: the output, or (segmentation) a tuple of the main output and auxiliary ones, same shape
    outs = out if isinstance(out, tuple) else (out,)
    assert all(tuple(o.shape) == out_shape and torch.isfinite(o).all() for o in outs)
    # parameter groups: state keys; every parameter in exactly one of backbone / head; norm by module type
    state = model.state_dict()
    groups = model.parameter_groups()
    assert set(groups) >= {"backbone", "head", "norm"}
    for g in groups.values():
        assert set(g) <= set(state)
    params_ = {k for k, _ in model.named_parameters()}
    bb, hd = set(groups["backbone"]) & params_, set(groups["head"]) & params_
    assert bb | hd == params_ and not bb & hd and hd
    assert sorted(groups["norm"]) == sorted(k for k in norm_keys(model) if k in state)
    # the registry's declared capabilities are the built model's
    assert resolve(entry.provides, p) == detect_capabilities(model)
    # blocks: disjoint sets of state keys
    blocks = model.blocks()
    seen: set[str] = set()
    for keys in blocks.values():
        assert set(keys) <= set(state) and not seen & set(keys)
        seen |= set(keys)
    # initialisation is a function of the seed
    torch.manual_seed(0)
    again = R.build(R.MODELS, name, p, io=io).state_dict()
    assert all(torch.equal(init[k], again[k]) for k in init)
    # every trainable parameter gets a finite gradient (from the main and any auxiliary outputs)
    sum(o.float().pow(2).mean() for o in outs).backward()
    for k, prm in model.named_parameters():
        assert prm.grad is not None and torch.isfinite(prm.grad).all(), k
    # evaluation mode: the main output alone
    model.eval()
    with torch.no_grad():
        assert tuple(model(x).shape) == out_shape
    # weights round-trip through safetensors
    save_weights(model, tmp_path / "m.safetensors")
    torch.manual_seed(1)
    other = R.build(R.MODELS, name, p, io=io)
    load_weights(other, tmp_path / "m.safetensors")
    assert all(torch.equal(state[k], v) for k, v in other.state_dict().items())


# -- every task x every recipe part --------------------------------------------------------------------------

VIDEO: dict[str, Any] = {
    "seed": 0, "run": {"name": "v", "checkpoint_keep": 1}, "task": "video_sr",
    "data": {"name": "synthetic_video", "sources": ["astronaut", "coffee"], "test_sources": ["chelsea"],
             "clips_per_source": 4, "test_clips_per_source": 1, "clip_length": 3, "frame_size": 24, "scale": 2,
             "num_frames": 2, "patch_size": 6},
    "partition": {"name": "iid", "num_clients": 6, "local_test_fraction": 0.0},
    "model": {"name": "sliding_vsr", "channels": 4, "blocks": 1},
    "train": {"steps": 1, "batch_size": 2, "lr": 0.05}, "server": {"rounds": 1, "clients_per_round": 5},
    "engine": {"threads": 1},
}
IMAGE: dict[str, Any] = {
    "seed": 0, "run": {"name": "i", "checkpoint_keep": 1}, "task": "image_sr",
    "data": {"name": "builtin_sr", "sources": ["chelsea", "coffee"], "tile": 64, "train_max_side": 192, "scale": 2,
             "patch_size": 8, "test_max_side": 48},
    "partition": {"name": "iid", "num_clients": 6, "local_test_fraction": 0.0},
    "model": {"name": "edsr", "features": 8, "blocks": 1},
    "train": {"steps": 1, "batch_size": 2, "lr": 0.05}, "server": {"rounds": 1, "clients_per_round": 5},
    "engine": {"threads": 1},
}
KEYPOINTS: dict[str, Any] = {
    "seed": 0, "run": {"name": "k", "checkpoint_keep": 1},
    "task": {"name": "keypoints", "ladder": [[32, 24], [16, 12]], "eval_sizes": [[32, 24]], "flip_test": False},
    "data": {"name": "builtin_pose", "num_train": 12, "num_test": 2, "image_size": [64, 48]},
    "partition": {"name": "iid", "num_clients": 6, "local_test_fraction": 0.0},
    # (two blocks: the second with stochastic depth, which draws random numbers in training)
    "model": {"name": "vitpose", "patch": 4, "dim": 8, "depth": 2, "heads": 1, "deconv_filters": 4, "drop_path": 0.3},
    "train": {"steps": 1, "batch_size": 2, "lr": 0.05}, "server": {"rounds": 1, "clients_per_round": 5},
    "engine": {"threads": 1},
}
SEGMENTATION: dict[str, Any] = {
    "seed": 0, "run": {"name": "s", "checkpoint_keep": 1}, "task": {"name": "segmentation", "crop": [24, 40]},
    "data": {"name": "street", "towns": ["suburb", "rural"], "conditions": ["clear-day", "rain-day"],
             "cameras": ["car"], "per_domain": 6, "height": 32, "width": 48},
    "partition": {"name": "iid", "num_clients": 6, "local_test_fraction": 0.0},
    "model": {"name": "bisenetv2", "width": 0.25, "head_channels": 16, "aux_channels": 8},
    "train": {"steps": 1, "batch_size": 2, "lr": 0.05}, "server": {"rounds": 1, "clients_per_round": 5},
    "engine": {"threads": 1},
}

TASKS = {
    "classification": tiny(**{"server.rounds": 1, "server.clients_per_round": 5, "model.norm": "batch",
                              "engine.threads": 1, "eval.every": 1}),
    "video_sr": VIDEO,
    "image_sr": IMAGE,
    "segmentation": SEGMENTATION,
    "keypoints": KEYPOINTS,
}
for _raw in TASKS.values():  # round 0 only where a test asks for it (every part evaluates the initial model)
    set_path(_raw, ["eval", "initial"], False)

#: what a part needs besides itself to be meaningful (not capabilities: its own documented setup)
COMPANIONS: dict[str, dict[str, Any]] = {
    "fedalt": {"recipe.sharing": {"name": "personal", "part": "head"}},
    "fedvg": {"validation.source": "carve", "validation.fraction": 0.2},
    "krum": {"recipe.aggregator": {"name": "krum", "byzantine": 1}},
    "fed3r": {"eval.local": False},
    # a few source steps show the part runs; its defaults (100 a round) only cost the suite's time
    "source_pretrain": {"recipe.components": [{"name": "source_pretrain", "steps": 4, "steps_per_round": 2,
                                               "batch_size": 2}]},
    "norm_bound": {"recipe.components": [{"name": "norm_bound", "quantile": 0.5}]},
    "dp_sgd": {"recipe.components": [{"name": "dp_sgd", "noise_multiplier": 0.5}]},
    "watermark": {"recipe.components": [{"name": "watermark", "p": 0.5, "min_carriers": 100}]},
}

#: LADD's parts run after a styles stage (the clusters) on a task with a labelled source set, two rounds (in the
#: second, the clusters' entries differ from the global ones)
STYLES_FIRST = {"stages": [{"name": "styles", "rounds": 1, "recipe": {"components": ["client_styles"]}},
                           {"name": "part", "rounds": 2}], "server.rounds": 3,
                "task.source": {"name": "street", "towns": ["downtown"], "conditions": ["clear-day"],
                                "cameras": ["car"], "per_domain": 4, "height": 32, "width": 48, "setting": "none"}}
STAGED = {"source_pretrain": STYLES_FIRST, "self_training": STYLES_FIRST, "cluster_aggregation": STYLES_FIRST}
#: clients aggregated in the part's round when not the 5 sampled: a statistics pass hears every client, a
#: server-only round none
AGGREGATED = {"client_styles": 6, "source_pretrain": 0}

SLOTS = {"weighting": R.WEIGHTINGS, "aggregator": R.AGGREGATORS, "sharing": R.SHARING, "optimizer": R.SERVER_OPTIMIZERS,
         "component": R.COMPONENTS}


def part_config(task: str, slot: str, name: str, initial: bool = False) -> dict[str, Any]:
    """TASKS[task] with the part in its slot and its companions; ``initial``: evaluate round 0."""
    raw = copy.deepcopy(TASKS[task])
    set_path(raw, ["eval", "initial"], initial)
    key = {"component": "recipe.components", "optimizer": "server.optimizer"}.get(slot, f"recipe.{slot}")
    set_path(raw, key.split("."), [name] if slot == "component" else name)
    for k, v in COMPANIONS.get(name, {}).items():
        set_path(raw, k.split("."), v)
    if task == "segmentation":
        for k, v in STAGED.get(name, {}).items():
            set_path(raw, k.split("."), copy.deepcopy(v))
    return raw


CASES = [(t, s, n) for t in TASKS for s, reg in SLOTS.items() for n in builtin(reg)]


@pytest.mark.parametrize("task,slot,name", CASES, ids=[f"{t}-{s}-{n}" for t, s, n in CASES])
def test_every_part_runs_a_round_or_is_refused_at_config_time(task, slot, name):
    raw = part_config(task, slot, name, initial=True)
    try:
        cfg = validate(raw)
    except ConfigError as exc:
        # refused before anything is built, naming the part and what does not provide what it needs
        msg = str(exc)
        assert repr(name) in msg and " needs " in msg, msg
        assert f"task {task!r}" in msg or "model " in msg or "validation.source" in msg, msg
        return
    rows = []
    sim = build_simulation(cfg)
    sim.run(on_round=lambda r, row, events: rows.append((row, events)))
    row, events = rows[-1]  # the part's round (after a preparing stage, if any)
    assert len(rows) == cfg.server.rounds + 1 and rows[0][0]["round"] == 0  # round 0: the initial model
    primary = "test/" + sim.task.primary_metric
    assert math.isfinite(rows[0][0][primary]), rows[0][0]
    assert not [e for e in events if e["event"] in ("rejected_update", "round_skipped")], events
    assert math.isfinite(row[primary]) and row["clients/aggregated"] == AGGREGATED.get(name, 5)


TRAINING_CASES = [c for c in CASES if c[1] in ("component", "sharing", "aggregator")]

#: The segmentation model of the vectorised-against-sequential comparison normalises with GroupNorm: with BatchNorm
#: over batches of two 24x40 crops (the stride-32 maps are 1x2, so each channel is normalised over 4 values) the
#: gradient amplifies rounding a thousandfold. Measured after the one step of lr 0.05: the two engines' weights
#: differed by 3e-5..1e-4 with BatchNorm on this CPU's AVX-512 kernels, and by 8e-4 (median) and 1.8e-2 (SCAFFOLD's
#: c_i, scaled by 1/lr) with torch's AVX2 kernels and oneDNN at AVX2 (ATEN_CPU_CAPABILITY=avx2
#: ONEDNN_MAX_CPU_ISA=AVX2, as on an AVX2-only CPU) or its scalar ones (ATEN_CPU_CAPABILITY=default). With GroupNorm
#: they differ by 3e-8..2e-7 (a float32 ulp or two of the weights) on each of these kernels: at most 0.06% of the
#: tolerance below (local_adam, whose tolerance is its rate: 1.7%), so it holds on any CPU while a vectorised step
#: 2% too long already fails it (three times over for the median, five for SCAFFOLD's c_i).
#: Kept on BatchNorm: parts that need its running statistics (refused with GroupNorm at config time); for them
#: BatchNorm's differences reached at most half the tolerance on the kernel paths above (0.51 of it, silobn with
#: the scalar kernels). ``dct_dp`` runs on GroupNorm too (1.2e-7 on each kernel path; 1.5e-4 with BatchNorm): its
#: step runs under vmap, which once got start stacks laid out for the fused forward and failed in GroupNorm
#: (``tests/test_vectorized.py::test_group_norm_trains_under_vmap_from_stacks_laid_out_for_the_fused_forward``).


#: pairs that train only vectorised, with what the config-time refusal of sequential training says: Opacus's
#: per-sample gradients of a video model, which folds a clip's frames into the batch, would be per frame
#: (``FedModel.folds_batch``); trained vectorised, each clip's gradient is its own
VECTORISED_ONLY = {("video_sr", "component", "dp_sgd"): "folds a clip's frames into the batch"}


def training_config(task: str, slot: str, name: str, **engine: Any) -> Any:
    """The validated config of the vectorised comparison (``part_config``; segmentation on GroupNorm where the
    part takes it)."""
    raw = part_config(task, slot, name)
    for k, v in engine.items():
        set_path(raw, ["engine", k], v)
    if task == "segmentation":
        grouped = copy.deepcopy(raw)
        set_path(grouped, ["model", "norm"], "group")
        try:
            return validate(grouped)
        except ConfigError:
            pass  # (needs BatchNorm's running statistics: silobn)
    return validate(raw)


@pytest.mark.parametrize("task,slot,name", TRAINING_CASES, ids=[f"{t}-{s}-{n}" for t, s, n in TRAINING_CASES])
def test_every_part_trains_vectorised_as_sequentially_or_says_why(task, slot, name, monkeypatch):
    """Each part that shapes local training or reads the uploads, on every task, with the round's clients trained
    together (``engine.vectorize = "auto"``, forced on this CPU): the global model, the run's facts and every
    client's kept state are what sequential training leaves, or the stage says why it trained one client at a time
    (a local procedure of its own, a component without a vectorised step)."""
    import fedsight.build as A

    if (task, slot, name) in VECTORISED_ONLY:  # (refused one at a time before anything runs; trains together)
        with pytest.raises(ConfigError, match=re.escape(VECTORISED_ONLY[task, slot, name])):
            training_config(task, slot, name)
        vec, rows = build_simulation(training_config(task, slot, name, vectorize=True)), []
        vec.run(on_round=lambda r, row, events: rows.append(row))
        assert vec.runtime.vectorizes(5) and math.isfinite(rows[-1]["test/" + vec.task.primary_metric])
        return
    try:
        cfg = training_config(task, slot, name)
    except ConfigError:
        return  # (refused at config time: the test above)
    seq = build_simulation(cfg)
    monkeypatch.setattr(A, "vectorize_mode", lambda setting, device: "auto")
    vec = build_simulation(cfg)
    monkeypatch.undo()
    seq.run()
    vec.run()
    if vec.runtime.sequential_reasons:
        assert any(f"'{name}'" in r for r in vec.runtime.sequential_reasons), vec.runtime.sequential_reasons
        return
    assert vec.runtime.vectorizes(5)
    # (Adam divides by the root of its second moment: a parameter the loss does not reach, a convolution's bias
    # before BatchNorm, gets steps of the rate from gradients of rounding noise, in either engine differently)
    atol = cfg.train.lr if name == "local_adam" else 2e-4

    def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str, scale: float = 1.0) -> None:
        assert a.keys() == b.keys(), what
        for k in a:
            if a[k].is_floating_point():
                torch.testing.assert_close(b[k], a[k], atol=atol * scale, rtol=1e-3, msg=lambda m: f"{what} {k}: {m}")
            else:
                assert torch.equal(a[k], b[k]), f"{what} {k}"

    same(seq.global_model.state_dict(), vec.global_model.state_dict(), "global model")
    same(dict(seq.server.facts), dict(vec.server.facts), "fact")
    assert seq.store.keys() == vec.store.keys()
    for key in seq.store.keys():
        assert seq.store.clients(key) == vec.store.clients(key), key
        for c in seq.store.clients(key):  # (SCAFFOLD's c_i divides a model difference by K lr: K = 1 step here)
            same(seq.store.get(key, c), vec.store.get(key, c), f"client {c}'s {key}", 1 / cfg.train.lr)


#: pairs that must be refused: the capability machinery's reason to exist
REFUSED = {
    ("video_sr", "component", "fed3r"), ("video_sr", "component", "fedncm"), ("video_sr", "component", "oll"),
    ("classification", "component", "dwt_loss"), ("video_sr", "sharing", "fedbn"), ("video_sr", "sharing", "silobn"),
    ("segmentation", "component", "fed3r"), ("segmentation", "component", "oll"),
    ("segmentation", "component", "dwt_loss"),
}


@pytest.mark.parametrize("task,slot,name", sorted(REFUSED))
def test_known_incompatible_pairs_are_refused(task, slot, name):
    with pytest.raises(ConfigError, match=f"'{name}' needs"):
        validate(part_config(task, slot, name))


def test_model_without_batchnorm_refuses_silobn_and_the_temperature_needs_class_logits():
    with pytest.raises(ConfigError, match=r"recipe.sharing = 'silobn' needs normalisation layers with running statistics .*model 'cnn'"):
        validate(tiny(**{"recipe.sharing": "silobn", "model.norm": "group"}))
    with pytest.raises(ConfigError, match=r"recipe.sharing = 'fedbn' needs normalisation layers .*model 'cnn'"):
        validate(tiny(**{"recipe.sharing": "fedbn", "model.norm": "none"}))
    validate(tiny(**{"recipe.sharing": "fedbn", "model.norm": "group"}))  # GroupNorm layers are normalisation layers
    video = copy.deepcopy(VIDEO)
    video["train"]["temperature"] = 0.5
    with pytest.raises(ConfigError, match=r"train.temperature = 0.5 needs class logits .*task 'video_sr'"):
        validate(video)


def test_stage_parts_are_checked_too():
    raw = tiny(**{"server.rounds": 2})
    raw["stages"] = [{"name": "a", "rounds": 1}, {"name": "b", "rounds": 1, "recipe": {"sharing": "silobn"}}]
    with pytest.raises(ConfigError, match=r"stages\[1\] b.*'silobn' needs"):
        validate(raw)


def test_a_wrong_model_declaration_is_caught_when_the_model_is_built(monkeypatch):
    """The registry's declaration is what config validation reads; the built model is checked against
    the recipe's needs before anything runs, so a model that lies about its capabilities cannot start."""
    entry = R.MODELS.get("cnn")
    monkeypatch.setitem(R.MODELS._entries, "cnn", type(entry)(**{**entry.__dict__, "provides": lambda p: {
        "parameter_groups", "linear_head", "norm_layers", "norm_stats"}}))
    cfg = validate(tiny(**{"recipe.sharing": "silobn", "model.norm": "none"}))  # the lie passes config time
    with pytest.raises(ConfigError, match=r"'silobn' needs normalisation layers with running statistics .*built model 'cnn'"):
        build_simulation(cfg)


def test_a_random_feature_head_is_still_a_linear_head():
    """Fed3R-RF adapts the model's head (random Fourier features, then a linear classifier); the built
    model passes the check that Fed3R's own requirement asks for."""
    cfg = validate(tiny(**{"recipe.components": [{"name": "fed3r", "rff_dim": 16}], "server.rounds": 1}))
    sim = build_simulation(cfg)
    assert type(sim.global_model.head).__name__ == "RFFHead"
    assert "linear_head" in detect_capabilities(sim.global_model)


def test_layer_free_models_are_not_norm_models():
    class Plain(FedModel):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU())
            self.head = nn.Linear(2, 2)

    assert detect_capabilities(Plain()) == {"parameter_groups", "linear_head"}
