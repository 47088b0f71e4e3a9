"""SCAFFOLD (Karimireddy et al. 2020, Algorithm 1 option II) and FedDyn (Acar et al. 2021, Algorithm 1)
checked against hand computations of the papers' update equations on the toy softmax regression.

The references below track the global model, the client models and every control variate / linear
term / server state by hand, with gradients of the toy model from fresh autograd calls; they never call
the implementation's helpers.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fedsight.api
from fedsight import registry as R
from fedsight.api import build_simulation, execute
from fedsight.config import validate
from fedsight.engine.simulation import sample_clients
from fedsight.training import Component
from fedsight.recipe.feddyn import FedDynParams
from fedsight.runs import RunDir

from helpers import tiny, toy_sim

NAMES = ("head.weight", "head.bias")
SEED = 1  # toy sampling with 2 of 3 clients: round 1 = {0, 2}, round 2 = {1, 2}


# -- reference pieces ----------------------------------------------------------------------------


def ce_grad(task, k, theta):
    """Full-batch gradient of client k's cross-entropy at theta = {head.weight, head.bias}."""
    w = theta["head.weight"].detach().clone().requires_grad_(True)
    b = theta["head.bias"].detach().clone().requires_grad_(True)
    loss = F.cross_entropy(task.xs[k] @ w.T + b, task.ys[k])
    gw, gb = torch.autograd.grad(loss, (w, b))
    return {"head.weight": gw, "head.bias": gb}


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if n in NAMES}


def zeros_like(theta):
    return {n: torch.zeros_like(v) for n, v in theta.items()}


def sampled_sets(rounds, m=2, n=3, seed=SEED):
    return [sample_clients(seed, r, n, m) for r in range(1, rounds + 1)]


def assert_close(a, b, msg="", atol=1e-6):
    for n in NAMES:
        torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=atol, msg=lambda s: f"{msg} {n}: {s}")


def differs(a, b, tol=1e-4):
    return any((a[n] - b[n]).abs().max() > tol for n in NAMES)


def uniform():
    return R.build(R.WEIGHTINGS, "uniform")


def sgd(lr):
    return R.build(R.SERVER_OPTIMIZERS, "sgd", {"lr": lr})


class Recorder(Component):
    """Records each client's local model (received global + delta) per round."""

    name = "recorder"

    def __init__(self):
        self.local = {}

    def client_end(self, ctx, result):
        self.local[(ctx.round, ctx.client_id)] = {k: (ctx.global_params[k] + d).clone() for k, d in result.delta.items()}


def test_toy_sampling_has_the_structure_the_tests_rely_on():
    s1, s2 = sampled_sets(2)
    assert set(s1) != set(s2)  # a client first seen in round 2 (zero c_i, non-zero c)
    assert set(s1) & set(s2)  # a client seen in both rounds (persistent c_i / linear term)
    assert set(range(3)) - set(s1)  # some client not sampled in round 1


# == SCAFFOLD ====================================================================================

LR, K = 0.5, 2


def scaffold_reference(task, x0, rounds_sampled, lr, K, eta_g):
    """Algorithm 1 of Karimireddy et al. (2020) with option II, written out."""
    N = task.num_clients
    x = {n: v.clone() for n, v in x0.items()}
    c = zeros_like(x)
    c_i = {}
    for S in rounds_sampled:
        dys, dcs = [], []
        for i in S:
            ci = c_i.get(i, zeros_like(x))
            y = {n: v.clone() for n, v in x.items()}
            for _ in range(K):  # line 10: y <- y - eta_l (g_i(y) - c_i + c)
                g = ce_grad(task, i, y)
                y = {n: y[n] - lr * (g[n] - ci[n] + c[n]) for n in y}
            ci_new = {n: ci[n] - c[n] + (x[n] - y[n]) / (K * lr) for n in x}  # line 12, option II
            dys.append({n: y[n] - x[n] for n in x})
            dcs.append({n: ci_new[n] - ci[n] for n in x})
            c_i[i] = ci_new
        x = {n: x[n] + eta_g * sum(d[n] for d in dys) / len(S) for n in x}  # line 16
        c = {n: c[n] + len(S) / N * (sum(d[n] for d in dcs) / len(S)) for n in x}  # line 17
    return x, c, c_i


