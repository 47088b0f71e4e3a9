"""DP-SGD trained by the vectorised engine (issue 48, item 4; ``fedsight.training.private_step``).

Trained together, the clients of a DP-SGD stage compute what sequential DP-SGD (Opacus's per-sample hooks) computes:
the same Poisson batches (empty ones included), the same noise (each client's own stream, drawn in the same order:
equal on the simulated streams, so the two runs are compared with the noise on), the same normalisation and the
same epsilon. The clipped sum is checked against Opacus's ``GradSampleModule`` on a small CNN, the noise's
distribution and its independence across clients under secret noise, and what the vectorised step refuses."""

from __future__ import annotations

import pytest
import torch
from scipy import stats
from torch import nn

from fedsight import registry as R
from fedsight.api import build_simulation
from fedsight.config import ConfigError, validate
from fedsight.secret import secret_torch_gen
from fedsight.state import ClientStateStore
from fedsight.training import ClientContext
from fedsight.training.context import ClientState
from fedsight.training.local import SGD_TRAINER, LocalTraining
from fedsight.training.private_step import private_step
from fedsight.training.vector_batches import NormState
from fedsight.training.vectorized import blockers
from helpers import close, tiny

DP = {"name": "dp_sgd", "noise_multiplier": 0.5, "max_grad_norm": 0.5}
# unequal clients (Dirichlet sizes), 1 to 3 local steps per client and round, three clients a round, no evaluation
UNEQUAL = {"partition.alpha": 0.3, "train.batch_size": 8, "train.epochs": None, "train.steps_range": [1, 3],
           "server.rounds": 2, "server.clients_per_round": 3, "eval.every": 3, "engine.threads": 1}

CASES = {
    # Poisson batches of expected size 1: many steps of some client are empty (noise-only steps; the padding's dropout
    # masks are drawn and the client's stream put back, as sequential training draws none)
    "poisson_empty": {"train.batch_size": 1, "model.dropout": 0.5, "recipe.components": [DP]},
    # shuffled fixed-size batches (E[B] = the batch's size), FedProx's data-independent term (no noise on it), momentum
    "shuffle_fedprox": {"train.momentum": 0.9, "recipe.components": [{**DP, "sampling": "shuffle"},
                                                                     {"name": "fedprox", "mu": 0.5}]},
    # each example's dropout masks: its rows of the batch's masks, from the client's stream; Adam after the DP hook;
    # two convolutions, the second's input channels-last where Opacus's per-sample gradients went wrong
    # (``dp_sgd._standard_layout``)
    "two_convs_dropout_adam": {"model.channels": [8, 16], "model.dropout": 0.5, "train.optimizer": "adam",
                               "train.lr": 0.01, "recipe.components": [DP]},
}


def _run(vectorize, **over):
    sim = build_simulation(validate(tiny(**{**UNEQUAL, "engine.vectorize": vectorize, **over})))
    start = {k: v.clone() for k, v in sim.global_model.state_dict().items()}
    rows, events = zip(*(sim.run_round(r) for r in (1, 2)))
    assert any(not torch.equal(start[k], v) for k, v in sim.global_model.state_dict().items()), "nothing trained"
    spent = sorted((e["round"], e["client"], e["epsilon"]) for round_events in events for e in round_events
                   if e.get("event") == "privacy_spent")
    return sim, rows, spent


@pytest.mark.parametrize("case", sorted(CASES))
def test_vectorised_dp_sgd_equals_sequential(case, monkeypatch):
    """The same global model, losses and epsilon as sequential DP-SGD, the noise on (equal streams)."""
    import fedsight.training.vector_batches as VB
    import fedsight.training.vectorized as V

    calls, sizes = [], []
    monkeypatch.setattr(V, "private_step", lambda *a, _f=V.private_step: calls.append(1) or _f(*a))
    monkeypatch.setattr(VB.StepBatches, "groups", lambda self, s, live, norms, _g=VB.StepBatches.groups: (
        sizes.extend(g[1]) or g for g in _g(self, s, live, norms)))
    seq, seq_rows, seq_spent = _run(False, **CASES[case])
    vec, vec_rows, vec_spent = _run(True, **CASES[case])  # (a stage that cannot is a ConfigError)
    assert calls and vec.runtime.vectorizes(3) and not vec.runtime.sequential_reasons
    if case == "poisson_empty":
        assert 0 in sizes and max(sizes) > 1, sizes  # empty batches, and batches of several examples
    a, b = seq.global_model.state_dict(), vec.global_model.state_dict()
    for k in a:
        close(b[k], a[k], atol=2e-6, rtol=1e-5)
    for ra, rb in zip(seq_rows, vec_rows):
        assert ra["train/loss"] == pytest.approx(rb["train/loss"], rel=1e-5)
        assert ra["privacy/epsilon_max"] == rb["privacy/epsilon_max"] > 0
    assert seq_spent == vec_spent and len(seq_spent) == 6  # every client's epsilon, equal


