"""LADD as recipe parts and stages on the generated street scenes: client labels never reach training, the
clusters find the planted weather groups, cluster aggregation mixes only within a cluster (eq. 5.17) and the
global entries across all clients, every cluster's SWA teacher is the running mean of eq. 5.22 and reaches its
clients, and a killed three-stage run resumes bit-identically."""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import pytest
import torch

from fedsight.api import build_simulation, execute
from fedsight.config import set_path, validate
from fedsight.data.segmentation import TensorLabelStore
from fedsight.plugins import load_builtin
from fedsight.recipe.ladd import GROUPS, cluster_prefix
from fedsight.recipe.ladd_adapt import _cluster_model
from fedsight.registry import COMPONENTS, NoParams
from fedsight.training import Component

load_builtin()

STREET = {"name": "street", "height": 32, "width": 48, "setting": "none", "cameras": ["car"]}
BASE: dict[str, Any] = {
    # (no figures: drawing the segmentation panels was most of a run's time here; the clusters' test draws them)
    "seed": 0, "run": {"name": "ladd", "checkpoint_keep": 1, "plots": False},
    "task": {"name": "segmentation", "crop": [24, 40], "scale": [0.8, 1.2], "labels": "eval_only",
             "source": {**STREET, "towns": ["downtown"], "conditions": ["clear-day"], "per_domain": 6}},
    # four target domains, one per client: two towns x two weathers (the styles to cluster)
    "data": {**STREET, "towns": ["suburb", "rural"], "conditions": ["clear-day", "rain-day"], "per_domain": 5},
    "partition": {"name": "classes", "classes_per_client": 1, "num_clients": 4, "local_test_fraction": 0.0},
    "model": {"name": "bisenetv2", "width": 0.25, "head_channels": 16, "aux_channels": 8},
    "train": {"epochs": 1, "batch_size": 2, "lr": 0.02, "momentum": 0.9},
    "server": {"rounds": 3, "clients_per_round": 4}, "eval": {"batch_size": 4, "local": False},
    "engine": {"threads": 1},
}
STYLES_STAGE = {"name": "styles", "rounds": 1, "recipe": {"components": [{"name": "client_styles", "ks": [2, 3]}]}}
SOURCE_STAGE = {"name": "source", "rounds": 1, "recipe": {"components": [
    {"name": "source_pretrain", "steps": 2, "steps_per_round": 2, "batch_size": 2}]}}


def config(stages: list[dict[str, Any]], **over: Any) -> Any:
    raw = copy.deepcopy(BASE)
    raw["stages"] = stages
    raw["server"]["rounds"] = sum(st["rounds"] for st in stages)
    for k, v in over.items():
        set_path(raw, k.split("."), v)
    return validate(raw)


def adapt(rounds: int, *components: Any) -> dict[str, Any]:
    return {"name": "adapt", "rounds": rounds, "recipe": {"components": list(components)}}


LADD = [{"name": "cluster_aggregation", "part": "head"}, {"name": "self_training", "kd_lambda": 1.0}]

#: what the spy component saw: (round, client) -> entries, plus server-side snapshots
SEEN: dict[str, dict[Any, Any]] = {}


class Spy(Component):
    """Listed after the LADD parts: records what a client received and ended with, and the server's cluster
    models after each round's aggregation."""

    name = "ladd_spy"

    def client_start(self, ctx: Any) -> None:
        SEEN["start"][(ctx.round, ctx.client_id)] = {k: v.detach().clone() for k, v in ctx.model.state_dict().items()}
        teacher = ctx.scratch.get("self_training", {}).get("teacher")
        if teacher is not None:
            SEEN["teacher"][(ctx.round, ctx.client_id)] = {k: v.clone() for k, v in teacher.state_dict().items()}

    def client_end(self, ctx: Any, result: Any) -> None:
        SEEN["end"][(ctx.round, ctx.client_id)] = (
            {k: v.detach().clone() for k, v in ctx.model.state_dict().items()}, float(result.num_examples))

    def client_broadcast(self, sctx: Any, client: int) -> None:
        if sctx.round - 1 not in SEEN["models"]:  # the cluster models the stage starts from
            SEEN["models"][sctx.round - 1] = {int(s): _cluster_model(sctx, int(s))
                                              for s in np.unique(sctx.facts[GROUPS].numpy())}
        return None

    def server_step(self, sctx: Any) -> None:
        SEEN["models"][sctx.round] = {int(s): _cluster_model(sctx, int(s)) for s in np.unique(sctx.facts[GROUPS].numpy())}
        SEEN["facts"][sctx.round] = {k: v.clone() for k, v in sctx.facts.items()}


