"""``train.optimizer`` (sgd / adam / adamw) and the across-round ``train.lr_schedule``s (step / cosine),
checked against torch's own optimisers and schedulers, with SCAFFOLD, through a resumed run, and the
configuration errors."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from fedsight.api import build_recipe, execute
from fedsight.config import ConfigError, validate
from fedsight.recipe.scaffold import Scaffold
from fedsight.rng import torch_gen
from fedsight.runs import RunDir
from fedsight.training import Component
from fedsight.training.local import LocalTraining, batch_positions, train_client
from helpers import ToyTask, tiny

BETAS, EPS = (0.8, 0.95), 1e-6


def _client_run(task, model, local, client=1, round=1, seed=0, components=(), broadcast=None):
    """One client's local training from ``model``'s weights (on a copy); returns (trained model, result)."""
    work = copy.deepcopy(model)
    g = {k: v.detach().clone() for k, v in work.named_parameters()}
    res = train_client(task, work, client, round, seed, local, list(components), g, [], broadcast=broadcast)
    return work, res


def _batches(task, local, client=1, round=1, seed=0):
    """The index batches the loop draws (stream ("shuffle", round, client)), for a reference to replay."""
    n = task.num_train_examples(client)
    gen = torch_gen(seed, "shuffle", round, client)
    return list(batch_positions(n, local.batch_size, local.num_steps(n, seed, round, client), gen))


# -- optimizers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_local_adam_and_adamw_equal_torch_optimizers_with_weight_decay(name):
    torch.manual_seed(0)
    task = ToyTask(sizes=(4, 7, 5))
    model = task.build_model()
    lr, wd = 0.05, 0.3
    local = LocalTraining(batch_size=3, lr=lr, epochs=None, steps=6, weight_decay=wd, optimizer=name, betas=BETAS, eps=EPS)
    trained, res = _client_run(task, model, local)

    ref = copy.deepcopy(model)
    cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    opt = cls(ref.parameters(), lr=lr, betas=BETAS, eps=EPS, weight_decay=wd)
    for pos in _batches(task, local):
        x, y = task.train_batch(1, pos)
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    for (k, a), b in zip(trained.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), atol=1e-6, rtol=1e-5, msg=k)
        torch.testing.assert_close(res.delta[k], (b - model.state_dict()[k]).detach(), atol=1e-6, rtol=1e-5)

    # the other decay, and plain SGD, end elsewhere: the comparison can fail
    other = "adamw" if name == "adam" else "adam"
    moved = _client_run(task, model, dataclasses.replace(local, optimizer=other))[0]
    sgd = _client_run(task, model, dataclasses.replace(local, optimizer="sgd"))[0]
    for m in (moved, sgd):
        assert (m.head.weight - trained.head.weight).abs().max() > 1e-3


def test_adam_moments_are_fresh_every_round():
    """Round 2 from round 1's model is torch Adam built anew (no moments carried over)."""
    task = ToyTask()
    model = task.build_model()
    local = LocalTraining(batch_size=100, lr=0.1, epochs=None, steps=2, optimizer="adam", betas=BETAS)
    after1, _ = _client_run(task, model, local, round=1)
    after2, _ = _client_run(task, after1, local, round=2)
    ref = copy.deepcopy(after1)
    opt = torch.optim.Adam(ref.parameters(), lr=0.1, betas=BETAS)
    x, y = task.xs[1], task.ys[1]
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    torch.testing.assert_close(after2.head.weight.detach(), ref.head.weight.detach(), atol=1e-6, rtol=1e-5)


# -- schedules -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["step", "cosine"])
def test_round_lr_equals_torch_schedulers(schedule):
    R, lr = 12, 0.2
    local = LocalTraining(batch_size=8, lr=lr, lr_schedule=schedule, lr_gamma=0.5, lr_step_rounds=3, lr_min=0.01,
                          total_rounds=R)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = (torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if schedule == "step"
             else torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=R, eta_min=0.01))
    seen = []
    for r in range(1, R + 1):
        expected = opt.param_groups[0]["lr"]
        assert local.lr_at_round(r) == pytest.approx(expected, rel=1e-12, abs=1e-15), r
        assert local.at_round(r).lr == local.lr_at_round(r)
        assert local.at_round(r).at_round(r + 1).lr == local.lr_at_round(r)  # what a client sees is spent
        seen.append(expected)
        opt.step()
        sched.step()
    assert len(set(seen)) > 2  # the rate did change
    if schedule == "cosine":
        with pytest.raises(ValueError, match="past the schedule"):
            local.lr_at_round(R + 1)


