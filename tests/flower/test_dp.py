"""Central DP through Flower's DP wrapper (``fedsight.flower.dp``), checked against hand computations:
clipping to L2 norm C over the whole update, the noise's standard deviation z C / m, and the reported
epsilon against references computed here: the R'enyi-DP bound of the Gaussian mechanism from its closed
form, the exact (eps, delta) curve of the composed Gaussian mechanism (Balle & Wang 2018), and
dp-accounting's RDP and PLD accountants fed the releases' DpEvents one by one."""

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


def _dp(global_params, m, z, c, delta=1e-5, seed=0, population=10, **acc):
    set_identity()
    return CentralDP(lambda: global_params, noise_multiplier=z, clipping_norm=c, num_sampled=m, population=population,
                     delta=delta, seed=seed, **acc)


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
    # all-zero updates (Flower's own clipping would divide by their zero norm): a zero clipped mean, the same noise
    zeros = _dp(gp, m, z, c).aggregate([ClientResult(k, 1, {"w": torch.zeros(200, 200)}) for k in range(m)], torch.ones(m))
    torch.testing.assert_close(zeros["w"].double(), noise, atol=1e-6, rtol=0)
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


def test_dp_run_reports_epsilon_each_round_and_its_noise_is_the_servers_secret(tmp_path):
    """Each row's epsilon; the noise comes from the server's own secret (``RUN_DIR/private/central_dp.key``), so two
    runs of one config and seed release different models (issue 43: a seed-derived noise was regenerable by
    anyone holding the config)."""
    cfg = validate(tiny(**DP_RUN))
    for name in ("a", "b"):
        run_direct(cfg, tmp_path / name, tmp_path / f"nodes-{name}", options=DP_OPTS)
    lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in lines if "event" not in r]
    assert [(r["event"], r["accountant"], r["sampling"]) for r in lines if "event" in r] == [("dp_accounting", "rdp", "none")]
    assert [r["dp/releases"] for r in rows] == [1, 2]
    assert [r["dp/epsilon"] for r in rows] == pytest.approx([_rdp_epsilon(1.0, t, 1e-4) for t in (1, 2)], rel=1e-3)
    info = json.loads((tmp_path / "a" / "flower.json").read_text())["dp"]
    assert info["dp/epsilon"] == rows[-1]["dp/epsilon"] and info["clipping_norm"] == 0.5
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert not all(torch.equal(a[k], b[k]) for k in a)  # the same seed, two servers' secrets: two noises
    keys = [(tmp_path / n / "private" / "central_dp.key") for n in ("a", "b")]
    assert all(k.stat().st_mode & 0o777 == 0o600 for k in keys) and keys[0].read_bytes() != keys[1].read_bytes()
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
    with pytest.raises(ConfigError, match="'uniform' and recipe.aggregator = 'mean'.*'median'"):
        run_direct(validate(tiny(**{**DP_RUN, "recipe.aggregator": "median"})), tmp_path / "m", tmp_path / "n4", options=DP_OPTS)
    with pytest.raises(ConfigError, match="trains nothing"):  # a statistics pass releases no model update
        run_direct(validate(tiny(**{**DP_RUN, "recipe.components": ["fedncm"]})), tmp_path / "f", tmp_path / "n5", options=DP_OPTS)
    with pytest.raises(ConfigError, match="shares no trainable parameter"):  # the head personal, the backbone frozen
        run_direct(validate(tiny(**{**DP_RUN, "recipe.sharing": {"name": "personal", "part": "head"},
                                    "train.freeze": ["backbone"]})), tmp_path / "p", tmp_path / "n6", options=DP_OPTS)
    for name in ("w", "bn", "s", "m", "f", "p"):
        assert not (tmp_path / name).exists()  # refused before the run directory is written


# -- the accountant choice: rdp / pld, no amplification / sampling without replacement ---------------


def _released(m: int, z: float, releases: int, **kw) -> CentralDP:
    """A CentralDP after ``releases`` releases of m updates (norm 1e-3 * sqrt(3) < C: nothing clipped)."""
    dp = _dp({"w": torch.zeros(3)}, m, z, 1.0, **kw)
    res = [ClientResult(k, 1, {"w": torch.full((3,), 1e-3)}) for k in range(m)]
    for _ in range(releases):
        dp.aggregate(res, torch.ones(m))
    return dp


