"""FedVG (Devkota et al. 2026) client weights and the server-held validation set.

Expected values are written out here from the paper's equations (digest ``notes/003_fedvg.md``):
Eq. 3 L_val = mean CE over V, Eq. 4 / E.11 g_k = mean over tensors of ||grad||, Eq. 5 s_k = 1/(g_k+eps),
Eq. 2 p_k = s_k / sum_j s_j, layer-level E.13-E.16, block-level E.17-E.21, with analytic
softmax-regression gradients or a fresh autograd call, never the implementation's helpers.
"""

import copy
import time
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedsight import registry as R
from fedsight.api import build_simulation, build_task, execute
from fedsight.config import ConfigError, validate
from fedsight.functional.fedvg import layer_norm
from fedsight.training import ServerContext
from fedsight.records import ClientResult

from helpers import ToyLinear, ToyTask, tiny, toy_sim

EPS = 1e-8


def fedvg(**params):
    return R.build(R.WEIGHTINGS, "fedvg", params)


def onehot(y, c):
    return F.one_hot(y, c).to(torch.float32)


def softmax_grads(W, b, x, y):
    """Analytic gradient of mean CE of softmax(x W^T + b): ((P - Y)^T x / n, mean(P - Y))."""
    P = torch.softmax(x @ W.T + b, dim=1)
    E = P - onehot(y, W.shape[0])
    return E.T @ x / len(y), E.mean(0)


def val_set(dim=3, classes=3, n=9, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g), torch.randint(0, classes, (n,), generator=g)