# -- the clipped sum against Opacus's per-sample gradients ---------------------------------------------------


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.norm(self.conv(x))).flatten(1))


def test_clipped_sum_equals_opacus_per_sample_gradients():
    """``private_step``'s clipped sum and unclipped mean over a padded batch's real examples, for two clients, equal
    Opacus's (``GradSampleModule``, per-sample gradients of the batch-mean loss, clipped with its factor), with C the
    median of the examples' norms: some examples clipped, some not."""
    from opacus import GradSampleModule

    torch.manual_seed(0)
    model = SmallCNN()
    names = [k for k, _ in model.named_parameters()]
    starts = [{k: v.detach().clone() for k, v in model.named_parameters()}]
    starts.append({k: v + 0.1 * torch.randn_like(v) for k, v in starts[0].items()})
    sizes, size = [5, 3], 5
    x, y = torch.randn(2, size, 3, 4, 4), torch.randint(0, 5, (2, size))
    x[1, 3:] = 1e3  # padding: must not count
    refs = []  # Opacus's per-sample gradients, their norms and the batch loss, by client
    for i, n in enumerate(sizes):
        ref = SmallCNN()
        ref.load_state_dict(starts[i])
        gsm = GradSampleModule(ref, batch_first=True, loss_reduction="mean", strict=True)
        loss = nn.functional.cross_entropy(gsm(x[i, :n]), y[i, :n])
        loss.backward()
        samples = [p.grad_sample.detach().clone() for p in ref.parameters()]
        norms = torch.stack([g.reshape(n, -1).double().pow(2).sum(1) for g in samples]).sum(0).sqrt()
        refs.append((samples, norms, [p.grad.detach().clone() for p in ref.parameters()], float(loss)))
        gsm._close()
    clip = float(torch.cat([r[1] for r in refs]).median())

    def objective(params, own, out, y, mask, sums=None):
        return nn.functional.cross_entropy(out, y)

    def update(params, grads, opt, own, lr, bias):  # hands back what the clipping component receives
        return {"sum": own["dp"]["clipped_sum"], "mean": own["dp"]["example_mean"], "grads": grads}, {}

    step = private_step(model, objective, update, NormState(), {}, "dp", clip)
    params = {k: torch.stack([s[k] for s in starts]) for k in names}
    mask = (torch.arange(size) < torch.tensor(sizes)[:, None]).float()
    got, _, _, losses = step(params, {}, {}, {"dp": {}}, x, y, mask, ([], {}), torch.ones(2), torch.ones(2))
    factors = []
    for i, (samples, norms, full, loss) in enumerate(refs):
        factor = (clip / (norms + 1e-6)).clamp(max=1.0)
        factors.append(factor)
        for k, g, whole in zip(names, samples, full):
            close(got["sum"][k][i], torch.einsum("i,i...->...", factor.float(), g), atol=1e-6, rtol=1e-5)
            close(got["mean"][k][i], g.mean(0), atol=1e-6, rtol=1e-5)
            close(got["grads"][k][i], whole, atol=1e-6, rtol=1e-5)
        assert float(losses[i]) == pytest.approx(loss, rel=1e-5)
    factors = torch.cat(factors)
    assert (factors < 1).any() and (factors == 1).any()  # the clipping acts on some examples, not on all


# -- the noise: each client's own secret stream, N(0, (z C)^2) ------------------------------------------------