def scaffold_sim(rounds=2, eta_g=1.0, components=None):
    comps = components if components is not None else [R.build(R.COMPONENTS, "scaffold")]
    return toy_sim(components=comps, weighting=uniform(), server_opt=sgd(eta_g), lr=LR, steps=K,
                   clients_per_round=2, rounds=rounds, seed=SEED)


@pytest.mark.parametrize("rounds,eta_g", [(1, 1.0), (2, 1.0), (2, 0.5)])
def test_scaffold_equals_algorithm1_option2(rounds, eta_g):
    sim = scaffold_sim(rounds, eta_g)
    x0 = params_of(sim.global_model)
    x_ref, c_ref, ci_ref = scaffold_reference(sim.task, x0, sampled_sets(rounds), LR, K, eta_g)
    sim.run()
    assert_close(params_of(sim.global_model), x_ref, "global model")
    comp = sim.recipe.components[0]
    assert_close(comp.state_dict()["c"], c_ref, "server control c")
    assert sim.store.clients("scaffold") == sorted(ci_ref)
    for i, ref in ci_ref.items():
        assert_close(sim.store.get("scaffold", i), ref, f"client control c_{i}")
    if rounds == 2:
        # the controls matter: the same run without SCAFFOLD ends elsewhere
        plain = scaffold_sim(rounds, eta_g, components=[])
        plain.run()
        assert differs(params_of(plain.global_model), x_ref)


def test_scaffold_uploads_delta_c_and_broadcasts_c():
    seen = {}

    class Spy(Component):
        name = "spy"

        def client_end(self, ctx, result):
            seen[(ctx.round, ctx.client_id)] = (
                {k: v.clone() for k, v in ctx.broadcast["scaffold"].items()},
                {k: v.clone() for k, v in result.extras["scaffold"].items()},
            )

    sim = scaffold_sim(2, components=[R.build(R.COMPONENTS, "scaffold"), Spy()])
    x0 = params_of(sim.global_model)
    s1, s2 = sampled_sets(2)
    _, c1, ci1 = scaffold_reference(sim.task, x0, [s1], LR, K, 1.0)
    sim.run()
    # round 1: c = 0 is sent, and Delta c_i = c_i+ - 0
    for i in s1:
        sent, dc = seen[(1, i)]
        assert all(torch.count_nonzero(sent.get(n, torch.zeros(1))) == 0 for n in NAMES)
        assert_close(dc, ci1[i], f"Delta c_{i} round 1")
    # round 2: the server control after round 1 is what every sampled client received
    for i in s2:
        assert_close(seen[(2, i)][0], c1, f"broadcast to client {i}")


def test_scaffold_client_controls_survive_a_checkpoint_round_trip(tmp_path):
    a = scaffold_sim(2)
    a.run(stop_after=1)
    run = RunDir(tmp_path)
    run.save_checkpoint(1, a.state_dict(), keep_last=0)
    _, state = run.load_latest_checkpoint()  # through safetensors + JSON, not just in memory
    b = scaffold_sim(2)
    b.load_state_dict(state)
    assert b.store.clients("scaffold") == a.store.clients("scaffold") == sampled_sets(1)[0]
    for i in a.store.clients("scaffold"):
        for n, v in a.store.get("scaffold", i).items():
            assert torch.equal(b.store.get("scaffold", i)[n], v)
    ca, cb = a.recipe.components[0].state_dict()["c"], b.recipe.components[0].state_dict()["c"]
    assert set(ca) == set(cb) == set(NAMES) and all(torch.equal(ca[n], cb[n]) for n in NAMES)
    # without the client controls, round 2 would differ: they are really used
    lost = scaffold_sim(2)
    lost.load_state_dict({**state, "client_state": {}})
    a.run()
    b.run()
    lost.run()
    for n in NAMES:
        assert torch.equal(dict(a.global_model.named_parameters())[n], dict(b.global_model.named_parameters())[n])
    assert differs(params_of(a.global_model), params_of(lost.global_model), tol=1e-7)