def random_results(model, k=3, seed=0, scale=0.5, sizes=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for c in range(k):
        delta = {n: scale * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
        bufs = {n: b.clone() for n, b in model.named_buffers()}
        out.append(ClientResult(client_id=c, num_examples=(sizes or [4, 6, 5, 7])[c], delta=delta, buffers=bufs))
    return out


def sctx_for(model, task, k=3):
    return ServerContext(round=1, model=model, num_clients=k, sampled=list(range(k)), task=task)


# -- norms ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7,), (4, 3), (6, 2, 3, 3), ()])
def test_norms_match_torch_linalg_references(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    flat = g.reshape(-1)
    assert torch.allclose(layer_norm(g, "l1"), torch.linalg.vector_norm(flat, ord=1))
    assert torch.allclose(layer_norm(g, "l1"), flat.abs().sum())
    assert torch.allclose(layer_norm(g, "l2"), torch.linalg.vector_norm(flat, ord=2))
    if g.ndim >= 2:  # conv kernels are [out, in * kh * kw] matrices
        ref = torch.linalg.matrix_norm(g.reshape(g.shape[0], -1), ord=2)
        assert torch.allclose(layer_norm(g, "spectral"), ref)
        assert torch.allclose(layer_norm(g, "spectral"), torch.linalg.svdvals(g.reshape(g.shape[0], -1))[0])
    else:  # vectors: the spectral norm of a 1 x n matrix is the L2 norm
        assert torch.allclose(layer_norm(g, "spectral"), torch.linalg.vector_norm(flat, ord=2))


def test_spectral_norm_hand_example():
    m = torch.tensor([[3.0, 0.0], [0.0, -1.0]])
    assert float(layer_norm(m, "spectral")) == pytest.approx(3.0)
    assert float(layer_norm(m, "l1")) == pytest.approx(4.0)
    assert float(layer_norm(m, "l2")) == pytest.approx(math.sqrt(10.0))


# -- weights on hand-built client models --------------------------------------------------------------


def toy_val_task(bn=False, **kw):
    return ToyTask(val=val_set(), bn=bn, **kw)


@pytest.mark.parametrize("granularity", ["model", "layer", "block"])
@pytest.mark.parametrize("norm", ["l1", "l2", "spectral"])
def test_weights_sum_to_one(granularity, norm):
    task = toy_val_task(bn=True)
    torch.manual_seed(0)
    model = task.build_model()
    w = fedvg(granularity=granularity, norm=norm).weights(random_results(model), sctx_for(model, task))
    vectors = [w] if isinstance(w, torch.Tensor) else list(w.values())
    if granularity != "model":
        assert set(w) == set(model.state_dict())  # every parameter and buffer has weights
    for v in vectors:
        assert v.shape == (3,) and (v >= 0).all()
        assert float(v.sum()) == pytest.approx(1.0, abs=1e-12)


def stationary_setup():
    """V with points +x and -x in every class (class sums of x are zero) and class frequencies 1:2:3.
    At W = 0, b = log(frequencies) every prediction is the frequency vector pi, so
    grad_W = sum_i (pi - y_i) x_i^T / n = 0 and grad_b = pi - freq = 0: a stationary point of L_val."""
    g = torch.Generator().manual_seed(3)
    xs, ys = [], []
    for c, pairs in enumerate([1, 2, 3]):
        base = torch.randn(pairs, 3, generator=g)
        xs += [base, -base]
        ys += [torch.full((2 * pairs,), c)]
    x, y = torch.cat(xs), torch.cat(ys)
    freq = torch.bincount(y, minlength=3).float() / len(y)
    return x, y, torch.zeros(3, 3), torch.log(freq)


def test_client_with_zero_validation_gradient_gets_the_largest_weight():
    x, y, W0, b0 = stationary_setup()
    gW, gb = softmax_grads(W0, b0, x, y)
    assert gW.abs().max() < 1e-6 and gb.abs().max() < 1e-6  # the construction is stationary
    task = ToyTask(val=(x, y))
    torch.manual_seed(0)
    model = task.build_model()
    results = random_results(model, k=4)
    g = dict(model.named_parameters())
    results[2].delta = {"head.weight": W0 - g["head.weight"].detach(), "head.bias": b0 - g["head.bias"].detach()}
    for norm in ("l1", "l2", "spectral"):
        for gran in ("model", "layer"):
            w = fedvg(norm=norm, granularity=gran).weights(results, sctx_for(model, task, 4))
            for v in [w] if isinstance(w, torch.Tensor) else w.values():
                assert int(v.argmax()) == 2, (norm, gran, v)
                assert float(v[2]) > 0.99  # 1/(~0 + eps) dwarfs the others


@pytest.mark.parametrize("granularity", ["model", "layer", "block"])
def test_identical_client_models_get_equal_weights(granularity):
    task = toy_val_task(bn=True)
    torch.manual_seed(0)
    model = task.build_model()
    results = random_results(model, k=4)
    for r in results[1:]:
        r.delta = {k: v.clone() for k, v in results[0].delta.items()}
    w = fedvg(granularity=granularity).weights(results, sctx_for(model, task, 4))
    for v in [w] if isinstance(w, torch.Tensor) else w.values():
        assert torch.allclose(v, torch.full((4,), 0.25, dtype=torch.float64))


def test_layer_and_block_level_with_one_tensor_equal_model_level():
    task = toy_val_task()
    torch.manual_seed(0)
    model = ToyLinear(3, 3)
    model.head = nn.Linear(3, 3, bias=False)  # the model's only state: one parameter tensor
    assert list(model.state_dict()) == ["head.weight"]
    results = random_results(model, k=3)
    ctx = sctx_for(model, task)
    w_model = fedvg(granularity="model").weights(results, ctx)
    w_layer = fedvg(granularity="layer").weights(results, ctx)
    w_block = fedvg(granularity="block").weights(results, ctx)
    assert set(w_layer) == {"head.weight"} and set(w_block) == {"head.weight"}
    assert torch.allclose(w_layer["head.weight"], w_model, atol=0, rtol=1e-12)
    assert torch.allclose(w_block["head.weight"], w_model, atol=0, rtol=1e-12)
    assert not torch.allclose(w_model, torch.full((3,), 1 / 3, dtype=torch.float64))  # not trivially uniform


def client_models(model, results):
    out = []
    for r in results:
        m = copy.deepcopy(model)
        with torch.no_grad():
            for k, p in m.named_parameters():
                p.add_(r.delta[k])
        out.append(m)
    return out


def autograd_norms(m, x, y, norm, bn_train):
    """Per-tensor gradient norms of the mean CE over (x, y), fresh autograd on a copy."""
    m = copy.deepcopy(m)
    m.eval()
    if bn_train:
        m.backbone.train()
    names = [k for k, _ in m.named_parameters()]
    grads = torch.autograd.grad(F.cross_entropy(m(x), y), list(m.parameters()))
    out = {}
    for k, g in zip(names, grads):
        if norm == "l1":
            out[k] = g.abs().sum()
        elif norm == "l2":
            out[k] = g.pow(2).sum().sqrt()
        else:
            out[k] = torch.linalg.matrix_norm(g.reshape(g.shape[0], -1), ord=2) if g.ndim >= 2 else g.norm()
    return out


def normalized_inverse(g):
    s = 1.0 / (torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in g]) + EPS)
    return s / s.sum()


@pytest.mark.parametrize("bn_mode", ["train", "eval"])
def test_block_and_layer_weights_with_batchnorm_match_hand_computation(bn_mode):
    """ToyLinear(bn=True): blocks are the BatchNorm backbone (affine + running statistics) and the head.
    One V batch, so 'train' mode uses V's batch statistics and 'eval' the client's running statistics."""
    task = toy_val_task(bn=True)
    torch.manual_seed(0)
    model = task.build_model()
    results = random_results(model, k=3)
    for i, r in enumerate(results):  # distinct client running statistics
        r.buffers["backbone.running_mean"] = torch.full((3,), 0.3 * i)
        r.buffers["backbone.running_var"] = torch.full((3,), 1.0 + i)
    x, y = task.val
    models = client_models(model, results)
    for m, r in zip(models, results):
        m.load_state_dict({**m.state_dict(), **r.buffers})
    norms = [autograd_norms(m, x, y, "l1", bn_mode == "train") for m in models]
    before = copy.deepcopy(model.state_dict())
    ctx = sctx_for(model, task)
    w_block = fedvg(granularity="block", bn_mode=bn_mode).weights(results, ctx)
    w_layer = fedvg(granularity="layer", bn_mode=bn_mode).weights(results, ctx)
    w_model = fedvg(granularity="model", bn_mode=bn_mode).weights(results, ctx)
    p_model = normalized_inverse([sum(n.values()) / len(n) for n in norms])  # E.11-E.12
    p_head = normalized_inverse([(n["head.weight"] + n["head.bias"]) / 2 for n in norms])  # E.18-E.20
    p_bn = normalized_inverse([(n["backbone.weight"] + n["backbone.bias"]) / 2 for n in norms])
    assert torch.allclose(w_model, p_model, rtol=1e-5)
    for k in ("head.weight", "head.bias"):
        assert torch.allclose(w_block[k], p_head, rtol=1e-5)
    for k in ("backbone.weight", "backbone.bias", "backbone.running_mean", "backbone.running_var"):
        assert torch.allclose(w_block[k], p_bn, rtol=1e-5)  # a block's buffers take its weights
    for k in ("head.weight", "head.bias", "backbone.weight", "backbone.bias"):  # E.13-E.15
        assert torch.allclose(w_layer[k], normalized_inverse([n[k] for n in norms]), rtol=1e-5)
    for k in ("backbone.running_mean", "backbone.running_var", "backbone.num_batches_tracked"):
        assert torch.allclose(w_layer[k], p_model, rtol=1e-5)  # buffers: the model-level weights
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the global model is untouched


def test_bn_mode_changes_the_scores():
    task = toy_val_task(bn=True)
    torch.manual_seed(0)
    model = task.build_model()
    results = random_results(model, k=3)
    for i, r in enumerate(results):
        r.buffers["backbone.running_mean"] = torch.full((3,), 0.5 * i)
    ctx = sctx_for(model, task)
    a = fedvg(bn_mode="train").weights(results, ctx)
    b = fedvg(bn_mode="eval").weights(results, ctx)
    assert not torch.allclose(a, b)


def test_average_mode_is_the_mean_of_data_size_and_fedvg_weights():
    task = toy_val_task()
    torch.manual_seed(0)
    model = task.build_model()
    results = random_results(model, k=3, sizes=[10, 30, 60])
    ctx = sctx_for(model, task)
    p_vg = fedvg().weights(results, ctx)
    n = torch.tensor([10.0, 30.0, 60.0], dtype=torch.float64)
    avg = fedvg(mode="average").weights(results, ctx)
    assert torch.allclose(avg, 0.5 * (n / n.sum() + p_vg / p_vg.sum()))
    uni = fedvg(mode="average", base="uniform").weights(results, ctx)
    assert torch.allclose(uni, 0.5 * (torch.full((3,), 1 / 3, dtype=torch.float64) + p_vg))
    layer = fedvg(mode="average", granularity="layer").weights(results, ctx)
    p_layer = fedvg(granularity="layer").weights(results, ctx)
    for k, v in layer.items():
        assert torch.allclose(v, 0.5 * (n / n.sum() + p_layer[k]))


def test_scoring_leaves_global_model_and_rng_alone_and_logs_cost():
    task = toy_val_task(bn=True)
    torch.manual_seed(0)
    model = task.build_model()
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    ctx = sctx_for(model, task)
    wt = fedvg(batch_size=4)
    t0 = time.perf_counter()
    wt.weights(random_results(model), ctx)
    elapsed = time.perf_counter() - t0
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    # |V| = 9 in batches of 4, 4, 1; with BatchNorm in train mode the single last example joins the
    # batch before it: 2 passes per client, 3 clients
    assert ctx.metrics["fedvg/server_passes"] == 6 and ctx.metrics["fedvg/server_examples"] == 27
    assert 0 < ctx.metrics["fedvg/score_s"] <= elapsed  # the scoring's own time, within the call's
    scratch = wt._scratch[1]
    wt.weights(random_results(model, seed=1), ctx)
    assert wt._scratch[1] is scratch  # one scratch copy, reused


# -- one engine round against the equations --------------------------------------------------------


@pytest.mark.parametrize("norm,granularity", [("l1", "model"), ("l2", "layer"), ("spectral", "model")])
def test_one_engine_round_matches_hand_computation(norm, granularity):
    xv, yv = val_set(n=7)
    task = ToyTask(val=(xv, yv))
    lr = 0.5
    sim = toy_sim(task=task, weighting=fedvg(norm=norm, granularity=granularity, batch_size=3), lr=lr)
    W0 = sim.global_model.head.weight.detach().clone()
    b0 = sim.global_model.head.bias.detach().clone()
    rows = []
    sim.run(on_round=lambda r, row, ev: rows.append(row))

    def nrm(g):
        if norm == "l1":
            return g.abs().sum()
        if norm == "l2":
            return g.pow(2).sum().sqrt()
        return torch.linalg.matrix_norm(g, ord=2) if g.ndim == 2 else g.pow(2).sum().sqrt()

    Ws, bs, nW, nb = [], [], [], []
    for k in range(task.num_clients):
        gW, gb = softmax_grads(W0, b0, task.xs[k], task.ys[k])  # one full-batch local step
        Wk, bk = W0 - lr * gW, b0 - lr * gb
        vW, vb = softmax_grads(Wk, bk, xv, yv)  # Eq. 3: gradient of the mean CE over V
        Ws.append(Wk), bs.append(bk), nW.append(nrm(vW)), nb.append(nrm(vb))
    if granularity == "model":
        p = normalized_inverse([(a + c) / 2 for a, c in zip(nW, nb)])  # Eq. 4, 5, 2
        pW = pb = p
    else:
        pW, pb = normalized_inverse(nW), normalized_inverse(nb)  # E.13-E.16
    W_ref = sum(float(pW[k]) * Ws[k] for k in range(3))
    b_ref = sum(float(pb[k]) * bs[k] for k in range(3))
    assert torch.allclose(sim.global_model.head.weight, W_ref, atol=1e-5)
    assert torch.allclose(sim.global_model.head.bias, b_ref, atol=1e-5)
    # the round's row carries the server cost: 3 clients x ceil(7 / 3) batches, 3 x 7 examples
    assert rows[0]["fedvg/server_passes"] == 9 and rows[0]["fedvg/server_examples"] == 21
    ids, logged = sim.last_weights
    assert ids == [0, 1, 2]
    if granularity == "model":
        assert torch.allclose(logged, pW)
    else:
        assert torch.allclose(logged["head.weight"], pW) and torch.allclose(logged["head.bias"], pb)


# -- per-tensor weights through the other aggregators ---------------------------------------------


def _results_with_extras(model, k=5):
    res = random_results(model, k=k, sizes=[3, 4, 5, 6, 7])
    g = torch.Generator().manual_seed(9)
    for i, r in enumerate(res):
        r.extras["fednova"] = {"a": torch.tensor(float(i + 1), dtype=torch.float64)}
        r.extras["elastic"] = {n: torch.rand((), generator=g) for n in r.delta}
    return res


@pytest.mark.parametrize("agg", ["mean", "fednova", "elastic", "krum"])
def test_aggregators_accept_per_tensor_weights(agg):
    torch.manual_seed(0)
    model = ToyLinear(3, 3)
    res = _results_with_extras(model)
    if agg == "fednova":
        a = R.build(R.COMPONENTS, "fednova").aggregator()
    elif agg == "elastic":
        a = R.build(R.COMPONENTS, "elastic").aggregator()
    elif agg == "krum":
        a = R.build(R.AGGREGATORS, "krum", {"byzantine": 1, "multi": 3, "weighted": True})
    else:
        a = R.build(R.AGGREGATORS, "mean")
    w = torch.tensor([0.1, 0.3, 0.2, 0.25, 0.15], dtype=torch.float64)
    same = a.aggregate(res, {k: w.clone() for k in res[0].delta})
    ref = a.aggregate(res, w)
    for k in ref:
        assert torch.allclose(same[k], ref[k])
    # different weights per tensor: each tensor equals the tensor-weight aggregate with its own weights
    w2 = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.2], dtype=torch.float64)
    mixed = a.aggregate(res, {"head.weight": w, "head.bias": w2})
    assert torch.allclose(mixed["head.weight"], ref["head.weight"])
    assert torch.allclose(mixed["head.bias"], a.aggregate(res, w2)["head.bias"])