if "ladd_spy" not in COMPONENTS.names():
    COMPONENTS.register("ladd_spy", params=NoParams)(lambda params: Spy())


@pytest.fixture()
def seen() -> dict[str, dict[Any, Any]]:
    SEEN.clear()
    SEEN.update(start={}, teacher={}, end={}, models={}, facts={})
    return SEEN


def _weighted_mean(states: list[dict[str, torch.Tensor]], n: list[float], key: str) -> torch.Tensor:
    w = torch.tensor(n, dtype=torch.float64) / sum(n)
    return sum(float(wi) * s[key].to(torch.float64) for wi, s in zip(w, states))


def test_clusters_follow_the_planted_weather_and_are_reported(tmp_path) -> None:
    out = execute(config([STYLES_STAGE], **{"run.plots": True}), tmp_path / "run")
    info = json.loads((out.run_dir / "clusters.json").read_text())
    weather = [c["domain"].split("/")[1] for c in info["clients"]]
    cluster = [c["cluster"] for c in info["clients"]]
    assert info["k"] == 2 and len(set(zip(weather, cluster))) == 2, info  # clusters == weather groups
    assert (out.run_dir / "plots" / "style_clusters.png").stat().st_size > 5000
    row = next(r for r in map(json.loads, (out.run_dir / "metrics.jsonl").read_text().splitlines()) if r.get("round") == 1)
    assert row["clusters/k"] == 2.0 and row["clusters/clients_reported"] == 4.0 and row["clients/sampled"] == 4
    # against the true domain (town/weather: four domains, one client each, two clusters): Table 5.19's form
    table = info["table"]
    assert sorted(table["domains"]) == sorted(c["domain"] for c in info["clients"]) and table["clusters"] == [0, 1]
    assert np.asarray(table["clients"]).sum() == 4 and np.asarray(table["clients"]).max() == 1
    assert info["accuracy"] == {"majority": 0.5, "matching": 0.5}  # one domain per cluster can be right
    assert row["clusters/accuracy_majority"] == 0.5 and row["clusters/accuracy_matching"] == 0.5


def _garbage_labels(task: Any) -> None:
    """Replace every client training image's label map by random classes (in place, before training)."""
    labels = task.pool.labels
    gen = torch.Generator().manual_seed(7)
    maps = [labels.get_one(i) for i in range(len(labels))]
    task.pool.labels = TensorLabelStore(torch.stack([
        torch.randint(0, task.num_classes, m.shape, generator=gen).to(m.dtype) for m in maps]))