def test_scaffold_plus_fedavgm_runs_from_config_alone_and_resumes_bit_identically(tmp_path, monkeypatch):
    # TINY's 4 rounds leave the tiny CNN at chance level even for plain FedAvg: train a little longer
    cfg = validate(tiny(**{"recipe.components": [{"name": "scaffold"}],
                           "server.optimizer": {"name": "fedavgm", "momentum": 0.9},
                           "server.rounds": 8, "train.lr": 0.2, "train.epochs": 2}))
    out = execute(cfg, tmp_path / "r")
    assert out.status == "complete"
    acc = out.last_row["test/acc"]
    assert math.isfinite(acc) and acc > 0.2  # 10 digit classes: chance is 0.1
    files = sorted((out.run_dir / "client_state" / "scaffold").glob("*.safetensors"))
    assert files
    # every client sampled at least once has exactly one live version
    clients = {f.name.split("-r")[0] for f in files}
    assert len(clients) == len(files)

    # plots and summary of the second run are not under test here (and cost seconds)
    monkeypatch.setattr(fedsight.api, "finish", lambda *args, **kwargs: None)
    cut = execute(cfg, tmp_path / "cut", stop_after=2)
    assert cut.status == "stopped"
    assert execute(cfg, tmp_path / "cut", resume=True).status == "complete"
    ra, sa = RunDir(tmp_path / "r").load_latest_checkpoint()
    rb, sb = RunDir(tmp_path / "cut").load_latest_checkpoint()
    assert ra == rb == cfg.server.rounds
    for k, v in sa["model"].items():
        assert torch.equal(v, sb["model"][k]), k
    (ka,), (kb,) = sa["components"], sb["components"]
    for n, v in sa["components"][ka]["c"].items():
        assert torch.equal(v, sb["components"][kb]["c"][n]), n


# == FedDyn ======================================================================================

ALPHA = 0.3


def feddyn_reference(task, theta0, rounds_sampled, lr, K, alpha, max_norm=None):
    """Algorithm 1 of Acar et al. (2021), written out; returns (theta, h, lin, clip_was_active)."""
    m = task.num_clients
    theta = {n: v.clone() for n, v in theta0.items()}
    h = zeros_like(theta)
    lin = {}
    clipped = False
    for P in rounds_sampled:
        local = []
        for k in P:
            lk = lin.get(k, zeros_like(theta))
            w = {n: v.clone() for n, v in theta.items()}
            for _ in range(K):
                # gradient of L_k(w) - <lin_k, w> + alpha/2 ||w - theta^{t-1}||^2
                g = ce_grad(task, k, w)
                g = {n: g[n] - lk[n] + alpha * (w[n] - theta[n]) for n in w}
                if max_norm is not None:
                    leaves = [torch.zeros_like(w[n]) for n in NAMES]
                    for leaf, n in zip(leaves, NAMES):
                        leaf.grad = g[n].clone()
                    total = torch.nn.utils.clip_grad_norm_(leaves, max_norm)
                    clipped |= bool(total > max_norm)
                    g = {n: leaf.grad for leaf, n in zip(leaves, NAMES)}
                w = {n: w[n] - lr * g[n] for n in w}
            lin[k] = {n: lk[n] - alpha * (w[n] - theta[n]) for n in w}  # line 6
            local.append(w)
        h = {n: h[n] - alpha / m * sum(w[n] - theta[n] for w in local) for n in h}  # line 9
        theta = {n: sum(w[n] for w in local) / len(P) - h[n] / alpha for n in h}  # line 10
    return theta, h, lin, clipped


def feddyn_sim(clients_per_round, rounds=2, max_grad_norm=None, extra=()):
    comp = R.build(R.COMPONENTS, "feddyn", {"alpha": ALPHA, "max_grad_norm": max_grad_norm})
    return toy_sim(components=[comp, *extra], weighting=uniform(), lr=LR, steps=K,
                   clients_per_round=clients_per_round, rounds=rounds, seed=SEED)


@pytest.mark.parametrize("clients_per_round", [3, 2])
def test_feddyn_equals_algorithm1(clients_per_round):
    sim = feddyn_sim(clients_per_round)
    theta_ref, h_ref, lin_ref, _ = feddyn_reference(
        sim.task, params_of(sim.global_model), sampled_sets(2, clients_per_round), LR, K, ALPHA
    )
    sim.run()
    assert_close(params_of(sim.global_model), theta_ref, "global model")
    assert_close(sim.recipe.components[0].state_dict()["h"], h_ref, "server state h")
    assert sim.store.clients("feddyn") == sorted(lin_ref)
    for k, ref in lin_ref.items():
        assert_close(sim.store.get("feddyn", k), ref, f"linear term of client {k}")
    # the regulariser and the h correction matter: plain uniform FedAvg ends elsewhere
    plain = toy_sim(weighting=uniform(), lr=LR, steps=K, clients_per_round=clients_per_round, rounds=2, seed=SEED)
    plain.run()
    assert differs(params_of(plain.global_model), theta_ref)