def _by_dp_accounting(kind: str, events: list, delta: float = 1e-5) -> float:
    """dp-accounting's own accountant, fed one DpEvent per release (the reference for the reported epsilon)."""
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.privacy_accountant import NeighboringRelation
    from dp_accounting.rdp import RdpAccountant

    replace = type(events[0]).__name__ == "SampledWithoutReplacementDpEvent"
    rel = NeighboringRelation.REPLACE_ONE if replace else NeighboringRelation.ADD_OR_REMOVE_ONE
    acc = RdpAccountant(neighboring_relation=rel) if kind == "rdp" else PLDAccountant(neighboring_relation=rel)
    for e in events:
        acc.compose(e)
    return acc.get_epsilon(delta)


def _gaussian_delta(eps: float, mu: float) -> float:
    """The exact delta(eps) of the Gaussian mechanism with sensitivity / noise = mu (Balle & Wang 2018,
    Thm. 8): Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu). T releases of noise multiplier z compose to
    mu = sqrt(T) / z (Dong, Roth & Su 2019, Cor. 3.3)."""
    from scipy.stats import norm

    return float(norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * norm.cdf(-mu / 2 - eps / mu))


def test_epsilon_equals_dp_accountings_accountants_fed_the_release_events():
    from dp_accounting.dp_event import GaussianDpEvent, SampledWithoutReplacementDpEvent
    from flwr.serverapp import GaussianPrivacyEvent, NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod

    z, m, n, t = 1.1, 3, 10, 3
    rdp = _released(m, z, t)
    assert rdp.privacy_spent()["dp/releases"] == t
    assert rdp.privacy_spent()["dp/epsilon"] == pytest.approx(_by_dp_accounting("rdp", [GaussianDpEvent(z)] * t), rel=1e-9)
    # the same number Flower's RdpAccountant (what FedSight used before the choice existed) reports
    flower = RdpAccountant(PrivacyConfig(1e-5, n, NeighboringRelation.ADD_OR_REMOVE_ONE, SamplingMethod.NO_AMPLIFICATION))
    for _ in range(t):
        flower.compose(GaussianPrivacyEvent(z, m, n))
    assert rdp.privacy_spent()["dp/epsilon"] == pytest.approx(flower.get_privacy_spent().epsilon, rel=1e-9)

    pld = _released(m, z, t, accountant="pld")
    eps = pld.privacy_spent()["dp/epsilon"]
    ref = _by_dp_accounting("pld", [GaussianDpEvent(z)] * t)  # discretised, pessimistic: at or just above the exact
    assert eps <= ref <= eps * (1 + 1e-6)
    assert _gaussian_delta(eps, math.sqrt(t) / z) == pytest.approx(1e-5, rel=1e-6)  # exact: delta(eps) is the target

    # amplification by sampling m of n without replacement: replace-one neighbours, sensitivity 2 C / m; here (3 of
    # 10) that bound is above no amplification's, so the replace-one epsilon is the amplified one and dp/epsilon
    # (add/remove one) is no amplification's
    wor = _released(m, z, t, sampling="without-replacement")
    events = [SampledWithoutReplacementDpEvent(n, m, GaussianDpEvent(z / 2))] * t
    spent = wor.privacy_spent()
    assert spent["dp/epsilon_replace_one"] == pytest.approx(_by_dp_accounting("rdp", events), rel=1e-9)
    assert spent["dp/epsilon"] == pytest.approx(_by_dp_accounting("rdp", [GaussianDpEvent(z)] * t), rel=1e-9)
    assert spent["dp/amplified"] == 0.0
    # the factor 2, independently: sampling everyone is no sampling, and the RDP of a Gaussian with sensitivity
    # 2 C / m and noise z C / m is a (2 / z)^2 / 2 per release (closed form)
    everyone = _released(n, z, t, sampling="without-replacement")
    ref = _rdp_epsilon(z / 2, t, 1e-5)
    assert ref <= everyone.privacy_spent()["dp/epsilon_replace_one"] <= ref * 1.001
    info = wor.describe()
    assert (info["accountant"], info["sampling"], info["neighbouring_relation"]) == ("rdp", "without-replacement",
                                                                                     "add-or-remove-one")
    assert "secret" in info["note"] and "3 of 10" in info["note"]