def test_vectorised_noise_is_each_clients_secret_gaussian(tmp_path):
    """Under secret noise each client's ``step_draw`` is N(0, (z C)^2) (moments, KS test), from that client's own
    secret (regenerated from its key file), independent of the other client's and of the seed's stream."""
    torch.manual_seed(0)
    model = nn.Linear(60, 50)
    z, c = 1.3, 0.7
    comp = R.build(R.COMPONENTS, "dp_sgd", {"noise_multiplier": z, "max_grad_norm": c})
    store = ClientStateStore(tmp_path / "client_state")
    draws = {}
    for client in (1, 2):
        ctx = ClientContext(client_id=client, round=3, model=model, global_params={}, num_examples=40, seed=5,
                            num_steps=2, local=LocalTraining(batch_size=8, lr=0.1, steps=2),
                            state=ClientState(store, client, 3), noise="secret")
        comp.client_start(ctx)
        vs = comp.vector_step(ctx)
        assert not any(hasattr(p, "grad_sample") for p in model.parameters())  # Opacus's hooks are gone
        steps = [vs.step_draw() for _ in range(2)]
        assert ctx.scratch["dp_sgd"]["steps"] == 2  # the accountant's steps
        draws[client] = torch.cat([t.flatten() for s in steps for t in s.values()])
        secret = (tmp_path / "client_state" / "secret" / f"client-{client:07d}.key").read_bytes()
        gen = secret_torch_gen(secret, "dp_sgd", 3, client)
        own = [torch.normal(0.0, z * c, size=p.shape, generator=gen) for _ in range(2) for p in model.parameters()]
        assert torch.equal(draws[client], torch.cat([t.flatten() for t in own]))
        ctx.scratch.pop("dp_sgd")
    for d in draws.values():
        assert d.numel() == 2 * 3050
        assert float(d.mean()) == pytest.approx(0.0, abs=4 * z * c / d.numel() ** 0.5)
        assert float(d.std()) == pytest.approx(z * c, rel=0.05)
        assert stats.kstest(d.double().numpy(), "norm", args=(0.0, z * c)).pvalue > 1e-3
    assert not torch.equal(draws[1], draws[2])
    assert abs(float(torch.corrcoef(torch.stack([draws[1], draws[2]]))[0, 1])) < 0.06  # 6,100 pairs: sd 0.013


# -- what the vectorised DP step refuses ---------------------------------------------------------------------


def test_dp_sgd_blockers_name_what_per_example_clipping_cannot_take_apart():
    dp = R.build(R.COMPONENTS, "dp_sgd", {"noise_multiplier": 1.0})
    dct = R.build(R.COMPONENTS, "dct_dp", {"epsilon": 2.0, "tau": 4})
    local = LocalTraining(batch_size=2, lr=0.1)

    class Task:
        loss_is_example_mean = False

    model = SmallCNN()
    assert blockers(model, [dp], SGD_TRAINER, local, Task()) == [
        "'dp_sgd' needs each example's gradient alone, and the task's loss is not a mean of per-example losses"]
    Task.loss_is_example_mean = True
    assert blockers(model, [dp], SGD_TRAINER, local, Task()) == []
    assert "component 'dct_dp' noises a layer within a step" in blockers(model, [dp, dct], SGD_TRAINER, local)[0]
    bn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    assert blockers(bn, [dp], SGD_TRAINER, local) == ["'dp_sgd': 1 is a BatchNorm, which mixes a batch's examples"]
    sim = build_simulation(validate(tiny(**{**UNEQUAL, "engine.vectorize": True, "recipe.components": [DP]})))
    runtime = sim.runtime
    runtime.vectorize, runtime.stage_index = "auto", -1  # (what ``"auto"`` is on CUDA: ``api.vectorize_mode``)
    runtime.enter_stage(0)
    assert runtime.vectorizes(3) and not runtime.sequential_reasons  # "auto" trains a DP-SGD stage together
    sim.task.loss_is_example_mean = False
    runtime.vectorize = True
    with pytest.raises(ConfigError, match="engine.vectorize = true: .*not a mean of per-example losses"):
        sim.runtime.vector_blockers(sim.runtime.stage)
