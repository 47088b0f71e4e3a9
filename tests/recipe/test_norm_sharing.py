"""FedBN / SiloBN: which entries are shared, what the engine does with the personal ones, and the
test-time statistics, each checked against a hand computation written here."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from fedsight import registry as R
from fedsight.models.base import ModelIO
from fedsight.api import execute
from fedsight.config import ConfigError, validate
from fedsight.runs import RunDir

from helpers import ToyTask, tiny, toy_sim


BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
STATS = ("running_mean", "running_var", "num_batches_tracked")
EPS, MOMENTUM, LR = 1e-5, 0.1, 0.1


def sharing(name, **params):
    return R.build(R.SHARING, name, params)


def expected_local(model, kinds, affine):
    """Local keys computed from module types: every BN layer's buffers, plus its params if ``affine``;
    with ``kinds`` the module types whose entries count."""
    out = set()
    for mname, m in model.named_modules():
        if isinstance(m, kinds):
            out |= {f"{mname}.{b}" for b, _ in m.named_buffers(recurse=False)}
            if affine:
                out |= {f"{mname}.{p}" for p, _ in m.named_parameters(recurse=False)}
    return out


def cnn(norm):
    return R.build(R.MODELS, "cnn", {"channels": [4, 6], "hidden": 8, "norm": norm},
                   io=ModelIO("classification", in_channels=1, num_outputs=3, image_size=8))


# -- shared keys ---------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda: cnn("batch"), lambda: ToyTask(bn=True).build_model()])
def test_shared_keys_from_module_types(make):
    model = make()
    keys = set(model.state_dict())
    fedbn_local = expected_local(model, BN_TYPES, affine=True)
    silobn_local = expected_local(model, BN_TYPES, affine=False)
    assert silobn_local and fedbn_local > silobn_local
    assert all(k.rsplit(".", 1)[1] in STATS for k in silobn_local)
    assert sharing("fedbn").shared_keys(model) == keys - fedbn_local
    assert sharing("silobn").shared_keys(model) == keys - silobn_local
    # the non-norm layers are shared by both
    assert "head.weight" in sharing("fedbn").shared_keys(model)


def test_group_norm_model():
    model = cnn("group")
    keys = set(model.state_dict())
    gn_params = expected_local(model, (nn.GroupNorm,), affine=True)
    assert gn_params
    # SiloBN: group norm has no statistics -> everything shared; FedBN: every norm layer stays local
    assert sharing("silobn").shared_keys(model) == keys
    assert sharing("fedbn").shared_keys(model) == keys - gn_params


def test_model_without_declared_groups_is_refused():
    with pytest.raises(TypeError, match="parameter groups"):
        sharing("fedbn").shared_keys(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))


def test_bad_test_stats_is_a_config_error():
    with pytest.raises(ConfigError):
        validate(tiny(**{"recipe.sharing": {"name": "silobn", "test_stats": "bogus"}}))


# -- engine: personal entries and aggregation, by hand ---------------------------------------------


def hand_local_step(st, x, y):
    """One full-batch SGD step (lr 0.1) of BatchNorm1d -> Linear in train mode, written out:
    normalise with the batch mean and biased variance, update the running statistics with momentum 0.1
    and the unbiased variance (PyTorch's BatchNorm convention)."""
    g, b, W, c = (st[k].clone().requires_grad_() for k in ("backbone.weight", "backbone.bias", "head.weight", "head.bias"))
    mu = x.mean(0)
    var_b = ((x - mu) ** 2).mean(0)
    z = g * (x - mu) / torch.sqrt(var_b + EPS) + b
    logits = z @ W.T + c
    loss = -torch.log_softmax(logits, 1)[torch.arange(len(y)), y].mean()
    grads = torch.autograd.grad(loss, [g, b, W, c])
    new = {k: (p - LR * gr).detach() for k, p, gr in zip(
        ("backbone.weight", "backbone.bias", "head.weight", "head.bias"), (g, b, W, c), grads)}
    var_u = ((x - mu) ** 2).sum(0) / (len(x) - 1)
    new["backbone.running_mean"] = (1 - MOMENTUM) * st["backbone.running_mean"] + MOMENTUM * mu
    new["backbone.running_var"] = (1 - MOMENTUM) * st["backbone.running_var"] + MOMENTUM * var_u
    new["backbone.num_batches_tracked"] = st["backbone.num_batches_tracked"] + 1
    return new


@pytest.mark.parametrize("name", ["fedbn", "silobn"])
def test_two_rounds_match_hand_computation(name):
    task = ToyTask(bn=True)
    sim = toy_sim(sharing=sharing(name), task=task, rounds=2, lr=LR)
    all_keys = list(sim.global_model.state_dict())
    local = {"fedbn": {"backbone.weight", "backbone.bias"}, "silobn": set()}[name] | {f"backbone.{s}" for s in STATS}
    shared = [k for k in all_keys if k not in local]
    glob = {k: v.clone() for k, v in sim.global_model.state_dict().items()}
    init = copy.deepcopy(glob)
    personal: dict[int, dict] = {}
    n = np.array([task.num_train_examples(c) for c in range(3)], dtype=np.float64)
    for _ in range(2):
        locals_ = {}
        for c in range(3):
            start = dict(glob)
            start.update(personal.get(c, {}))  # a new client starts from the global values
            locals_[c] = hand_local_step(start, task.xs[c], task.ys[c])
            personal[c] = {k: locals_[c][k] for k in local}
        for k in shared:  # FedAvg (server SGD lr 1): the example-weighted mean of the local models
            glob[k] = torch.tensor(np.average(np.stack([locals_[c][k].numpy() for c in range(3)]), axis=0, weights=n),
                                   dtype=torch.float32)
    sim.run()
    assert set(sim.personal_keys) == local
    for c in range(3):
        stored = sim.store.get("personal", c)
        assert set(stored) == local
        for k in local:
            torch.testing.assert_close(stored[k], personal[c][k], rtol=1e-5, atol=1e-6, msg=f"client {c} {k}")
    gstate = sim.global_model.state_dict()
    for k in shared:
        torch.testing.assert_close(gstate[k], glob[k], rtol=1e-5, atol=1e-6, msg=k)
    for k in local:  # never aggregated: the global model keeps its initial values
        assert torch.equal(gstate[k], init[k]), k
    # loading a client gives the global shared entries and that client's own personal entries
    model = sim.load_client_model(1).state_dict()
    stored = sim.store.get("personal", 1)
    for k, v in model.items():
        assert torch.equal(v, gstate[k] if k in shared else stored[k]), k


def test_fedbn_clients_with_different_inputs_keep_different_statistics():
    task = ToyTask(bn=True, sizes=(6, 6))
    task.xs[0] = task.xs[0] * 0.5 - 2.0
    task.xs[1] = task.xs[1] * 3.0 + 4.0
    sim = toy_sim(sharing=sharing("fedbn"), task=task, rounds=2)
    sim.run()
    a, b = (sim.store.get("personal", c) for c in (0, 1))
    # each client's statistics track its own data (two momentum-0.1 updates from mean 0, var 1)
    for st, x in ((a, task.xs[0]), (b, task.xs[1])):
        ref_mean = 0.19 * x.mean(0)  # (1 - 0.9^2) * batch mean, the same batch both rounds
        torch.testing.assert_close(st["backbone.running_mean"], ref_mean, rtol=1e-5, atol=1e-6)
    assert (a["backbone.running_mean"] - b["backbone.running_mean"]).abs().min() > 0.5
    assert (a["backbone.running_var"] - b["backbone.running_var"]).abs().min() > 0.1
    assert not torch.allclose(a["backbone.weight"], b["backbone.weight"])  # affine local under FedBN
    m0 = {k: v.clone() for k, v in sim.load_client_model(0).state_dict().items()}
    m1 = {k: v.clone() for k, v in sim.load_client_model(1).state_dict().items()}
    for k in ("head.weight", "head.bias"):
        assert torch.equal(m0[k], m1[k]) and torch.equal(m0[k], sim.global_model.state_dict()[k])
    assert not torch.equal(m0["backbone.running_mean"], m1["backbone.running_mean"])


# -- test-time statistics --------------------------------------------------------------------------


def spy_eval(sim):
    """Record the BN state of the evaluated model at each eval_state call."""
    seen = []
    orig = sim.task.eval_state

    def wrapped(model, split, batch_size):
        bn = model.backbone
        seen.append({"split": split, "mean": bn.running_mean.clone(), "var": bn.running_var.clone(),
                     "weight": bn.weight.detach().clone(), "momentum": bn.momentum})
        return orig(model, split, batch_size)

    sim.task.eval_state = wrapped
    return seen


def hand_eval_loss(state, x, y, mean, var, weight=None, bias=None):
    g = state["backbone.weight"] if weight is None else weight
    b = state["backbone.bias"] if bias is None else bias
    z = g * (x - mean) / torch.sqrt(var + EPS) + b
    logits = z @ state["head.weight"].T + state["head.bias"]
    return float(-torch.log_softmax(logits, 1)[torch.arange(len(y)), y].mean())


@pytest.mark.parametrize("name", ["silobn", "fedbn"])
def test_fresh_statistics_are_the_test_batch_moments_and_are_restored(name):
    task = ToyTask(bn=True)
    sim = toy_sim(sharing=sharing(name, test_stats="fresh"), task=task, rounds=1)
    sim.run()
    before = {k: v.clone() for k, v in sim.global_model.state_dict().items()}
    sim.global_model.train()
    seen = spy_eval(sim)
    out = sim.evaluate()
    x = task.test_x
    mean = x.mean(0)
    var_u = ((x - mean) ** 2).sum(0) / (len(x) - 1)  # one batch, cumulative average: unbiased variance
    assert len(seen) == 1 and seen[0]["split"] == "test"
    torch.testing.assert_close(seen[0]["mean"], mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(seen[0]["var"], var_u, rtol=1e-5, atol=1e-6)
    if name == "fedbn":  # the global split uses the clients' example-weighted average affine parameters
        n = np.array([task.num_train_examples(c) for c in range(3)], dtype=np.float64)
        w = {k: torch.tensor(np.average(np.stack([sim.store.get("personal", c)[k].numpy() for c in range(3)]),
                                        axis=0, weights=n), dtype=torch.float32)
             for k in ("backbone.weight", "backbone.bias")}
        torch.testing.assert_close(seen[0]["weight"], w["backbone.weight"], rtol=1e-5, atol=1e-6)
        ref = hand_eval_loss(before, x, task.test_y, mean, var_u, w["backbone.weight"], w["backbone.bias"])
    else:
        ref = hand_eval_loss(before, x, task.test_y, mean, var_u)
    assert out["test/loss"] == pytest.approx(ref, rel=1e-5)
    # everything restored: values, momentum, train/eval flag
    after = sim.global_model.state_dict()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert sim.global_model.backbone.momentum == MOMENTUM
    assert sim.global_model.training and sim.global_model.backbone.training


def test_fresh_statistics_over_several_batches_average_the_batch_statistics():
    task = ToyTask(bn=True)
    sim = toy_sim(sharing=sharing("silobn", test_stats="fresh"), task=task, rounds=1)
    sim.schedule = dataclasses.replace(sim.schedule, eval_batch_size=4)
    sim.run()
    seen = spy_eval(sim)
    sim.evaluate()
    x1, x2 = task.test_x[:4], task.test_x[4:]
    torch.testing.assert_close(seen[0]["mean"], (x1.mean(0) + x2.mean(0)) / 2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(seen[0]["var"], (x1.var(0) + x2.var(0)) / 2, rtol=1e-5, atol=1e-6)


def test_fresh_statistics_on_a_local_split_and_restore():
    task = ToyTask(bn=True)
    sim = toy_sim(sharing=sharing("silobn", test_stats="fresh"), task=task, rounds=1)
    sim.run()
    model = sim.load_client_model(2)
    mine = model.backbone.running_mean.clone()
    with sim.eval_context(model, 2):
        torch.testing.assert_close(model.backbone.running_mean, task.test_x.mean(0), rtol=1e-5, atol=1e-6)
    assert torch.equal(model.backbone.running_mean, mine)
    torch.testing.assert_close(mine, sim.store.get("personal", 2)["backbone.running_mean"])


def test_client_statistics_on_the_global_split_are_the_weighted_client_average():
    task = ToyTask(bn=True)
    sim = toy_sim(sharing=sharing("silobn"), task=task, rounds=2)
    seen = spy_eval(sim)
    sim.evaluate()  # no client seen yet: the global model's own statistics
    assert torch.equal(seen[0]["mean"], torch.zeros(3)) and torch.equal(seen[0]["var"], torch.ones(3))
    sim.run()
    before = {k: v.clone() for k, v in sim.global_model.state_dict().items()}
    out = sim.evaluate()
    n = np.array([4.0, 6.0, 5.0])
    st = [sim.store.get("personal", c) for c in range(3)]
    mean = np.average(np.stack([s["backbone.running_mean"].numpy() for s in st]), axis=0, weights=n)
    var = np.average(np.stack([s["backbone.running_var"].numpy() for s in st]), axis=0, weights=n)
    np.testing.assert_allclose(seen[-1]["mean"].numpy(), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(seen[-1]["var"].numpy(), var, rtol=1e-5, atol=1e-6)
    ref = hand_eval_loss(before, task.test_x, task.test_y, torch.tensor(mean, dtype=torch.float32),
                         torch.tensor(var, dtype=torch.float32))
    assert out["test/loss"] == pytest.approx(ref, rel=1e-5)
    for k, v in sim.global_model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_global_sharing_eval_context_is_a_no_op():
    sim = toy_sim(task=ToyTask(bn=True), rounds=1)
    sim.run()
    before = {k: v.clone() for k, v in sim.global_model.state_dict().items()}
    with sim.eval_context(sim.global_model, "test"):
        for k, v in sim.global_model.state_dict().items():
            assert torch.equal(v, before[k])


# -- from config: local evaluation and resume ------------------------------------------------------


def _final(run_dir):
    run = RunDir(run_dir)
    rnd, state = run.load_latest_checkpoint()
    rows = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in run.read_metrics()]
    return rnd, state, rows


def test_silobn_fresh_from_config_with_local_eval_resumes_bit_identically(tmp_path):
    raw = tiny(**{"model.norm": "batch", "recipe.sharing": {"name": "silobn", "test_stats": "fresh"},
                  "server.rounds": 4, "eval.every": 1})
    cfg = validate(raw)
    execute(cfg, tmp_path / "full")
    assert execute(cfg, tmp_path / "cut", stop_after=2).status == "stopped"
    assert execute(cfg, tmp_path / "cut", resume=True).status == "complete"
    ra, sa, rows_a = _final(tmp_path / "full")
    rb, sb, rows_b = _final(tmp_path / "cut")
    assert ra == rb == 4
    assert rows_a == rows_b and [r["round"] for r in rows_b] == [1, 2, 3, 4]
    assert all("local/wma" in r and "test/acc" in r for r in rows_a)
    for k in sa["model"]:
        assert torch.equal(sa["model"][k], sb["model"][k]), k
    # the personal BN statistics live in the client-state store, identical in both runs
    from fedsight.state import ClientStateStore

    stores = []
    for d, st in ((tmp_path / "full", sa), (tmp_path / "cut", sb)):
        store = ClientStateStore(d / "client_state")
        store.load_state_dict(st["client_state"])
        stores.append(store)
    clients = stores[0].clients("personal")
    assert clients and clients == stores[1].clients("personal")
    for c in clients:
        a, b = stores[0].get("personal", c), stores[1].get("personal", c)
        assert set(a) and all(k.rsplit(".", 1)[1] in STATS for k in a)
        assert all(torch.equal(a[k], b[k]) for k in a)