def test_mean_aggregator_per_tensor_hand_example():
    torch.manual_seed(0)
    res = random_results(ToyLinear(3, 3), k=3)
    wa = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    wb = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64)
    out = R.build(R.AGGREGATORS, "mean").aggregate(res, {"head.weight": wa, "head.bias": wb})
    assert torch.allclose(out["head.weight"], res[0].delta["head.weight"])
    assert torch.allclose(out["head.bias"], 0.5 * (res[1].delta["head.bias"] + res[2].delta["head.bias"]))


# -- the validation set -----------------------------------------------------------------------------


def unique_npz(path, n_train=200, n_test=40, classes=10, size=8, seed=0, names=None):
    """A MedMNIST-layout .npz whose every image is unique: pixel 0 and 1 encode the example index."""
    rng = np.random.default_rng(seed)

    def images(n, offset):
        im = rng.integers(0, 256, size=(n, size, size), dtype=np.uint8)
        idx = np.arange(offset, offset + n)
        im[:, 0, 0], im[:, 0, 1] = idx // 256, idx % 256
        return im

    y_tr = np.arange(n_train) % classes
    rng.shuffle(y_tr)
    np.savez(path, train_images=images(n_train, 0), train_labels=y_tr[:, None].astype(np.uint8),
             test_images=images(n_test, n_train), test_labels=(np.arange(n_test) % classes)[:, None].astype(np.uint8))
    return y_tr