@pytest.mark.parametrize("m,n,want_amplified", [(3, 3, False), (2, 3, False), (10, 1000, True)])
def test_without_replacement_reports_the_smaller_valid_epsilon_and_says_which(m, n, want_amplified):
    """Issue 43, item 5. dp/epsilon (add/remove one) is the smaller of no amplification and the amplified
    replace-one bound (a replace-one bound also bounds add/remove one); dp/epsilon_replace_one the smaller of the
    amplified bound and no amplification under replace-one; each checked against dp-accounting's own RDP
    accountant. The code before reported the amplified bound alone: 48.8 for 3 of 3 clients (z = 1, 10 releases),
    against 19.1 without amplification."""
    from dp_accounting.dp_event import GaussianDpEvent, SampledWithoutReplacementDpEvent

    z, t = 1.0, 10
    spent = _released(m, z, t, population=n, sampling="without-replacement").privacy_spent()
    amplified = _by_dp_accounting("rdp", [SampledWithoutReplacementDpEvent(n, m, GaussianDpEvent(z / 2))] * t)
    none = _by_dp_accounting("rdp", [GaussianDpEvent(z)] * t)
    from dp_accounting.privacy_accountant import NeighboringRelation
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    acc.compose(GaussianDpEvent(z / 2), t)
    replace_none = acc.get_epsilon(1e-5)
    assert bool(amplified < none) == want_amplified
    assert spent["dp/epsilon"] == pytest.approx(min(none, amplified), rel=1e-9)
    assert spent["dp/amplified"] == float(want_amplified)
    assert spent["dp/epsilon_replace_one"] == pytest.approx(min(replace_none, amplified), rel=1e-9)
    if (m, n) == (3, 3):  # the numbers
        assert round(spent["dp/epsilon"], 1) == 19.1 and round(amplified, 1) == 48.8
    if (m, n) == (2, 3):  # sampling 2 of 3 bounds replace-one worse than no sampling at all
        assert replace_none < amplified and spent["dp/epsilon_replace_one"] == pytest.approx(replace_none, rel=1e-9)


def test_pld_is_tighter_than_rdp_and_sampling_amplifies():
    z, t = 1.0, 10
    rdp, pld = (_released(2, z, t, population=200, accountant=a).privacy_spent()["dp/epsilon"] for a in ("rdp", "pld"))
    assert 1.03 * pld < rdp < 1.10 * pld  # RDP's conversion costs a few percent over the exact value
    wor = [_released(m, z, t, population=200, sampling="without-replacement").privacy_spent()["dp/epsilon"] for m in (2, 20)]
    assert wor[0] < wor[1] < rdp and wor[0] < rdp / 2  # q = 1 %: under half (with replace-one's doubled sensitivity)


@pytest.mark.parametrize("args,msg", [
    (["--dp-noise", "1", "--dp-sampling", "poisson"], "--dp-sampling = 'poisson' is not how FedSight samples"),
    (["--dp-noise", "1", "--dp-sampling", "fixed"], "--dp-sampling = 'fixed' must be 'none' or 'without-replacement'"),
    (["--dp-noise", "1", "--dp-accountant", "prv"], "--dp-accountant = 'prv' must be 'rdp' or 'pld'"),
    (["--dp-noise", "1", "--dp-accountant", "pld", "--dp-sampling", "without-replacement"],
     "--dp-accountant = 'pld' has no bound for --dp-sampling = 'without-replacement'"),
    (["--dp-accountant", "pld"], "--dp-accountant and --dp-sampling account central DP: set --dp-noise > 0"),
])
def test_invalid_accounting_is_refused_in_one_line_naming_the_flag(tmp_path, args, msg):
    import tomli_w
    from typer.testing import CliRunner

    from fedsight.cli import app

    cfg = tmp_path / "c.toml"
    cfg.write_text(tomli_w.dumps(tiny(**DP_RUN)))
    res = CliRunner().invoke(app, ["flower", "app", str(cfg), str(tmp_path / "app"), "--run-dir", str(tmp_path / "r"), *args])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and msg in " ".join(res.output.split()), res.output
    assert not (tmp_path / "app").exists()


