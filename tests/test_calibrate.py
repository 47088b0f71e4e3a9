"""The softmax temperature by minimum training cross-entropy (thesis Figs. 3.3 / 4.4; ``fedsight calibrate``)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from fedsight.calibrate import calibrate, federated_ce
from fedsight.functional.temperature import ce_sums, check_grid, golden_section, mean_ce, select
from helpers import ToyTask

runner = CliRunner()


def _two_class(m: float, p: float, n: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (m/2, -m/2): class 0 ahead by a margin m on every example, a share p of them labelled 0. Then
    CE(beta) = p softplus(-m beta) + (1 - p) softplus(m beta), whose minimum is sigmoid(m beta) = p:
    tau* = m / logit(p)."""
    k = round(p * n)
    logits = torch.tensor([[m / 2, -m / 2]]).repeat(n, 1)
    y = torch.cat([torch.zeros(k), torch.ones(n - k)]).long()
    return logits, y


def test_ce_sums_are_eq_3_1_with_eq_3_2_and_the_clients_sum_is_the_pooled_mean():
    g = torch.Generator().manual_seed(0)
    z, y = torch.randn(30, 5, generator=g) * 3, torch.randint(0, 5, (30,), generator=g)
    taus = [0.1, 0.5, 1.0, 4.0]
    for t, s in zip(taus, ce_sums(z, y, taus)):  # -sum log softmax(z / tau)_y, by hand
        p = torch.exp(z.double() / t) / torch.exp(z.double() / t).sum(1, keepdim=True)
        assert float(s) == pytest.approx(float(-torch.log(p[torch.arange(30), y]).sum()), rel=1e-9)
    parts = [(z[:7], y[:7]), (z[7:20], y[7:20]), (z[20:], y[20:])]  # three clients' messages
    fed = mean_ce([ce_sums(a, b, taus) for a, b in parts], [len(b) for _, b in parts])
    pooled = torch.tensor([float(F.cross_entropy(z.double() / t, y)) for t in taus], dtype=torch.float64)
    assert torch.allclose(fed, pooled, rtol=1e-12)


@pytest.mark.parametrize("m,p", [(4.0, 0.9), (10.0, 0.8), (0.5, 0.97)])
def test_grid_and_golden_section_find_the_closed_form_minimum_as_scipy_does(m, p):
    from scipy.optimize import minimize_scalar

    logits, y = _two_class(m, p)
    exact = m / math.log(p / (1 - p))
    f = lambda t: float(ce_sums(logits, y, [t])[0]) / len(y)  # noqa: E731
    ref = minimize_scalar(lambda s: f(math.exp(s)), bounds=(math.log(1e-3), math.log(1e3)), method="bounded",
                          options={"xatol": 1e-9})
    assert math.exp(ref.x) == pytest.approx(exact, rel=1e-3)  # the reference agrees with the closed form
    grid = [0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0]
    ce = torch.tensor([f(t) for t in grid])
    i = select(grid, ce)
    assert grid[i - 1] < exact < grid[i + 1]  # the grid minimum's neighbours bracket the true minimum
    tau, v, evals = golden_section(f, grid[i - 1], grid[i + 1], 40)
    assert tau == pytest.approx(exact, rel=1e-5) and tau == pytest.approx(math.exp(ref.x), rel=1e-3)
    assert v <= ref.fun + 1e-12 and evals == 42


def test_calibrate_sums_clients_and_refines_within_the_bracket():
    task = ToyTask(sizes=(40, 25, 35), dim=4, classes=3, seed=1)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(4, 3, generator=g)
    for k, x in enumerate(task.xs):  # labels of a linear rule, a fifth of them flipped at random
        y = (x @ w).argmax(1)
        flip = torch.rand(len(y), generator=g) < 0.2
        task.ys[k] = torch.where(flip, torch.randint(0, 3, (len(y),), generator=g), y)
    model = task.build_model()
    with torch.no_grad():
        model.head.weight.copy_(8.0 * w.T)  # the rule, over-confident: its best temperature is above 1
        model.head.bias.zero_()
    grid = [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
    mean, n = federated_ce(model, task, grid)
    xs, ys = torch.cat(task.xs), torch.cat(task.ys)
    with torch.no_grad():
        pooled = [float(F.cross_entropy(model(xs).double() / t, ys)) for t in grid]
    assert n == 100 and mean.tolist() == pytest.approx(pooled, rel=1e-12)
    taus, ce, points, tau, best, at_edge, _ = calibrate(model, task, grid, refine=25)
    i = select(grid, torch.tensor(ce))
    assert not at_edge and grid[i - 1] < tau < grid[i + 1] and best <= min(ce) and len(points) == 27
    with torch.no_grad():
        from scipy.optimize import minimize_scalar

        ref = minimize_scalar(lambda s: float(F.cross_entropy(model(xs).double() / math.exp(s), ys)),
                              bounds=(math.log(grid[i - 1]), math.log(grid[i + 1])), method="bounded")
    assert tau == pytest.approx(math.exp(ref.x), rel=1e-3)
    # a minimum at the end of the grid is reported, not refined
    _, _, points, tau, _, at_edge, _ = calibrate(model, task, [0.25, 0.5], refine=5)
    assert at_edge and points == []


def test_bad_grids_are_one_line():
    for bad, why in (([0.1], "at least 2"), ([0.1, -1.0], "positive"), ([1.0, 0.1], "ascending"),
                     ([0.1, float("inf")], "finite")):
        with pytest.raises(ValueError, match=why):
            check_grid(bad)


def test_cli_calibrate_writes_the_choice_and_refuses_bad_input(tmp_path, monkeypatch):
    from fedsight.api import execute
    from fedsight.cli import app
    from fedsight.config import validate
    from helpers import tiny

    raw = tiny(**{"server.rounds": 1, "server.clients_per_round": 6, "run.checkpoint_keep": 1})
    raw["stages"] = [{"name": "fed3r", "rounds": 1, "recipe": {"components": ["fed3r"]}}]
    run = tmp_path / "run"
    execute(validate(raw), run)
    before = sorted(p.name for p in run.iterdir())
    for args, words in ((["--grid", "0.1,abc"], "--grid '0.1,abc': expected numbers"),
                        (["--grid", "1,0.1"], "--grid: temperatures must be strictly ascending"),
                        (["--refine", "-1"], "--refine -1"), (["--grid", "0.1,1"], "not a run directory")):
        res = runner.invoke(app, ["calibrate", str(run if "not a run" not in words else tmp_path), *args])
        assert res.exit_code == 2 and words in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert sorted(p.name for p in run.iterdir()) == before  # nothing written
    res = runner.invoke(app, ["calibrate", str(run), "--grid", "0.01,0.03,0.1,0.3,1,3", "--refine", "1"])
    assert res.exit_code == 0, res.output
    rec = json.loads((run / "temperature.json").read_text())
    assert (run / "plots" / "temperature.png").stat().st_size > 0
    assert rec["grid"] == [0.01, 0.03, 0.1, 0.3, 1.0, 3.0] and rec["stage"] == "fed3r" and rec["examples"] > 0
    assert rec["ce"] <= min(rec["grid_ce"]) and f"--set train.temperature={rec['tau']:.4g}" in res.output