def npz_cfg(path, **over):
    base = {"data": {"name": "npz", "path": str(path)},
            "partition": {"name": "dirichlet", "alpha": 1.0, "num_clients": 5, "local_test_fraction": 0.2},
            "validation.source": "carve"}
    raw = tiny()
    raw.update({k: v for k, v in base.items() if "." not in k})
    for k, v in {**{k: v for k, v in base.items() if "." in k}, **over}.items():
        from fedsight.config import set_path

        set_path(raw, k.split("."), v)
    return validate(raw)


def raw_ids(task, x):
    """Example ids of standardised images (undo the standardisation, read pixels 0 and 1)."""
    img = torch.round((x * task.std + task.mean) * 255.0)
    return (img[:, 0, 0, 0] * 256 + img[:, 0, 0, 1]).long().tolist()


@pytest.mark.parametrize("stratified", [True, False])
def test_carved_validation_set_is_disjoint_from_every_client_and_sized(tmp_path, stratified):
    y = unique_npz(tmp_path / "u.npz")
    task = build_task(npz_cfg(tmp_path / "u.npz", **{"validation.fraction": 0.15, "validation.stratified": stratified}))
    v_ids = raw_ids(task, task.val_x)
    client_ids = raw_ids(task, task.pool_x)  # every client's local train and local test examples
    assert len(v_ids) == 30  # round(0.15 * 200)
    assert not set(v_ids) & set(client_ids)
    assert sorted(v_ids + client_ids) == list(range(200))  # nothing lost, nothing duplicated
    assert [int(t) for t in task.val_y] == [int(y[i]) for i in v_ids]  # labels travel with images
    if stratified:  # every class has 20 examples: exactly 3 each in V
        assert np.bincount(task.val_y.numpy(), minlength=10).tolist() == [3] * 10
    # V is served as the evaluation split "val" and is deterministic in the seed
    xs = torch.cat([x for x, _ in task.eval_batches("val", 7)])
    assert torch.equal(xs, task.val_x)
    assert raw_ids(build_task(npz_cfg(tmp_path / "u.npz", **{"validation.fraction": 0.15, "validation.stratified": stratified})), task.val_x) == v_ids
    classes = {int(t) for t in task.val_y}  # per-class accuracy of every class V holds
    assert set(task.evaluate(task.build_model(), "val", 16)) == {"acc", "loss"} | {f"acc/{c}" for c in classes}
    assert task.data_description()["validation"]["size"] == 30