def test_amplification_is_refused_when_a_component_picks_the_clients(tmp_path):
    from fedsight.api import build_server
    from fedsight.flower.dp import install_central_dp
    from fedsight.training.component import Component

    class Picker(Component):  # a component that chooses the round's clients itself (as Fed3R and LADD do)
        name = "picker"

        def sample(self, round, num_clients, m, seed):
            return [0, 1]

    def server():
        s = build_server(validate(tiny(**{**DP_RUN, "partition.num_clients": 5, "server.clients_per_round": 2})))
        s.stages[0].recipe.components.append(Picker())
        return s

    with pytest.raises(ConfigError, match="dp-sampling = 'without-replacement' assumes uniform sampling, but picker"):
        install_central_dp(server(), noise_multiplier=1.0, clipping_norm=1.0, delta=None, sampling="without-replacement")
    assert install_central_dp(server(), noise_multiplier=1.0, clipping_norm=1.0, delta=None).num_sampled == 2


def test_amplified_sampling_is_drawn_from_the_servers_secret_not_the_seed():
    """Issue 43: amplification by sampling assumes a secret sample, but the server drew it from the run seed that
    every node's run config holds. With ``without-replacement`` it comes from the server's OS-CSPRNG secret: a
    party holding the seed predicts none of it (20 rounds of 2 of 6: the seed's sample matching every round has
    probability 15**-20); without amplification the seed's sample stays (in-process equivalence)."""
    from fedsight.api import build_server
    from fedsight.engine.plan import sample_clients
    from fedsight.flower.dp import install_central_dp

    def rounds(sampling):
        s = build_server(validate(tiny(**{**DP_RUN, "partition.num_clients": 6, "server.clients_per_round": 2})))
        dp = install_central_dp(s, noise_multiplier=1.0, clipping_norm=1.0, delta=None, sampling=sampling)
        return s, dp, [s.begin_round(r).sampled for r in range(1, 21)]

    s, dp, got = rounds("without-replacement")
    seeded = [sample_clients(s.seed, r, 6, 2) for r in range(1, 21)]
    assert s.sample_secret == dp.secret and got == [sample_clients(s.seed, r, 6, 2, dp.secret) for r in range(1, 21)]
    assert got != seeded and all(len(set(c)) == 2 for c in got)
    s, _, plain = rounds("none")
    assert s.sample_secret is None and plain == seeded