def test_feddyn_linear_term_after_first_round_is_closed_form():
    rec = Recorder()
    sim = feddyn_sim(2, rounds=1, extra=[rec])
    theta0 = params_of(sim.global_model)
    sim.run()
    (s1,) = sampled_sets(1)
    assert sorted(k for _, k in rec.local) == s1
    for k in s1:
        lin = sim.store.get("feddyn", k)
        for n in NAMES:
            torch.testing.assert_close(lin[n], -ALPHA * (rec.local[(1, k)][n] - theta0[n]), rtol=1e-5, atol=1e-7)
    assert sim.store.get("feddyn", ({0, 1, 2} - set(s1)).pop()) is None


def test_feddyn_with_gradient_clipping_matches_clip_grad_norm_reference():
    max_norm = 0.2
    sim = feddyn_sim(2, max_grad_norm=max_norm)
    theta_ref, h_ref, lin_ref, clipped = feddyn_reference(
        sim.task, params_of(sim.global_model), sampled_sets(2), LR, K, ALPHA, max_norm=max_norm
    )
    assert clipped  # the threshold is active in this example
    sim.run()
    assert_close(params_of(sim.global_model), theta_ref, "global model")
    assert_close(sim.recipe.components[0].state_dict()["h"], h_ref, "server state h")
    for k, ref in lin_ref.items():
        assert_close(sim.store.get("feddyn", k), ref, f"linear term of client {k}")
    unclipped, *_ = feddyn_reference(sim.task, params_of(feddyn_sim(2).global_model), sampled_sets(2), LR, K, ALPHA)
    assert differs(unclipped, theta_ref)


def test_feddyn_state_survives_a_checkpoint_round_trip(tmp_path):
    a = feddyn_sim(2)
    a.run(stop_after=1)
    run = RunDir(tmp_path)
    run.save_checkpoint(1, a.state_dict(), keep_last=0)
    _, state = run.load_latest_checkpoint()
    b = feddyn_sim(2)
    b.load_state_dict(state)
    ha, hb = a.recipe.components[0].state_dict()["h"], b.recipe.components[0].state_dict()["h"]
    assert set(ha) == set(NAMES) and all(torch.equal(ha[n], hb[n]) for n in NAMES)
    for k in a.store.clients("feddyn"):
        for n, v in a.store.get("feddyn", k).items():
            assert torch.equal(b.store.get("feddyn", k)[n], v)
    lost = feddyn_sim(2)
    lost.load_state_dict({**state, "components": {}})  # h back to zero
    a.run()
    b.run()
    lost.run()
    for n in NAMES:
        assert torch.equal(params_of(a.global_model)[n], params_of(b.global_model)[n])
    assert differs(params_of(a.global_model), params_of(lost.global_model), tol=1e-7)


def test_feddyn_params_are_validated_and_it_runs_from_config():
    assert FedDynParams().alpha == 0.1 and FedDynParams().max_grad_norm == 10.0
    assert FedDynParams(max_grad_norm=None).max_grad_norm is None
    for bad in ({"alpha": 0.0}, {"alpha": -1.0}, {"max_grad_norm": 0.0}, {"beta": 1.0}):
        with pytest.raises(ValueError):
            FedDynParams(**bad)
    with pytest.raises(ValueError):
        validate(tiny(**{"recipe.components": [{"name": "feddyn", "alpha": 0}]}))
    cfg = validate(tiny(**{"recipe.components": [{"name": "feddyn", "alpha": 0.1}], "recipe.weighting": "uniform",
                           "server.rounds": 8, "train.lr": 0.2, "train.epochs": 2, "eval.local": False}))
    sim = build_simulation(cfg)
    rows = []
    sim.run(on_round=lambda r, row, ev: rows.append(row))
    acc = rows[-1]["test/acc"]
    assert math.isfinite(acc) and acc > 0.3  # chance is 0.1
