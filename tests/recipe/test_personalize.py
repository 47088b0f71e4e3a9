"""FedAlt, pFedMe and Ditto (fedsight.recipe.personalize) against hand computations in plain torch.

The toy model is a one-hidden-layer tanh network (backbone Linear+Tanh, head Linear) on ToyTask's random
points; local steps are full-batch, so every update below is written out with an explicit forward
formula and ``torch.autograd.grad``, independently of the engine's training loop.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from fedsight import registry as R
from fedsight.api import build_simulation, execute
from fedsight.training.local import SGD_TRAINER, LocalTraining
from fedsight.config import ConfigError, validate
from fedsight.engine.simulation import Recipe, Schedule, Simulation, Stage
from fedsight.models.base import FedModel
from fedsight.recipe.personalize import DittoTrainer, FedAltTrainer, PFedMeTrainer
from fedsight.runs import RunDir

from helpers import ToyTask, tiny


BACK = ["backbone.0.weight", "backbone.0.bias"]
HEAD = ["head.weight", "head.bias"]


# -- a small two-layer task with per-client local test sets --------------------------------------


class MLP(FedModel):
    def __init__(self, dim: int, hidden: int, classes: int):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, classes)
        self.feature_dim = hidden


class PTask(ToyTask):
    """ToyTask with an MLP and 5 local test points per client (split = client id)."""

    def __init__(self, sizes=(4, 6, 5), dim=3, classes=3, hidden=4, seed=0):
        super().__init__(sizes, dim, classes, seed)
        g = torch.Generator().manual_seed(seed + 100)
        self.hidden = hidden
        self.local_x = [torch.randn(5, dim, generator=g) for _ in sizes]
        self.local_y = [torch.randint(0, classes, (5,), generator=g) for _ in sizes]

    def build_model(self):
        return MLP(self.dim, self.hidden, self.classes)

    def num_test_examples(self, client):
        return len(self.local_y[client])

    def eval_batches(self, split, batch_size=512):
        if split == "test" or split == "val":
            yield from super().eval_batches(split, batch_size)
            return
        yield self.local_x[split], self.local_y[split]


def fwd(p, x):
    return torch.tanh(x @ p["backbone.0.weight"].T + p["backbone.0.bias"]) @ p["head.weight"].T + p["head.bias"]


def f(p, x, y):
    return F.cross_entropy(fwd(p, x), y)


def grads(p, keys, x, y):
    q = {k: v.detach().clone().requires_grad_(k in keys) for k, v in p.items()}
    g = torch.autograd.grad(f(q, x, y), [q[k] for k in keys])
    return dict(zip(keys, g))


def gd(p, keys, x, y, lr, steps, prox=None):
    """``steps`` full-batch gradient steps on ``keys``; ``prox = (mu, target)`` adds mu (p - target)."""
    p = dict(p)
    for _ in range(steps):
        g = grads(p, keys, x, y)
        for k in keys:
            step = g[k] if prox is None else g[k] + prox[0] * (p[k] - prox[1][k])
            p[k] = p[k] - lr * step
    return p


def sharing(name, **params):
    return R.build(R.SHARING, name, params)


def make_recipe(components=(), share="global", weighting="data_size", server_lr=1.0):
    components = list(components)
    trainer = next((c.trainer() for c in components if c.trainer() is not None), SGD_TRAINER)
    return Recipe(
        weighting=R.build(R.WEIGHTINGS, weighting), aggregator=R.build(R.AGGREGATORS, "mean"),
        server_optimizer=R.build(R.SERVER_OPTIMIZERS, "sgd", {"lr": server_lr}),
        sharing=share if not isinstance(share, str) else sharing(share), components=components, trainer=trainer,
    )


def comp(name, **params):
    return R.build(R.COMPONENTS, name, params)


def make_sim(components=(), share="global", task=None, lr=0.1, steps=1, rounds=1, cpr=None, seed=0,
             momentum=0.0, weighting="data_size", server_lr=1.0):
    task = task or PTask()
    local = LocalTraining(batch_size=1000, lr=lr, epochs=None, steps=steps, momentum=momentum)
    schedule = Schedule(rounds=rounds, clients_per_round=cpr or task.num_clients, eval_local=True, eval_initial=False)
    return Simulation(task, make_recipe(components, share, weighting, server_lr), local, schedule, seed)


def state(sim):
    return {k: v.detach().clone() for k, v in sim.global_model.state_dict().items()}


def one_client(sim, cid=0, r=1):
    """Train one client and keep its update as the engine does (state saves take effect on accept)."""
    res, state = sim.run_client(sim.begin_round(r), cid)
    assert sim.keep_client(res, state)
    return res


def close(a, b, atol=1e-6):
    return torch.allclose(a, b, atol=atol, rtol=1e-5)


def pooled(task, params_of):
    """(accuracy, mean loss) pooled over every client's local test set, client c evaluated with
    ``params_of(c)``: WMA (thesis eq. 4.4) is the pooled accuracy."""
    correct = n = 0
    loss = 0.0
    with torch.no_grad():
        for c in range(task.num_clients):
            out = fwd(params_of(c), task.local_x[c])
            correct += int((out.argmax(1) == task.local_y[c]).sum())
            loss += float(F.cross_entropy(out, task.local_y[c], reduction="sum"))
            n += len(task.local_y[c])
    return correct / n, loss / n


# -- FedAlt ------------------------------------------------------------------------------------------


def test_fedalt_one_round_matches_personal_then_shared_passes():
    lr, steps, pe = 0.3, 2, 3
    sim = make_sim([comp("fedalt", personal_epochs=pe)], sharing("personal", part="head"), lr=lr, steps=steps)
    g0 = state(sim)
    res = one_client(sim, 0)
    task = sim.task
    x, y = task.xs[0], task.ys[0]
    # personal pass: pe epochs of full-batch GD on the head, backbone fixed; then the shared pass
    p = gd(g0, HEAD, x, y, lr, pe * 1)
    p = gd(p, BACK, x, y, lr, steps)
    assert set(res.delta) == set(BACK)  # only the shared part is uploaded
    for k in BACK:
        assert close(res.delta[k], p[k] - g0[k]), k
    work = sim.work_model.state_dict()
    for k in HEAD:
        assert close(work[k], p[k]), k
    # train/loss: the shared pass's mean objective, i.e. f at the two shared iterates
    p1 = gd(g0, HEAD, x, y, lr, pe)
    losses = [f(p1, x, y)]
    losses.append(f(gd(p1, BACK, x, y, lr, 1), x, y))
    assert res.metrics["train/loss"] == pytest.approx(float(sum(losses)) / 2, rel=1e-5)
    # FLOPs: the personal pass backpropagates through the head only
    n = task.num_train_examples(0)
    assert res.flops == pytest.approx(pe * sim.cost.train_step(n, "head") + steps * sim.cost.train_step(n, "all"))


def test_fedsim_differs_from_fedalt_and_matches_joint_steps():
    lr, steps = 0.3, 2
    fedsim = make_sim([], sharing("personal", part="head"), lr=lr, steps=steps)
    fedalt = make_sim([comp("fedalt")], sharing("personal", part="head"), lr=lr, steps=steps)
    g0 = state(fedsim)
    a, b = one_client(fedsim, 1), one_client(fedalt, 1)
    x, y = fedsim.task.xs[1], fedsim.task.ys[1]
    joint = gd(g0, BACK + HEAD, x, y, lr, steps)
    assert all(close(a.delta[k], joint[k] - g0[k]) for k in BACK)
    assert all(not torch.allclose(a.delta[k], b.delta[k]) for k in BACK)


def test_fedalt_personal_heads_are_kept_and_used_for_local_evaluation():
    sim = make_sim([comp("fedalt")], sharing("personal", part="head"), lr=0.5, steps=2, rounds=2)
    rows = []
    sim.run(on_round=lambda r, row, ev: rows.append(row))
    heads = [sim.store.get("personal", c) for c in range(3)]
    assert all(set(h) == set(HEAD) for h in heads)
    assert not torch.allclose(heads[0]["head.weight"], heads[1]["head.weight"])
    glob = state(sim)
    acc, loss = pooled(sim.task, lambda c: {**glob, **heads[c]})
    assert rows[-1]["local/wma"] == pytest.approx(acc)
    assert rows[-1]["local/loss"] == pytest.approx(loss, rel=1e-5)
    assert loss != pytest.approx(pooled(sim.task, lambda c: glob)[1], rel=1e-3)
    # the global model's own head never trained (only shared entries are aggregated)
    g_init = make_sim([comp("fedalt")], sharing("personal", part="head")).global_model.state_dict()
    assert all(torch.equal(glob[k], g_init[k]) for k in HEAD)


@pytest.mark.parametrize("share", ["global", "local"])
def test_fedalt_without_personal_and_shared_parts_is_an_error(share):
    sim = make_sim([comp("fedalt")], share)
    with pytest.raises(ValueError, match="recipe.sharing"):
        sim.run()


# -- pFedMe ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("share", ["global", "personal"])
def test_pfedme_local_steps_match_hand_inner_loop(share):
    lam, K, plr, lr, steps = 3.0, 2, 0.05, 0.2, 2
    shr = sharing("personal", part="head") if share == "personal" else sharing("global")
    sim = make_sim([comp("pfedme", lam=lam, inner_steps=K, personal_lr=plr)], shr, lr=lr, steps=steps)
    g0 = state(sim)
    res = one_client(sim, 2)
    x, y = sim.task.xs[2], sim.task.ys[2]
    shared_keys = BACK + HEAD if share == "global" else BACK
    pers_keys = [] if share == "global" else HEAD
    w = {k: g0[k] for k in shared_keys}
    v = {k: g0[k] for k in pers_keys}
    losses = []
    for _ in range(steps):
        th = dict(w)  # theta starts at w_r
        losses.append(float(f({**th, **v}, x, y)))
        for _ in range(K):
            g = grads({**th, **v}, shared_keys + pers_keys, x, y)
            th = {k: th[k] - plr * (g[k] + lam * (th[k] - w[k])) for k in shared_keys}
            v = {k: v[k] - plr * g[k] for k in pers_keys}  # personal: no proximal term
        w = {k: w[k] - lr * lam * (w[k] - th[k]) for k in shared_keys}
    assert set(res.delta) == set(shared_keys)
    for k in shared_keys:
        assert close(res.delta[k], w[k] - g0[k]), k
    work = sim.work_model.state_dict()
    for k in shared_keys:  # the model holds w for the shared parameters ...
        assert close(work[k], w[k]), k
    for k in pers_keys:  # ... and the personalised theta for the personal ones
        assert close(work[k], v[k]), k
    assert res.metrics["train/loss"] == pytest.approx(sum(losses) / steps, rel=1e-5)
    n = sim.task.num_train_examples(2)
    assert res.flops == pytest.approx(K * steps * sim.cost.train_step(n, "all"))


def test_pfedme_large_lambda_prox_point_tends_to_w():
    """theta_tilde = prox_{f/lambda}(w) = w - grad f(theta_tilde)/lambda: with lr = 1/lambda the update
    lands on theta_tilde, which approaches w - grad f(w)/lambda (hence w) as lambda grows."""
    dists = []
    for lam in (1e2, 1e3):
        sim = make_sim([comp("pfedme", lam=lam, inner_steps=60, personal_lr=0.5 / lam)], lr=1.0 / lam)
        g0 = state(sim)
        res = one_client(sim, 0)
        keys = BACK + HEAD
        g = grads(g0, keys, sim.task.xs[0], sim.task.ys[0])
        diff = torch.cat([res.delta[k].flatten() for k in keys])  # theta_tilde - w
        expected = torch.cat([-g[k].flatten() / lam for k in keys])
        assert (diff - expected).norm() <= 0.05 * expected.norm()
        dists.append(float(diff.norm()))
    assert dists[1] < dists[0] / 8


def test_pfedme_server_beta_is_server_sgd_lr():
    beta = 0.4
    sim = make_sim([comp("pfedme", lam=2.0, inner_steps=2, personal_lr=0.05)], weighting="uniform", server_lr=beta)
    g0 = state(sim)
    deltas = [one_client(sim, c).delta for c in range(3)]
    sim.train_round(1)
    glob = state(sim)
    for k in deltas[0]:
        local_mean = sum(g0[k] + d[k] for d in deltas) / 3
        assert close(glob[k], (1 - beta) * g0[k] + beta * local_mean), k


def test_pfedme_refuses_momentum_and_a_stage_without_shared_parameters():
    with pytest.raises(ValueError, match="momentum"):
        one_client(make_sim([comp("pfedme")], momentum=0.9))
    with pytest.raises(ValueError, match="recipe.sharing"):
        one_client(make_sim([comp("pfedme")], "local"))


# -- Ditto, federated stage -------------------------------------------------------------------------


def test_ditto_upload_is_fedavgs_and_personal_model_is_prox_sgd():
    lr, steps, pe, mu = 0.2, 2, 3, 0.5
    plain = make_sim([], lr=lr, steps=steps)
    sim = make_sim([comp("ditto", mu=mu, personal_epochs=pe)], lr=lr, steps=steps)
    g0 = state(sim)
    a, b = one_client(plain, 0), one_client(sim, 0)
    assert a.delta.keys() == b.delta.keys()
    assert all(torch.equal(a.delta[k], b.delta[k]) for k in a.delta)
    assert a.metrics["train/loss"] == b.metrics["train/loss"]
    # the work model is left as after the global-model update
    wa, wb = plain.work_model.state_dict(), sim.work_model.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # v_k: pe full-batch steps of prox-GD from the received global model
    x, y = sim.task.xs[0], sim.task.ys[0]
    v = gd(g0, BACK + HEAD, x, y, lr, pe, prox=(mu, g0))
    v_k = sim.store.get("ditto", 0)
    assert set(v_k) == set(g0)
    assert all(close(v_k[k], v[k]) for k in v), "personal model"
    n = sim.task.num_train_examples(0)
    assert b.flops == pytest.approx((steps + pe) * sim.cost.train_step(n, "all"))


def test_ditto_personal_model_continues_across_rounds_towards_the_new_global():
    lr, mu = 0.3, 1.0
    sim = make_sim([comp("ditto", mu=mu, personal_epochs=2)], lr=lr, steps=1, rounds=2)
    sim.run(stop_after=1)
    w1, v1 = state(sim), sim.store.get("ditto", 1)
    sim.run()
    x, y = sim.task.xs[1], sim.task.ys[1]
    v2 = gd(v1, BACK + HEAD, x, y, lr, 2, prox=(mu, w1))
    got = sim.store.get("ditto", 1)
    assert all(close(got[k], v2[k]) for k in v2)


def test_ditto_evaluates_clients_on_personal_models_and_restores():
    sim = make_sim([comp("ditto", mu=0.1, personal_epochs=5)], lr=0.5, steps=1, cpr=2)
    sim.run()
    trained = sim.store.clients("ditto")
    assert len(trained) == 2
    glob = state(sim)
    out = sim.evaluate()
    # clients that never trained a personal model are evaluated on the global model
    acc, loss = pooled(sim.task, lambda c: sim.store.get("ditto", c) if c in trained else glob)
    assert out["local/wma"] == pytest.approx(acc)
    assert out["local/loss"] == pytest.approx(loss, rel=1e-5)
    # the check can tell personal from global evaluation apart
    assert loss != pytest.approx(pooled(sim.task, lambda c: glob)[1], rel=1e-3)
    model = sim.load_client_model(trained[0])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with sim.eval_context(model, trained[0]):
        v_k = sim.store.get("ditto", trained[0])
        assert all(torch.equal(model.state_dict()[k], v_k[k]) for k in v_k)
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)
    untrained = next(c for c in range(3) if c not in trained)
    for split in ("test", untrained):
        with sim.eval_context(model, split):
            assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)


def test_ditto_resume_from_state_dict_is_bit_identical():
    def build():
        return make_sim([comp("ditto", mu=0.2, personal_epochs=1)], lr=0.3, steps=2, rounds=3, cpr=2)

    full = build()
    full.run()
    cut = build()
    cut.run(stop_after=1)
    saved = cut.state_dict()
    resumed = build()
    resumed.load_state_dict(saved)
    resumed.run()
    a, b = state(full), state(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert full.store.clients("ditto") == resumed.store.clients("ditto")
    for c in full.store.clients("ditto"):
        va, vb = full.store.get("ditto", c), resumed.store.get("ditto", c)
        assert all(torch.equal(va[k], vb[k]) for k in va)


def test_ditto_run_resumed_from_disk_checkpoint_is_bit_identical(tmp_path):
    cfg = validate(tiny(**{"server.rounds": 3, "eval.every": 1, "recipe.components": [{"name": "ditto", "mu": 0.1}]}))
    execute(cfg, tmp_path / "full")
    execute(cfg, tmp_path / "cut", stop_after=2)
    execute(cfg, tmp_path / "cut", resume=True)
    a = RunDir(tmp_path / "full").load_latest_checkpoint()[1]["model"]
    b = RunDir(tmp_path / "cut").load_latest_checkpoint()[1]["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]  # noqa: E731
    ra, rb = strip(RunDir(tmp_path / "full").read_metrics()), strip(RunDir(tmp_path / "cut").read_metrics())
    assert ra == rb and "local/wma" in ra[-1]
    fa = sorted(p.name for p in (tmp_path / "full" / "client_state" / "ditto").glob("*.safetensors"))
    fb = sorted(p.name for p in (tmp_path / "cut" / "client_state" / "ditto").glob("*.safetensors"))
    assert fa == fb and fa
    for name in fa:
        ta = load_file(str(tmp_path / "full" / "client_state" / "ditto" / name))
        tb = load_file(str(tmp_path / "cut" / "client_state" / "ditto" / name))
        assert all(torch.equal(ta[k], tb[k]) for k in ta)


# -- Ditto, a stage that shares nothing (FP + Ditto) --------------------------------------------------


def staged(ft_components, fed_components=(), ft_steps=3, lr=0.3):
    task = PTask()
    fed = make_recipe(fed_components)
    ft = make_recipe(ft_components, "local")
    stages = [
        Stage("fed", 1, fed, LocalTraining(batch_size=1000, lr=lr, epochs=None, steps=1)),
        Stage("ft", 2, ft, LocalTraining(batch_size=1000, lr=lr, epochs=None, steps=ft_steps)),
    ]
    schedule = Schedule(rounds=2, clients_per_round=3, eval_local=True, eval_initial=False)
    return Simulation(task, fed, stages[0].local, schedule, 0, stages=stages)


def test_ditto_in_a_local_stage_is_proximal_fine_tuning():
    plain = staged([])
    plain.run()
    zero = staged([comp("ditto", mu=0.0)])
    zero.run()
    for c in range(3):
        pa, pb = plain.store.get("personal", c), zero.store.get("personal", c)
        assert all(torch.equal(pa[k], pb[k]) for k in pa)
    mu, lr = 2.0, 0.3
    prox = staged([comp("ditto", mu=mu)])
    rows = []
    prox.run(on_round=lambda r, row, ev: rows.append(row))
    w = state(prox)  # the global model the federated stage produced (unchanged by fine-tuning)
    assert all(torch.equal(w[k], state(plain)[k]) for k in w)
    assert prox.store.clients("ditto") == []
    for c in range(3):
        x, y = prox.task.xs[c], prox.task.ys[c]
        v = gd(w, BACK + HEAD, x, y, lr, 3, prox=(mu, w))
        got = prox.store.get("personal", c)
        assert all(close(got[k], v[k]) for k in v), c
        dist = lambda p: sum(float((p[k] - w[k]).pow(2).sum()) for k in BACK + HEAD)  # noqa: E731
        assert dist(got) < dist(plain.store.get("personal", c))
    acc, loss = pooled(prox.task, lambda c: prox.store.get("personal", c))
    assert rows[-1]["local/wma"] == pytest.approx(acc)
    assert rows[-1]["local/loss"] == pytest.approx(loss, rel=1e-5)


def test_ditto_local_stage_evaluation_ignores_federated_personal_models():
    sim = staged([comp("ditto", mu=0.5)], fed_components=[comp("ditto", mu=0.5, personal_epochs=4)])
    sim.run()
    assert sim.store.clients("ditto") == [0, 1, 2]  # from the federated stage
    model = sim.load_client_model(0)
    personal = sim.store.get("personal", 0)
    assert all(torch.equal(model.state_dict()[k], personal[k]) for k in personal)
    with sim.eval_context(model, 0):  # the local stage's own model, not the stale v_k
        assert all(torch.equal(model.state_dict()[k], personal[k]) for k in personal)


# -- configuration ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "components, share, cls, attrs",
    [
        ([{"name": "fedalt", "personal_epochs": 2}], {"name": "personal", "part": "head"}, FedAltTrainer, {"personal_epochs": 2}),
        ([{"name": "pfedme", "lam": 5.0, "inner_steps": 2}], "global", PFedMeTrainer,
         {"lam": 5.0, "inner_steps": 2, "personal_lr": 0.01}),
        (["ditto"], "global", DittoTrainer, {"mu": 0.1, "personal_epochs": 1}),
        ([{"name": "ditto", "mu": 0.5}], "local", DittoTrainer, {"mu": 0.5}),
    ],
)
def test_components_build_from_config_and_run(components, share, cls, attrs):
    raw = tiny(**{"server.rounds": 1, "eval.every": 1, "recipe.components": components, "recipe.sharing": share})
    sim = build_simulation(validate(raw))
    assert isinstance(sim.recipe.trainer, cls)
    assert {k: getattr(sim.recipe.trainer, k) for k in attrs} == attrs
    before = state(sim)
    rows = []
    sim.run(on_round=lambda r, row, ev: rows.append(row))
    assert rows[0]["clients/aggregated"] == 3 and "local/wma" in rows[0]
    changed = any(not torch.equal(before[k], v) for k, v in state(sim).items())
    assert changed == (share != "local")


def test_config_errors():
    with pytest.raises(ValueError, match="recipe.sharing"):
        build_simulation(validate(tiny(**{"server.rounds": 1, "recipe.components": ["fedalt"]}))).run()
    with pytest.raises(ConfigError):
        validate(tiny(**{"recipe.components": [{"name": "ditto", "mu": -1.0}]}))
    with pytest.raises(ConfigError):
        validate(tiny(**{"recipe.components": [{"name": "pfedme", "beta": 1.0}]}))
    with pytest.raises(ConfigError, match="local procedure"):
        build_simulation(validate(tiny(**{"recipe.components": ["ditto", "pfedme"]})))