def _final(cfg: Any, garbage: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    sim = build_simulation(cfg)
    if garbage:
        _garbage_labels(sim.task)
    sim.run()
    return ({k: v.clone() for k, v in sim.global_model.state_dict().items()},
            {k: v.clone() for k, v in sim.server.facts.items()})


def test_client_labels_never_reach_training() -> None:
    """The whole pipeline (styles, source pre-training, LADD adaptation) trains the same model, bit for bit,
    when every client's label maps are replaced by noise; with labels used for training the noise matters."""
    cfg = config([STYLES_STAGE, SOURCE_STAGE, adapt(1, *LADD)])
    model, facts = _final(cfg, garbage=False)
    model_g, facts_g = _final(cfg, garbage=True)
    assert model.keys() == model_g.keys() and facts.keys() == facts_g.keys()
    assert all(torch.equal(model[k], model_g[k]) for k in model)
    assert all(torch.equal(facts[k], facts_g[k]) for k in facts)
    supervised = config([adapt(1)], **{"task.labels": "train"})
    plain, _ = _final(supervised, garbage=False)
    noisy, _ = _final(supervised, garbage=True)
    assert any(not torch.equal(plain[k], noisy[k]) for k in plain if plain[k].is_floating_point())


def test_cluster_aggregation_mixes_within_clusters_and_global_entries_across_all(seen) -> None:
    """Eq. 5.17: a cluster's head is the data-weighted mean of its members' trained heads only; every other
    entry is the FedAvg mean over all clients; the global head is the clusters' mean weighted by their sizes;
    in the next round each client starts from its own cluster's head."""
    cfg = config([STYLES_STAGE, adapt(2, {"name": "cluster_aggregation", "part": "head"}, "ladd_spy")],
                 **{"task.labels": "train"})
    sim = build_simulation(cfg)
    sim.run()
    groups = sim.server.facts[GROUPS].numpy()
    head = [k for k in sim.global_model.parameter_groups()["head"] if k in sim.global_model.state_dict()]
    assert head and len(np.unique(groups)) == 2
    for r in (2, 3):
        ends = {c: seen["end"][(r, c)] for c in range(4)}
        facts = seen["facts"][r]
        for s in np.unique(groups):
            members = [c for c in range(4) if groups[c] == s]
            for k in head:
                if facts[cluster_prefix(int(s)) + k].is_floating_point():
                    want = _weighted_mean([ends[c][0] for c in members], [ends[c][1] for c in members], k)
                    torch.testing.assert_close(facts[cluster_prefix(int(s)) + k].to(torch.float64), want)
        model = seen["models"][r][0]  # cluster 0's model: shared entries are the global ones
        for k, v in model.items():
            if k not in head and v.is_floating_point():
                want = _weighted_mean([e[0] for e in ends.values()], [e[1] for e in ends.values()], k)
                torch.testing.assert_close(v.to(torch.float64), want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{r} {k} {m}")
    sizes = np.bincount(groups)
    state = sim.global_model.state_dict()
    for k in head:
        if state[k].is_floating_point():
            want = sum(float(sizes[s]) * seen["facts"][3][cluster_prefix(int(s)) + k].to(torch.float64)
                       for s in range(len(sizes))) / sizes.sum()
            torch.testing.assert_close(state[k].to(torch.float64), want)
    for c in range(4):  # round 3: every client starts from its cluster's head after round 2
        start = seen["start"][(3, c)]
        for k in head:
            assert torch.equal(start[k], seen["facts"][2][cluster_prefix(int(groups[c])) + k]), (c, k)
    k = head[0]
    assert not torch.equal(seen["facts"][2][cluster_prefix(0) + k], seen["facts"][2][cluster_prefix(1) + k])


def test_every_clusters_teacher_is_the_running_mean_of_eq_5_22_and_reaches_its_clients(seen) -> None:
    """omega = 1, t_START = 0: after t rounds of the stage a cluster's teacher is the mean of its models at the
    stage's start and after rounds 1..t; the clients of round t + 1 receive their own cluster's teacher."""
    cfg = config([STYLES_STAGE, adapt(3, *LADD[:1], {"name": "self_training", "every": 1, "start": 0}, "ladd_spy")])
    sim = build_simulation(cfg)
    sim.run()
    groups = sim.server.facts[GROUPS].numpy()
    st = next(c for c in sim.server.stages[-1].recipe.components if c.name == "self_training")
    models = seen["models"]  # stage rounds 0..3 are global rounds 1..4
    for s in np.unique(groups):
        for k, v in st.teachers[int(s)].items():
            if v.is_floating_point():
                want = torch.stack([models[r][int(s)][k].to(torch.float64) for r in (1, 2, 3, 4)]).mean(0)
                torch.testing.assert_close(v.to(torch.float64), want)
    for c in range(4):  # round 3 (stage round 2): the mean of the start and stage round 1
        got = seen["teacher"][(3, c)]
        s = int(groups[c])
        for k, v in got.items():
            if v.is_floating_point():
                want = (models[1][s][k].to(torch.float64) + models[2][s][k].to(torch.float64)) / 2
                torch.testing.assert_close(v.to(torch.float64), want)


def test_a_killed_three_stage_run_resumes_bit_identically(tmp_path) -> None:
    cfg = config([STYLES_STAGE, {**SOURCE_STAGE, "rounds": 2, "recipe": {"components": [
        {"name": "source_pretrain", "steps": 4, "steps_per_round": 2, "batch_size": 2}]}}, adapt(2, *LADD)])
    whole = execute(cfg, tmp_path / "whole")
    for stop in (2, 4):
        execute(cfg, tmp_path / "part", stop_after=stop, resume=stop > 2)
    part = execute(cfg, tmp_path / "part", resume=True)
    assert (whole.run_dir / "model.safetensors").read_bytes() == (part.run_dir / "model.safetensors").read_bytes()
    strip = lambda p: [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")}  # noqa: E731
                       for line in (p / "metrics.jsonl").read_text().splitlines() if "event" not in line]
    assert strip(whole.run_dir) == strip(part.run_dir)
    rows = strip(whole.run_dir)
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4, 5]  # round 0: the initial model, in the first stage
    assert [r["stage"] for r in rows] == ["styles", "styles", "source", "source", "adapt", "adapt"]
    assert rows[3]["source/steps"] == 4.0 and rows[1]["clients/sampled"] == 4 and rows[2]["clients/sampled"] == 0


def test_evaluating_every_round_does_not_change_training(tmp_path) -> None:
    """Cluster evaluation loads each cluster's entries into the model: evaluating every round and only at the end
    must train the same model bit for bit (the reported curves of docs/ladd.md use eval.every 10 and 20)."""
    stages = [STYLES_STAGE, SOURCE_STAGE, adapt(3, *LADD)]
    often = execute(config(stages, **{"eval.every": 1}), tmp_path / "often")
    once = execute(config(stages, **{"eval.every": 5}), tmp_path / "once")
    assert (often.run_dir / "model.safetensors").read_bytes() == (once.run_dir / "model.safetensors").read_bytes()
    rows = lambda r: [json.loads(x) for x in (r.run_dir / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert sum("test/miou" in x for x in rows(often)) > sum("test/miou" in x for x in rows(once))


def test_misordered_stages_fail_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match="client_styles"):
        build_simulation(config([adapt(1, {"name": "cluster_aggregation"})])).run()
    with pytest.raises(ValueError, match="theta\\^0"):
        build_simulation(config([STYLES_STAGE, adapt(1, {"name": "self_training", "kd_lambda": 1.0})])).run()


def test_frozen_models_normalise_with_running_or_batch_statistics() -> None:
    """``frozen_bn``: the SWA teacher and theta^0 run with their running BatchNorm statistics (eval mode) or with
    the statistics of the client's batch (what a train-mode forward of the same weights computes)."""
    from fedsight.recipe.ladd_adapt import _frozen_copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Dropout(0.5))
    state = {k: v + 0.1 for k, v in model.state_dict().items() if v.is_floating_point()}
    state["1.running_var"] = torch.full((4,), 4.0)
    x = torch.randn(5, 3, 8, 8) * 3 + 1
    reference = copy.deepcopy(model)
    reference.load_state_dict({**reference.state_dict(), **state})
    reference.eval()
    running = _frozen_copy(model, state)(x)
    assert torch.allclose(running, reference(x))
    reference[1].train()  # batch statistics, dropout still off
    batch = _frozen_copy(model, state, batch_stats=True)(x)
    assert torch.allclose(batch, reference(x)) and not torch.allclose(batch, running, atol=1e-3)
    centred = (reference[0](x) - reference[0](x).mean((0, 2, 3), keepdim=True))
    assert torch.allclose(batch, torch.relu(centred / (centred.pow(2).mean((0, 2, 3), keepdim=True) + 1e-5).sqrt()
                                            * reference[1].weight[None, :, None, None] + reference[1].bias[None, :, None, None]),
                          atol=1e-5)


@pytest.mark.parametrize("components, over", [
    (LADD, {}),  # the SWA teacher of each client's cluster, distillation to theta^0 (soft-target CE), cluster heads
    ([{"name": "self_training", "teacher": "model", "fraction": 0.0, "kd_lambda": 0.5, "kd_form": "kl",
       "entropy_lambda": 0.1, "reduction": "kept"}], {}),
    # eq. 5.21 as the thesis writes it: own labels + KL to the cluster's teacher, Shannon entropy, KL to theta^0
    ([{"name": "self_training", "pseudo": "own_ce_kl", "fraction": 0.0, "kd_lambda": 0.5, "kd_form": "kl",
       "entropy": "shannon", "entropy_lambda": 1.0}], {}),
    # cluster heads alone, on labels: each client's upload is relative to its cluster's head, not the global one
    ([{"name": "cluster_aggregation", "part": "head"}], {"task.labels": "train"}),
], ids=["ladd", "own-model-kl-entropy", "eq-5-21", "cluster-heads-supervised"])
def test_the_adaptation_stage_trains_vectorised_as_sequentially(monkeypatch, components, over) -> None:
    """Self-training under vectorised training: the frozen teacher and theta^0 run per client before the step
    (``VectorStep.prepare``), the pseudo-label loss inside it; two adaptation rounds give each cluster's model, teacher
    and the global model as sequential training does (BiSeNetV2 with dropout: each client's masks from its stream)."""
    import fedsight.build as A

    def final(vectorised: bool):
        # (GroupNorm: with BatchNorm over batches of two 24x40 crops, two sequential runs at one and at two threads
        # already differ by 0.01-1 in the weights after two rounds, rounding amplified through the 1x1 deepest maps)
        cfg = config([STYLES_STAGE, SOURCE_STAGE, adapt(2, *components)], **{"model.norm": "group", **over})
        if vectorised:  # (the styles stage has its own local procedure: "auto" trains only it one client at a time)
            monkeypatch.setattr(A, "vectorize_mode", lambda setting, device: "auto")
        sim = build_simulation(cfg)
        runtime = sim.runtime
        sim.run()
        monkeypatch.undo()
        return sim, runtime

    (seq, rseq), (vec, rvec) = final(False), final(True)
    assert not rseq.vectorizes(4) and rvec.vectorizes(4)  # (the adaptation stage, the last entered)
    a, b = seq.global_model.state_dict(), vec.global_model.state_dict()
    for k in a:
        if a[k].is_floating_point():
            np.testing.assert_allclose(b[k].numpy(), a[k].numpy(), atol=2e-5, rtol=1e-4, err_msg=k)
        else:
            assert torch.equal(a[k], b[k]), k
    fa, fb = seq.server.facts, vec.server.facts
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_allclose(fb[k].double().numpy(), fa[k].double().numpy(), atol=2e-5, rtol=1e-4, err_msg=k)


def test_pseudo_labels_from_the_student_by_rank_are_not_vectorised() -> None:
    """teacher = "model" with 0 < fraction < 1 ranks the student's own pixels inside the step: ``true`` refuses it,
    naming the setting."""
    from fedsight.config import ConfigError

    cfg = config([adapt(1, {"name": "self_training", "teacher": "model"})], **{"engine.vectorize": True})
    with pytest.raises(ConfigError, match="self_training.*teacher = 'model' with 0 < fraction < 1"):
        build_simulation(cfg)


# ---------------------------------------------------------------------------------- test-time restyling


def test_restyling_moves_an_images_style_to_the_window_at_any_size() -> None:
    """``restyle_to`` (Sec. 5.3.8's test-time FDA): a style measured at the crop size, applied to a larger test
    image, gives that image the style at the crop size (the window is scaled by the pixel ratio), and the full
    image's own window becomes the scaled one."""
    from fedsight.data.seg_pipeline import restyle_to, style_entry
    from fedsight.functional.style import amplitude_window

    rng = np.random.default_rng(0)
    crop = (24, 40)
    yy, xx = np.mgrid[0:48, 0:80]
    smooth = lambda a, b: 110 + 40 * np.sin(xx / a) * np.cos(yy / b)  # noqa: E731
    image = torch.from_numpy(np.stack([smooth(7, 9), smooth(5, 11), smooth(9, 6)]) + rng.normal(0, 5, (3, 48, 80)))
    image = image.clamp(0, 255).round().to(torch.uint8)
    other = torch.from_numpy(np.stack([smooth(4, 5) * 0.6 + 30, smooth(8, 4) * 0.7, smooth(6, 6) + 20]))
    target = style_entry("fda", other.clamp(0, 255).round().to(torch.uint8), crop, 0.0, 1)
    before = style_entry("fda", image, crop, 0.0, 1)
    out = restyle_to(image, target, 1, crop)
    assert out.dtype == torch.uint8 and out.shape == image.shape
    full = amplitude_window(out.to(torch.float64), 0.0, 1)
    np.testing.assert_allclose(full.numpy(), (target.double() * 48 * 80 / (24 * 40)).numpy(), rtol=0.02, atol=600)
    after = style_entry("fda", out, crop, 0.0, 1)
    assert float((after - target).norm()) < 0.05 * float((before - target).norm())


def test_cluster_evaluation_restyles_each_test_image_with_its_clusters_centroid(tmp_path, monkeypatch) -> None:
    """``cluster_aggregation.restyle``: each cluster's test images are evaluated inside ``task.restyled`` with
    that cluster's centroid (eq. 5.23) as the window, and the restyled batches are the FDA-restyled images; off
    (the default, the authors' code) nothing is restyled."""
    from fedsight.data.seg_pipeline import restyle_to
    from fedsight.recipe.ladd import CENTROIDS
    from fedsight.tasks.segmentation import SegmentationTask

    calls: list[tuple[torch.Tensor, int, list[Any]]] = []
    original = SegmentationTask.restyled
    seen_batches: list[tuple[Any, Any]] = []

    def spy(self, window, half):
        calls.append((window.clone(), half, []))
        return original(self, window, half)

    monkeypatch.setattr(SegmentationTask, "restyled", spy)
    stages = [STYLES_STAGE, SOURCE_STAGE, adapt(1, {"name": "cluster_aggregation", "part": "head", "restyle": True})]
    sim = build_simulation(config(stages, **{"eval.every": 1}))
    sim.run()
    centroids = sim.server.facts[CENTROIDS]
    assert calls and {tuple(c[0].reshape(-1).tolist()) for c in calls} <= {tuple(r.tolist()) for r in centroids}
    assert all(c[1] == 1 and c[0].shape == (3, 3, 3) for c in calls)
    task = sim.task
    plain = next(task.eval_batches("test", 2))
    with task.restyled(centroids[0].reshape(3, 3, 3), 1):
        x, _ = next(task.eval_batches("test", 2))
        seen_batches.append((x, task.eval_style))
    s = task._split("test")
    raw = torch.stack([s.images.get_one(i) for i in range(len(x))])
    want = task.standardize(torch.stack([restyle_to(im, centroids[0].reshape(3, 3, 3), 1, task.crop) for im in raw]))
    assert torch.allclose(x, want) and not torch.allclose(x, plain[0]) and task.eval_style is None
    calls.clear()
    sim = build_simulation(config(stages[:2] + [adapt(1, {"name": "cluster_aggregation", "part": "head"})]))
    sim.run()
    assert calls == []


@pytest.mark.parametrize("on", ["source", "clients", "both"])
def test_colour_jitter_reaches_the_source_or_the_clients_batches(on) -> None:
    """``task.jitter`` with ``jitter_on``: the authors' code jitters the source set only ("source", the default);
    "clients" the target clients' batches, "both" both; jitter 0 (the default) changes no batch."""
    jittered = build_simulation(config([STYLES_STAGE], **{"task.jitter": 0.5, "task.jitter_on": on})).task
    plain = build_simulation(config([STYLES_STAGE])).task
    pos = torch.tensor([0, 1])
    src = [t.source_batch([0, 1], ("source", 0)) for t in (jittered, plain)]
    cli = [next(t.train_batches(0, [pos], seed=0, round=1)) for t in (jittered, plain)]
    assert torch.equal(src[0][1], src[1][1]) and torch.equal(cli[0][1], cli[1][1])  # labels: same geometry
    assert torch.equal(src[0][0], src[1][0]) == (on == "clients")
    assert torch.equal(cli[0][0], cli[1][0]) == (on == "source")