@pytest.mark.parametrize("accountant,sampling", [("pld", "none"), ("rdp", "without-replacement")])
def test_cli_accounting_options_reach_the_run(tmp_path, accountant, sampling):
    """`fedsight flower app --dp-accountant/--dp-sampling` -> the app's run config -> the ServerApp: every row's
    epsilon is that accountant's, and the run says which accountant and assumption produced it."""
    import tomllib

    import tomli_w
    from typer.testing import CliRunner

    from fedsight.cli import app

    raw = tiny(**{**DP_RUN, "partition.num_clients": 4, "server.clients_per_round": 2})
    (tmp_path / "c.toml").write_text(tomli_w.dumps(raw))
    res = CliRunner().invoke(app, ["flower", "app", str(tmp_path / "c.toml"), str(tmp_path / "app"), "--run-dir",
                                   str(tmp_path / "run"), "--dp-noise", "1.0", "--dp-clip", "0.5", "--dp-delta", "1e-4",
                                   "--dp-accountant", accountant, "--dp-sampling", sampling])
    assert res.exit_code == 0, res.output
    rc = tomllib.loads((tmp_path / "app" / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert (rc["dp-accountant"], rc["dp-sampling"]) == (accountant, sampling)
    run_direct(validate(raw), tmp_path / "run", tmp_path / "nodes",
               options={k: v for k, v in rc.items() if k not in ("fedsight", "run-dir")})
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    [event] = [r for r in rows if r.get("event") == "dp_accounting"]
    assert (event["accountant"], event["sampling"], event["round"]) == (accountant, sampling, 0)
    assert event["neighbouring_relation"] == "add-or-remove-one"
    eps = [r["dp/epsilon"] for r in rows if "dp/epsilon" in r]
    from dp_accounting.dp_event import GaussianDpEvent, SampledWithoutReplacementDpEvent

    # (2 of 4 clients: the amplified bound, 9.0 and 14.3, is above no amplification's, which is reported)
    refs = [_by_dp_accounting(accountant, [GaussianDpEvent(1.0)] * t, delta=1e-4) for t in (1, 2)]
    assert eps == pytest.approx(refs, rel=1e-5)
    if sampling == "without-replacement":
        amplified = [_by_dp_accounting(accountant, [SampledWithoutReplacementDpEvent(4, 2, GaussianDpEvent(0.5))] * t,
                                       delta=1e-4) for t in (1, 2)]
        assert [r["dp/epsilon_replace_one"] for r in rows if "dp/epsilon" in r] == pytest.approx(amplified, rel=1e-5)
        assert [r["dp/amplified"] for r in rows if "dp/epsilon" in r] == [0.0, 0.0]
    info = json.loads((tmp_path / "run" / "flower.json").read_text())["dp"]
    assert (info["accountant"], info["sampling"], info["dp/epsilon"]) == (accountant, sampling, eps[-1])
    assert f"epsilon by {accountant.upper()}" in (tmp_path / "run" / "summary.md").read_text()


# -- the config's [privacy.central_dp] on the Flower path (fedsight.central_dp) --------------------------------------


def _with_section(raw: dict, **section) -> dict:
    raw["privacy"] = {"central_dp": {"noise_multiplier": 1.0, "clipping_norm": 0.5, "delta": 1e-4, **section}}
    return raw


@pytest.mark.parametrize("sampling", ["none", "without-replacement"])
def test_the_config_section_runs_central_dp_on_flower_with_the_in_process_epsilon(tmp_path, sampling):
    """A config with ``[privacy.central_dp]`` and no dp-* option: the ServerApp runs central DP from the section, and
    every round's privacy metrics equal the in-process run's of the same config (one mechanism, one accountant)."""
    from fedsight.api import build_simulation

    cfg = validate(_with_section(tiny(**{**DP_RUN, "partition.num_clients": 4, "server.clients_per_round": 2}),
                                 sampling=sampling))
    run_direct(cfg, tmp_path / "run", tmp_path / "nodes")
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    flower = [{k: v for k, v in r.items() if k.startswith("dp/")} for r in lines if "event" not in r]
    sim, rows = build_simulation(cfg), []
    sim.run(on_round=lambda r, row, events: rows.append({k: v for k, v in row.items() if k.startswith("dp/")}))
    assert flower == rows and [r["dp/releases"] for r in rows] == [1, 2] and rows[-1]["dp/delta"] == 1e-4
    assert (tmp_path / "run" / "private" / "central_dp.key").stat().st_mode & 0o777 == 0o600
    opts = json.loads((tmp_path / "run" / "flower.json").read_text())["options"]
    assert (opts["dp_noise_multiplier"], opts["dp_clipping_norm"], opts["dp_sampling"]) == (1.0, 0.5, sampling)


def test_dp_options_that_disagree_with_the_config_section_are_refused_in_one_line(tmp_path):
    """The dp-* options and the section, both switching central DP on: equal is fine, different is one line naming
    both (run config and CLI flag), before anything starts."""
    import tomli_w
    from typer.testing import CliRunner

    from fedsight.cli import app
    from fedsight.flower.options import preflight

    raw = _with_section(tiny(**DP_RUN))
    cfg = validate(raw)
    same = {"dp-noise-multiplier": 1.0, "dp-clipping-norm": 0.5, "dp-delta": 1e-4}
    assert preflight(cfg, same, tmp_path / "a").dp_noise_multiplier == 1.0
    assert preflight(cfg, {}, tmp_path / "b").dp_clipping_norm == 0.5  # no options: the section's
    with pytest.raises(ConfigError, match=r"run config dp-clipping-norm = 1\.0 differs from the config's "
                                          r"privacy\.central_dp\.clipping_norm = 0\.5"):
        preflight(cfg, {**same, "dp-clipping-norm": 1.0}, tmp_path / "c")
    (tmp_path / "c.toml").write_text(tomli_w.dumps(raw))
    res = CliRunner().invoke(app, ["flower", "app", str(tmp_path / "c.toml"), str(tmp_path / "app"), "--run-dir",
                                   str(tmp_path / "r"), "--dp-noise", "2.0"])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert "--dp-noise = 2.0 differs from the config's privacy.central_dp.noise_multiplier = 1.0" in " ".join(
        res.output.split())
    assert not (tmp_path / "app").exists()


def test_the_progress_line_shows_epsilon_once_with_the_config_section():
    from fedsight.api import progress_keys
    from fedsight.flower.cli import _row_text

    cfg = validate(_with_section(tiny(**DP_RUN)))
    line = _row_text({"round": 1, "clients/aggregated": 3, "clients/sampled": 3, "train/loss": 1.0, "dp/epsilon": 4.5},
                     progress_keys(cfg))
    assert line.count("eps 4.5000") == 1, line