class _Probe(Component):
    name = "probe"

    def __init__(self):
        self.lrs = []

    def client_start(self, ctx):
        self.lrs.append((ctx.round, ctx.local.lr))


def test_the_round_rate_is_what_the_step_and_every_hook_use():
    task = ToyTask()
    model = task.build_model()
    R = 5
    local = LocalTraining(batch_size=100, lr=0.3, epochs=None, steps=1, lr_schedule="cosine", lr_min=0.0, total_rounds=R)
    probe = _Probe()
    x, y = task.xs[0], task.ys[0]
    m = copy.deepcopy(model)
    F.cross_entropy(m(x), y).backward()
    grad = m.head.weight.grad.clone()
    for r in (1, 3, 5):
        _, res = _client_run(task, model, local, client=0, round=r, components=[probe])
        lr_r = 0.3 * (1 + math.cos(math.pi * (r - 1) / R)) / 2
        assert probe.lrs[-1] == (r, pytest.approx(lr_r, rel=1e-12))
        torch.testing.assert_close(res.delta["head.weight"], -lr_r * grad, atol=1e-7, rtol=1e-6)


# -- SCAFFOLD -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_scaffold_control_variate_uses_the_round_lr(optimizer):
    """c_i+ = c_i - c + (x - y_i) / (K lr_r) with lr_r the cosine rate of the round (c_i = 0: a new client);
    with Adam, each step is Adam's step followed by -lr_r (c - c_i) (the correction after the direction)."""
    torch.manual_seed(1)
    task = ToyTask()
    model = task.build_model()
    R, r, K, lr = 4, 3, 3, 0.2
    local = LocalTraining(batch_size=100, lr=lr, epochs=None, steps=K, lr_schedule="cosine", lr_min=0.02,
                          total_rounds=R, optimizer=optimizer)
    lr_r = 0.02 + (lr - 0.02) * (1 + math.cos(math.pi * (r - 1) / R)) / 2
    c = {k: 0.1 * torch.randn_like(v) for k, v in model.named_parameters()}
    trained, res = _client_run(task, model, local, client=2, round=r, components=[Scaffold()],
                               broadcast={"scaffold": c})
    x = dict(model.named_parameters())
    y = dict(trained.named_parameters())
    for k in c:
        closed = -c[k] + (x[k] - y[k]).detach() / (K * lr_r)
        torch.testing.assert_close(res.extras["scaffold"][k], closed, atol=1e-6, rtol=1e-5)
        wrong = -c[k] + (x[k] - y[k]).detach() / (K * lr)
        assert (res.extras["scaffold"][k] - wrong).abs().max() > 1e-4

    ref = copy.deepcopy(model)
    opt = (torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam)(ref.parameters(), lr=lr_r)
    xs, ys = task.xs[2], task.ys[2]
    for _ in range(K):
        opt.zero_grad()
        F.cross_entropy(ref(xs), ys).backward()
        opt.step()
        with torch.no_grad():
            for k, p in ref.named_parameters():
                p.sub_(lr_r * c[k])  # c - c_i with c_i = 0
    for k, p in ref.named_parameters():
        torch.testing.assert_close(y[k].detach(), p.detach(), atol=1e-6, rtol=1e-5, msg=k)


# -- a whole run ----------------------------------------------------------------------------------