@pytest.mark.parametrize("profile", ["power", "endpoints"])
def test_imbalanced_validation_set_follows_the_documented_profile(tmp_path, profile):
    unique_npz(tmp_path / "u.npz", n_train=1000)
    rho = 0.6
    task = build_task(npz_cfg(tmp_path / "u.npz", **{"validation.fraction": 0.4, "validation.imbalance": rho,
                                                      "validation.imbalance_profile": profile}))
    # carved V: 400 examples, 40 per class; the imbalanced V keeps floor(p_c * 200) of class c
    c = np.arange(10)
    raw = rho**c if profile == "power" else rho ** (c / 9)
    expected = np.minimum(np.floor(raw / raw.sum() * 200), 40).astype(int)
    assert np.bincount(task.val_y.numpy(), minlength=10).tolist() == expected.tolist()
    assert len(task.pool_y) == 600  # the carved remainder is not handed to clients


def test_separate_dataset_validation_set(tmp_path):
    unique_npz(tmp_path / "u.npz")
    unique_npz(tmp_path / "v.npz", n_train=50, classes=4, seed=1)  # classes "0".."3": a subset
    task = build_task(npz_cfg(tmp_path / "u.npz", **{"validation.source": "dataset",
                                                      "validation.dataset": {"name": "npz", "path": str(tmp_path / "v.npz")}}))
    assert len(task.val_y) == 50 and len(task.pool_y) == 200  # clients keep the whole training pool
    assert set(task.val_y.tolist()) <= {0, 1, 2, 3}
    test_split = build_task(npz_cfg(tmp_path / "u.npz", **{"validation.source": "dataset", "validation.split": "test",
                                                            "validation.dataset": {"name": "npz", "path": str(tmp_path / "v.npz")}}))
    assert len(test_split.val_y) == 40


