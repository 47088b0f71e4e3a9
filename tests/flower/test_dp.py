"""Central DP through Flower's DP wrapper (``fedsight.flower.dp``), checked against hand computations:
clipping to L2 norm C over the whole update, the noise's standard deviation z C / m, and the reported
epsilon against the R'enyi-DP bound of the Gaussian mechanism computed here from its closed form."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedsight.config import ConfigError, validate
from fedsight.flower.dp import CentralDP
from fedsight.records import ClientResult

from flower_direct import run_direct, set_identity
from helpers import tiny

pytestmark = pytest.mark.flower


def _dp(global_params, m, z, c, delta=1e-5, seed=0):
    set_identity()
    return CentralDP(lambda: global_params, noise_multiplier=z, clipping_norm=c, num_sampled=m, population=10, delta=delta, seed=seed)


def test_clipped_mean_is_the_hand_computed_one():
    g = torch.Generator().manual_seed(1)
    gp = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    deltas = [{"w": torch.randn(4, 3, generator=g) * s, "b": torch.randn(3, generator=g) * s} for s in (0.01, 3.0, 10.0)]
    c = 1.0
    dp = _dp(gp, 3, 1e-9, c)  # (practically) no noise: the release is the clipped mean
    out = dp.aggregate([ClientResult(k, 5, d) for k, d in enumerate(deltas)], torch.ones(3))
    expect = {}
    for k in gp:
        acc = torch.zeros_like(gp[k], dtype=torch.float64)
        for d in deltas:
            norm = math.sqrt(sum(float((v.double() ** 2).sum()) for v in d.values()))  # joint norm over all tensors
            acc += d[k].double() * min(1.0, c / norm)
        expect[k] = acc / 3
    for k in gp:
        torch.testing.assert_close(out[k].double(), expect[k], atol=2e-6, rtol=0)
    assert deltas[0]["w"].norm() < c  # the small update passed unclipped (its share of the mean is exact)


def test_noise_std_is_z_c_over_m_and_seeded():
    gp = {"w": torch.zeros(200, 200)}
    z, c, m = 1.5, 0.6, 3
    dp = _dp(gp, m, z, c)
    res = [ClientResult(k, 1, {"w": torch.full((200, 200), 1e-3)}) for k in range(m)]  # norm 0.2 < C: not clipped
    noise = dp.aggregate(res, torch.ones(m))["w"].double() - 1e-3
    assert abs(float(noise.mean())) < 0.01
    assert float(noise.std()) == pytest.approx(z * c / m, rel=0.02)
    again = _dp(gp, m, z, c).aggregate(res, torch.ones(m))["w"]
    assert torch.equal(again.double() - 1e-3, noise)  # the same seed and release number: the same noise
    other = _dp(gp, m, z, c, seed=1).aggregate(res, torch.ones(m))["w"]
    assert not torch.equal(other.double() - 1e-3, noise)
    with pytest.raises(ValueError, match="zero model update"):  # Flower's clipping would divide by zero
        _dp(gp, m, z, c).aggregate([ClientResult(k, 1, {"w": torch.zeros(200, 200)}) for k in range(m)], torch.ones(m))
    state = np.random.get_state()[1].copy()
    _dp(gp, m, z, c).aggregate(res, torch.ones(m))
    assert np.array_equal(np.random.get_state()[1], state)  # NumPy's global generator is left as it was


def _rdp_epsilon(z: float, releases: int, delta: float) -> float:
    """(epsilon, delta)-DP of ``releases`` Gaussian mechanisms with noise multiplier z: RDP of order a is
    a / (2 z^2) per release (Mironov 2017, Prop. 7), composed additively, converted with Balle et al.
    2020, Thm. 21: eps = rdp + log((a-1)/a) - (log delta + log a)/(a-1), minimised over a."""
    a = np.linspace(1.01, 300.0, 300_000)
    return float(np.min(releases * a / (2 * z * z) + np.log1p(-1 / a) - (math.log(delta) + np.log(a)) / (a - 1)))


def test_reported_epsilon_matches_the_rdp_bound():
    gp = {"w": torch.zeros(3)}
    dp = _dp(gp, 2, 1.0, 1.0, delta=1e-5)
    res = [ClientResult(k, 1, {"w": torch.ones(3)}) for k in range(2)]
    assert dp.privacy_spent()["dp/epsilon"] == 0.0
    for t in (1, 2, 3):
        dp.aggregate(res, torch.ones(2))
        spent = dp.privacy_spent()
        ref = _rdp_epsilon(1.0, t, 1e-5)
        assert spent["dp/releases"] == t and spent["dp/delta"] == 1e-5
        assert ref <= spent["dp/epsilon"] <= ref * 1.001  # Flower evaluates a finite grid of orders
    with pytest.raises(ValueError, match="exactly 2"):
        dp.aggregate(res[:1], torch.ones(1))


DP_RUN = {"partition.num_clients": 3, "server.clients_per_round": 3, "server.rounds": 2, "eval.local": False,
          "recipe.weighting": "uniform", "engine.threads": 1}
DP_OPTS = {"dp-noise-multiplier": 1.0, "dp-clipping-norm": 0.5, "dp-delta": 1e-4}


def test_dp_run_reports_epsilon_each_round_and_is_reproducible(tmp_path):
    cfg = validate(tiny(**DP_RUN))
    for name in ("a", "b"):
        run_direct(cfg, tmp_path / name, tmp_path / f"nodes-{name}", options=DP_OPTS)
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["dp/releases"] for r in rows] == [1, 2]
    assert [r["dp/epsilon"] for r in rows] == pytest.approx([_rdp_epsilon(1.0, t, 1e-4) for t in (1, 2)], rel=1e-3)
    info = json.loads((tmp_path / "a" / "flower.json").read_text())["dp"]
    assert info["dp/epsilon"] == rows[-1]["dp/epsilon"] and info["clipping_norm"] == 0.5
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    run_direct(cfg, tmp_path / "plain", tmp_path / "nodes-plain")
    p = load_file(str(tmp_path / "plain" / "model.safetensors"))
    assert not all(torch.equal(a[k], p[k]) for k in a)


def test_dp_refuses_recipes_it_does_not_cover(tmp_path):
    with pytest.raises(ConfigError, match="uniform"):
        run_direct(validate(tiny(**{**DP_RUN, "recipe.weighting": "data_size"})), tmp_path / "w", tmp_path / "n1", options=DP_OPTS)
    with pytest.raises(ConfigError, match="buffers"):
        run_direct(validate(tiny(**{**DP_RUN, "model.norm": "batch"})), tmp_path / "bn", tmp_path / "n2", options=DP_OPTS)
    with pytest.raises(ValueError, match="scaffold"):  # SCAFFOLD's control variates would leave un-noised
        run_direct(validate(tiny(**{**DP_RUN, "recipe.components": ["scaffold"]})), tmp_path / "s", tmp_path / "n3", options=DP_OPTS)
