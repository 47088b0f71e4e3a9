"""Central DP in the in-process simulator (``[privacy.central_dp]``, ``fedsight.central_dp``; issue 45, item 6).

The mechanism and accountants are the Flower path's (``fedsight.flower.dp``), installed as the in-process run's
aggregator: the noise is checked statistically against N(0, (z C / m)^2) on a real run's release, clipping on an
update of norm 10 C, the rows' epsilon against dp-accounting's own accountants, resume against an uninterrupted
run (bit for bit), and the noise secret against the secret-noise rule (issue 43): kept only in
``RUN_DIR/private/central_dp.key`` (0600), or the seed's stream under ``noise = "simulated"``, which the run says."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from fedsight.api import build_simulation, execute
from fedsight.central_dp import missing_extra
from fedsight.config import validate
from fedsight.errors import ConfigError, RunFileError
from fedsight.records import ClientResult
from fedsight.secret import SECRET_BYTES, SECRET_NOTE, SIMULATED_NOTE

from helpers import tiny

needs_flower = pytest.mark.skipif(bool(missing_extra()), reason="central DP needs the flower extra (flwr, dp-accounting)")

#: 4 clients, 3 a round, equal weights (what the mechanism's sensitivity assumes)
RUN = {"partition.num_clients": 4, "server.clients_per_round": 3, "server.rounds": 3, "eval.every": 3,
       "eval.local": False, "engine.threads": 1, "recipe.weighting": "uniform", "run.checkpoint_keep": 0}
DP = {"noise_multiplier": 1.1, "clipping_norm": 0.5}


def _raw(noise: str = "secret", dp: dict | None = None, **over) -> dict:
    raw = tiny(**{**RUN, **over})
    raw["privacy"] = {"noise": noise, "central_dp": {**DP, **(dp or {})}}
    return raw


def _cfg(noise: str = "secret", dp: dict | None = None, **over):
    return validate(_raw(noise, dp, **over))


def _rows(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _model(run_dir) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _flat(tensors: dict[str, torch.Tensor], keys: list[str]) -> torch.Tensor:
    return torch.cat([tensors[k].double().reshape(-1) for k in keys])


# -- the mechanism ---------------------------------------------------------------------------------------------


@needs_flower
def test_a_release_is_the_clipped_mean_plus_gaussian_noise_of_std_z_c_over_m():
    """One round of a real run: what the server releases differs from the clients' clipped mean by noise whose sample
    variance over every parameter is (z C / m)^2 (within 20 %: 11,098 coordinates give a standard error of 1.3 %, so
    noise off by 2x in standard deviation, or in variance, fails), with mean 0; the global model moves by exactly the
    release (server SGD, lr 1)."""
    z, c, m = 1.1, 0.55, 3
    sim = build_simulation(_cfg("simulated", {"clipping_norm": c}, **{"server.rounds": 1, "model.hidden": 256}))
    dp = sim.backend.dp
    assert (dp.noise_multiplier, dp.clipping_norm, dp.num_sampled) == (z, c, m)
    seen = []
    release = dp.aggregate

    def recorded(results, weights):
        out = release(results, weights)
        seen.append(([r.delta for r in results], out))
        return out

    dp.aggregate = recorded
    keys = sim.shared_params
    before = _flat(sim.global_model.state_dict(), keys)
    sim.run()
    [(deltas, out)] = seen
    clipped = []
    for d in deltas:
        v = _flat(d, keys)
        clipped.append(v * min(1.0, c / float(v.norm())))
    norms = [float(_flat(d, keys).norm()) for d in deltas]
    assert min(norms) < c < max(norms)  # (updates of norm 0.51 to 0.58: clipped and unclipped ones)
    noise = _flat(out, keys) - torch.stack(clipped).mean(0)
    n, std = noise.numel(), z * c / m
    assert n > 10_000
    assert 0.8 < float(noise.var()) / std**2 < 1.25
    assert abs(float(noise.mean())) < 4 * std / math.sqrt(n)
    torch.testing.assert_close(_flat(sim.global_model.state_dict(), keys), before + _flat(out, keys), rtol=0, atol=1e-6)


@needs_flower
def test_an_update_of_norm_10c_contributes_at_most_c():
    """Clipping over the whole update: an update of norm 10 C enters the mean as C in its own direction, one of norm
    C / 2 as it is (noise multiplier 1e-9: the release is the clipped mean)."""
    c, m = 0.5, 3
    sim = build_simulation(_cfg("simulated", dp={"noise_multiplier": 1e-9}))
    keys = sim.shared_params
    gen = torch.Generator().manual_seed(3)
    params = sim.global_model.state_dict()
    big = {k: torch.randn(params[k].shape, generator=gen) for k in keys}
    scale = 10 * c / float(_flat(big, keys).norm())
    big = {k: v * scale for k, v in big.items()}
    small = {k: torch.randn(params[k].shape, generator=gen) for k in keys}
    scale = 0.5 * c / float(_flat(small, keys).norm())
    small = {k: v * scale for k, v in small.items()}
    zero = {k: torch.zeros_like(params[k]) for k in keys}
    for update in (big, small):
        out = sim.backend.dp.aggregate([ClientResult(0, 10, update), ClientResult(1, 10, zero), ClientResult(2, 10, zero)],
                                       torch.ones(m))
        contribution = _flat(out, keys) * m
        want = _flat(update, keys) * min(1.0, c / float(_flat(update, keys).norm()))
        assert float(contribution.norm()) <= c * (1 + 1e-5)
        torch.testing.assert_close(contribution, want, rtol=0, atol=1e-5)


# -- accounting ------------------------------------------------------------------------------------------------


def _by_dp_accounting(kind: str, event, releases: int, delta: float, replace_one: bool = False) -> float:
    """dp-accounting's own accountant fed ``releases`` copies of ``event`` (the reference)."""
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.privacy_accountant import NeighboringRelation
    from dp_accounting.rdp import RdpAccountant

    rel = NeighboringRelation.REPLACE_ONE if replace_one else NeighboringRelation.ADD_OR_REMOVE_ONE
    acc = RdpAccountant(neighboring_relation=rel) if kind == "rdp" else PLDAccountant(neighboring_relation=rel)
    for _ in range(releases):
        acc.compose(event)
    return acc.get_epsilon(delta)