def test_adamw_cosine_scaffold_run_completes_and_resumes_bit_identically(tmp_path):
    raw = tiny(**{"train.optimizer": "adamw", "train.weight_decay": 1e-3, "train.lr": 0.01, "train.betas": [0.9, 0.99],
                  "train.lr_schedule": "cosine", "train.lr_min": 0.001, "recipe.components": ["scaffold"],
                  "recipe.weighting": "uniform", "server.rounds": 4, "eval.every": 1})
    cfg = validate(raw)
    assert execute(cfg, tmp_path / "full").status == "complete"
    assert execute(cfg, tmp_path / "cut", stop_after=2).status == "stopped"
    assert execute(cfg, tmp_path / "cut", resume=True).status == "complete"

    def final(d):
        run = RunDir(d)
        rnd, state = run.load_latest_checkpoint()
        rows = [{k: v for k, v in row.items() if not k.startswith("time/")} for row in run.read_metrics()]
        return rnd, state, rows

    ra, sa, rows_a = final(tmp_path / "full")
    rb, sb, rows_b = final(tmp_path / "cut")
    assert ra == rb == 4
    for k in sa["model"]:
        assert torch.equal(sa["model"][k], sb["model"][k]), k
    assert rows_a == rows_b and all(math.isfinite(row["train/loss"]) for row in rows_a)


def test_cosine_over_stages_follows_the_whole_runs_rounds(tmp_path):
    """A stage's config holds only its own rounds; the schedule runs over the whole run's (R = server.rounds)."""
    from fedsight.api import build_server

    raw = tiny(**{"train.lr_schedule": "cosine", "train.lr": 0.1, "server.rounds": 4, "eval.every": 2})
    raw["stages"] = [{"name": "a", "rounds": 2}, {"name": "b", "rounds": 2, "train": {"lr": 0.05}}]
    cfg = validate(raw)
    stages = build_server(cfg).stages
    ref = [0.1 * (1 + math.cos(math.pi * (r - 1) / 4)) / 2 for r in (1, 2)]
    ref += [0.05 * (1 + math.cos(math.pi * (r - 1) / 4)) / 2 for r in (3, 4)]
    got = [stages[0 if r <= 2 else 1].local.lr_at_round(r) for r in (1, 2, 3, 4)]
    assert got == pytest.approx(ref, rel=1e-12)
    assert execute(cfg, tmp_path / "run").status == "complete"


# -- configuration errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(("over", "key"), [
    ({"train.optimizer": "adam", "train.momentum": 0.9}, "train.momentum"),
    ({"train.optimizer": "adamw", "recipe.components": ["local_adam"]}, "train.optimizer"),
    ({"train.lr_schedule": "step"}, "train.lr_step_rounds"),
    ({"train.lr_schedule": "cosine", "train.lr_min": 0.5}, "train.lr_min"),
    ({"train.optimizer": "adam", "train.betas": [0.9, 1.0]}, "train.betas"),
    ({"train.optimizer": "rmsprop"}, "train.optimizer"),
    ({"train.optimizer": "adam", "recipe.components": [{"name": "pfedme"}]}, "train.optimizer"),
])
def test_config_errors_name_the_key(over, key):
    with pytest.raises(ConfigError) as err:
        validate(tiny(**over))
    msg = str(err.value)
    assert key in msg and "\n" not in msg, msg


def test_valid_options_resolve():
    cfg = validate(tiny(**{"train.optimizer": "adamw", "train.lr_schedule": "step", "train.lr_step_rounds": 2}))
    t = cfg.train
    assert (t.optimizer, t.betas, t.eps, t.lr_gamma, t.lr_min) == ("adamw", (0.9, 0.999), 1e-8, 0.1, 0.0)
    assert validate(tiny()).train.optimizer == "sgd"


def test_a_gradient_hook_after_scaffold_is_refused_with_adam():
    bad = validate(tiny(**{"train.optimizer": "adam", "recipe.components": ["scaffold", "feddyn"]}))
    with pytest.raises(ConfigError, match="list feddyn before scaffold"):
        build_recipe(bad)
    build_recipe(validate(tiny(**{"train.optimizer": "adam", "recipe.components": ["feddyn", "scaffold"]})))
    build_recipe(validate(tiny(**{"recipe.components": ["scaffold", "feddyn"]})))  # SGD: the listed order stands