def test_separate_dataset_with_another_label_space_or_shape_is_an_error(tmp_path):
    unique_npz(tmp_path / "u.npz")
    unique_npz(tmp_path / "wide.npz", classes=12)
    with pytest.raises(ValueError, match="label space"):
        build_task(npz_cfg(tmp_path / "u.npz", **{"validation.source": "dataset",
                                                   "validation.dataset": {"name": "npz", "path": str(tmp_path / "wide.npz")}}))
    unique_npz(tmp_path / "big.npz", size=10)
    with pytest.raises(ValueError, match="validation.dataset"):
        build_task(npz_cfg(tmp_path / "u.npz", **{"validation.source": "dataset",
                                                   "validation.dataset": {"name": "npz", "path": str(tmp_path / "big.npz")}}))


def test_validation_config_errors():
    with pytest.raises(ConfigError, match="validation.source"):
        build_simulation(validate(tiny(**{"recipe.weighting": "fedvg"})))
    with pytest.raises(ConfigError, match="validation.dataset"):
        validate(tiny(**{"validation.source": "dataset"}))
    with pytest.raises(ConfigError, match="unknown dataset"):
        validate(tiny(**{"validation.source": "dataset", "validation.dataset": {"name": "nope"}}))
    with pytest.raises(ConfigError, match="validation.fraction"):
        validate(tiny(**{"validation.source": "carve", "validation.fraction": 1.5}))
    with pytest.raises(ConfigError, match="weighting"):
        validate(tiny(**{"recipe.weighting": {"name": "fedvg", "granularity": "neuron"}}))