@needs_flower
@pytest.mark.parametrize("accountant,sampling", [("rdp", "none"), ("pld", "none"), ("rdp", "without-replacement")])
def test_each_rounds_epsilon_is_dp_accountings(accountant, sampling):
    """Every round's row: ``dp/epsilon`` (and with sampling ``dp/amplified``, ``dp/epsilon_replace_one``) equal to
    dp-accounting's RDP / PLD accountant fed the releases so far; 2 of 20 clients at z = 2 make the amplified bound
    the smaller one from round 2 on (so ``dp/amplified`` switches)."""
    from dp_accounting.dp_event import GaussianDpEvent, SampledWithoutReplacementDpEvent

    z, n, m = 2.0, 20, 2
    delta = 1.0 / (10 * n) if 1.0 / (10 * n) < 1e-5 else 1e-5  # the default: min(1e-5, 1 / (10 N))
    cfg = _cfg("simulated", dp={"noise_multiplier": z, "accountant": accountant, "sampling": sampling},
               **{"partition.name": "iid", "partition.num_clients": n, "server.clients_per_round": m})
    sim = build_simulation(cfg)
    rows = []
    sim.run(on_round=lambda r, row, events: rows.append(row))
    assert [r["dp/releases"] for r in rows] == [1, 2, 3] and all(r["dp/delta"] == delta for r in rows)
    for t, row in enumerate(rows, start=1):
        none = _by_dp_accounting(accountant, GaussianDpEvent(z), t, delta)
        if sampling == "none":
            assert "dp/amplified" not in row and "dp/epsilon_replace_one" not in row
            if accountant == "pld":  # ours exact (one Gaussian of noise z / sqrt(T)), dp-accounting's discretised above
                assert row["dp/epsilon"] <= none <= row["dp/epsilon"] * (1 + 1e-4)
            else:
                assert row["dp/epsilon"] == pytest.approx(none, rel=1e-9)
            continue
        amplified = _by_dp_accounting("rdp", SampledWithoutReplacementDpEvent(n, m, GaussianDpEvent(z / 2)), t, delta,
                                      replace_one=True)
        replace_none = _by_dp_accounting("rdp", GaussianDpEvent(z / 2), t, delta, replace_one=True)
        assert row["dp/epsilon"] == pytest.approx(min(none, amplified), rel=1e-9)
        assert row["dp/amplified"] == float(amplified < none)
        assert row["dp/epsilon_replace_one"] == pytest.approx(min(amplified, replace_none), rel=1e-9)
    if sampling == "without-replacement":
        assert [r["dp/amplified"] for r in rows] == [0.0, 1.0, 1.0]


@needs_flower
def test_a_round_short_of_its_m_updates_is_not_released():
    """A client lost to dropout leaves fewer than m updates: the round is not released (``dp_release_skipped``,
    as on Flower), composes nothing and leaves the model as it was."""
    cfg = _cfg("simulated", **{"server.rounds": 4, "server.dropout": 0.3})
    sim = build_simulation(cfg)
    rows, skipped = [], []
    sim.run(on_round=lambda r, row, events: (rows.append(row), skipped.extend(
        e["round"] for e in events if e.get("event") == "dp_release_skipped")))
    assert skipped and len(skipped) < 4  # (the seed's dropouts: some rounds short, some not)
    releases = 0
    for row in rows:
        releases += row["round"] not in skipped
        assert row["dp/releases"] == releases
        assert row["clients/aggregated"] == (0 if row["round"] in skipped else 3)


# -- the secret, resume ------------------------------------------------------------------------------------------


@needs_flower
def test_the_noise_secret_is_the_servers_own_and_kept_only_in_its_private_file(tmp_path):
    cfg = _cfg("secret")
    for name in ("a", "b"):
        execute(cfg, tmp_path / name)
    keys = [tmp_path / n / "private" / "central_dp.key" for n in ("a", "b")]
    for k in keys:
        assert k.stat().st_mode & 0o777 == 0o600 and k.parent.stat().st_mode & 0o777 == 0o700
        assert len(k.read_bytes()) == SECRET_BYTES
    assert keys[0].read_bytes() != keys[1].read_bytes()
    assert not _same(_model(tmp_path / "a"), _model(tmp_path / "b"))  # one seed, two servers' secrets: two noises
    secret = keys[0].read_bytes()
    files = [p for p in (tmp_path / "a").rglob("*") if p.is_file() and p != keys[0]]
    assert {p.name for p in files} >= {"config.json", "run.json", "metrics.jsonl", "summary.md", "status.json"}
    for p in files:  # nowhere else: not in the config, run.json, the logs, the report, a checkpoint
        data = p.read_bytes()
        assert secret not in data and secret.hex().encode() not in data, p
    session = json.loads((tmp_path / "a" / "run.json").read_text())["sessions"][-1]
    assert session["privacy_noise"] == f"{SECRET_NOTE} (central_dp)"
    [event] = [r for r in _rows(tmp_path / "a") if "event" in r]
    assert (event["event"], event["accountant"], event["num_sampled"], event["population"]) == ("dp_accounting", "rdp", 3, 4)


@needs_flower
@pytest.mark.parametrize("noise", ["secret", "simulated"])
def test_resume_releases_the_uninterrupted_runs_noise(tmp_path, noise):
    """3 rounds against 2 + a resumed 1: the same model, bit for bit, and the same rows (timings aside). Under
    "secret" both runs hold one secret (the key placed before the run starts is the one it keeps and reads back)."""
    cfg = _cfg(noise, dp={"sampling": "without-replacement"})
    execute(cfg, tmp_path / "whole")
    if noise == "secret":
        (tmp_path / "split" / "private").mkdir(parents=True)
        (tmp_path / "split" / "private" / "central_dp.key").write_bytes(
            (tmp_path / "whole" / "private" / "central_dp.key").read_bytes())
    assert execute(cfg, tmp_path / "split", stop_after=2).status == "stopped"
    if noise == "secret":  # a temporary of a draw a kill interrupted holds a secret: the resume sweeps it
        (tmp_path / "split" / "private" / ".central_dp.key.1.ab.tmp").write_bytes(bytes(SECRET_BYTES))
    assert execute(cfg, tmp_path / "split").status == "complete"
    private = tmp_path / "split" / "private"
    assert (sorted(p.name for p in private.iterdir()) == ["central_dp.key"]) if noise == "secret" else not private.exists()
    assert _same(_model(tmp_path / "whole"), _model(tmp_path / "split"))

    def numbers(d):
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in _rows(d) if r.get("event") != "run_repaired"]

    assert numbers(tmp_path / "whole") == numbers(tmp_path / "split")
    assert [r["dp/releases"] for r in _rows(tmp_path / "split") if "event" not in r] == [1, 2, 3]


@needs_flower
def test_a_resumed_run_without_its_key_is_refused_naming_the_file(tmp_path):
    cfg = _cfg("secret")
    execute(cfg, tmp_path / "r", stop_after=1)
    key = tmp_path / "r" / "private" / "central_dp.key"
    key.unlink()
    before = (tmp_path / "r" / "metrics.jsonl").read_bytes()
    with pytest.raises(RunFileError, match="central_dp.key: secret missing"):
        execute(cfg, tmp_path / "r")
    assert not key.exists() and (tmp_path / "r" / "metrics.jsonl").read_bytes() == before