# -- combinations and run outputs from config ------------------------------------------------------


@pytest.mark.parametrize("over", [
    {"recipe.components": [{"name": "fedprox", "mu": 0.01}]},
    {"recipe.components": [{"name": "scaffold"}]},
    {"recipe.components": [{"name": "fednova"}], "recipe.weighting": {"name": "fedvg", "granularity": "layer"}},
])
def test_fedvg_combines_with_other_methods_from_config(over):
    cfg = validate(tiny(**{"recipe.weighting": "fedvg", "validation.source": "carve", "server.rounds": 2,
                           "eval.local": False, **over}))
    sim = build_simulation(cfg)
    rows = []
    sim.run(on_round=lambda r, row, ev: rows.append(row))
    assert type(sim.recipe.weighting).__name__ == "FedVGWeighting"
    assert [c.name for c in sim.recipe.components] == [c["name"] for c in over["recipe.components"]]
    assert all(row["fedvg/server_examples"] == 3 * sim.task.num_val_examples() for row in rows)
    assert math.isfinite(rows[-1]["test/acc"])


def test_run_writes_partition_weights_and_plot(tmp_path):
    cfg = validate(tiny(**{"recipe.weighting": {"name": "fedvg", "granularity": "block"}, "validation.source": "carve",
                           "server.rounds": 2, "eval.local": False, "model.norm": "batch",
                           "run.plots": True}))
    out = execute(cfg, tmp_path / "run")
    part = json.loads((out.run_dir / "partition.json").read_text())
    assert len(part["client_label_counts"]) == 6 and part["validation"]["size"] == sum(part["validation"]["class_counts"])
    lines = (out.run_dir / "client_weights.jsonl").read_text().splitlines()
    assert len(lines) == 2 and set(json.loads(lines[0])["weights"]) == set(build_simulation(cfg).global_model.state_dict())
    assert (out.run_dir / "plots" / "client_weights.png").stat().st_size > 0
    assert "server validation set" in (out.run_dir / "summary.md").read_text()


@pytest.mark.parametrize("clients", [20, 50])
def test_client_weight_plot_for_many_clients(tmp_path, clients):
    from fedsight.reporting import client_weight_matrix, plot_client_weights

    rng = np.random.default_rng(0)
    with open(tmp_path / "client_weights.jsonl", "w") as f:
        for r in range(1, 31):
            ids = sorted(rng.choice(clients, size=10, replace=False).tolist())
            w = rng.dirichlet(np.ones(10)).tolist()
            f.write(json.dumps({"round": r, "clients": ids, "weights": w}) + "\n")
    counts = rng.integers(0, 30, size=(clients, 10))
    path = plot_client_weights(tmp_path, label_counts=counts)
    assert path.name == "client_weights.png" and path.stat().st_size > 0
    m, rounds, per_key = client_weight_matrix([json.loads(x) for x in open(tmp_path / "client_weights.jsonl")])
    assert m.shape[1] == 30 and np.isfinite(m).sum() == 300 and not per_key
    assert np.allclose(np.nansum(m, axis=0), 10.0)  # each round's relative weights sum to |S_t|


def test_model_blocks_cover_every_state_key_once():
    from fedsight.models import build_model

    for name, params in [("cnn", {"norm": "batch"}), ("resnet8", {}), ("mobilenetv2", {"width_mult": 0.25})]:
        m = build_model(name, params, num_classes=10, in_channels=3, image_size=16)
        keys = [k for v in m.blocks().values() for k in v]
        assert sorted(keys) == sorted(m.state_dict()) and len(keys) == len(set(keys)), name
        assert list(m.blocks())[-1] == "head"
    assert len(build_model("resnet8", {}, num_classes=10, in_channels=3, image_size=16).blocks()) == 5  # stem, 3 blocks, head