@needs_flower
def test_simulated_noise_is_the_seeds_and_the_run_says_so(tmp_path):
    """``noise = "simulated"``: anyone with the config regenerates the noise (two runs, one model), no secret is
    kept, and run.json and summary.md say so; a comparison of the runs shows their epsilon by default."""
    cfg = _cfg("simulated")
    for name in ("a", "b"):
        execute(cfg, tmp_path / name)
    assert _same(_model(tmp_path / "a"), _model(tmp_path / "b"))
    assert not (tmp_path / "a" / "private").exists()
    note = f"{SIMULATED_NOTE} (central_dp)"
    assert json.loads((tmp_path / "a" / "run.json").read_text())["sessions"][-1]["privacy_noise"] == note
    assert note in (tmp_path / "a" / "summary.md").read_text()
    from fedsight.reporting.compare import compare

    assert compare([tmp_path / "a", tmp_path / "b"]).metrics[-1] == "dp/epsilon"  # the report's privacy column


# -- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("section,line", [
    ({"noise_multiplier": 0.0}, "privacy.central_dp.noise_multiplier"),
    ({"noise_multiplier": -1.0}, "privacy.central_dp.noise_multiplier"),
    ({"clipping_norm": 0.0}, "privacy.central_dp.clipping_norm"),
    ({"delta": 1.0}, "privacy.central_dp.delta"),
    ({"accountant": "prv"}, "privacy.central_dp.accountant"),
    ({"sampling": "poisson"}, "is not how FedSight samples"),
    ({"accountant": "pld", "sampling": "without-replacement"},
     "accountant = 'pld' has no bound for sampling = 'without-replacement'"),
    ({"noise": 1.0}, "privacy.central_dp.noise"),
])
def test_bad_sections_are_one_line_naming_the_key(section, line):
    raw = tiny(**RUN)
    raw["privacy"] = {"central_dp": {**DP, **section}}
    with pytest.raises(ConfigError) as exc:
        validate(raw)
    lines = str(exc.value).splitlines()
    assert len(lines) == 1 and line in lines[0], lines


def test_a_section_without_noise_multiplier_and_two_bad_values_are_one_line_each():
    raw = tiny(**RUN)
    raw["privacy"] = {"central_dp": {"clipping_norm": -1.0, "delta": 2.0}}
    lines = str(pytest.raises(ConfigError, validate, raw).value).splitlines()
    assert len(lines) == 3 and all("privacy.central_dp." in x for x in lines), lines
    assert {k for k in ("noise_multiplier", "clipping_norm", "delta") for x in lines if f"central_dp.{k}" in x} == {
        "noise_multiplier", "clipping_norm", "delta"}


def test_without_the_flower_extra_the_section_is_one_line_naming_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flwr" else real(name, *a))
    with pytest.raises(ConfigError) as exc:
        validate(_raw())
    lines = str(exc.value).splitlines()
    assert len(lines) == 1 and "flower extra (flwr not installed)" in lines[0] and '".[flower]"' in lines[0], lines


@needs_flower
def test_a_recipe_the_mechanism_does_not_cover_is_refused_before_anything_is_written(tmp_path):
    """Data-size weighting changes the sensitivity: the CLI says so in one line (exit 2) and writes nothing."""
    import tomli_w
    from typer.testing import CliRunner

    from fedsight.cli import app

    raw = _raw(**{"recipe.weighting": "data_size", "run.output_dir": str(tmp_path / "runs")})
    (tmp_path / "c.toml").write_text(tomli_w.dumps(raw))
    res = CliRunner().invoke(app, ["run", str(tmp_path / "c.toml")])
    lines = [x for x in res.output.splitlines() if x.startswith("error:")]  # (off a terminal the phases print too)
    assert res.exit_code == 2 and len(lines) == 1 and "recipe.weighting = 'uniform'" in lines[0], res.output
    assert not (tmp_path / "runs").exists()
    raw["privacy"]["central_dp"]["clipping_norm"] = -2.0
    (tmp_path / "c.toml").write_text(tomli_w.dumps(raw))
    res = CliRunner().invoke(app, ["run", str(tmp_path / "c.toml")])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "privacy.central_dp.clipping_norm" in lines[0], res.output
    assert not (tmp_path / "runs").exists()
