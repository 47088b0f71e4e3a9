"""Secrets stay with the party they protect (issue 43, item 1; ``fedsight.secret``).

Under ``[privacy] noise = "simulated"`` (the in-process default) DP noise is the seed's stream, as before: anyone
holding the config regenerates it exactly, and the run says so. Under ``"secret"`` a party holding the config and
the seed regenerates the simulated stream and recovers nothing; the secret lives only in the clients' private
folder (``client_state/secret``), a resumed run reads it back (bit-identical to the uninterrupted run), and two
runs of one seed draw different noise."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from fedsight import registry as R
from fedsight.api import execute
from fedsight.config import validate
from fedsight.errors import ConfigError
from fedsight.rng import derive_seed, torch_gen
from fedsight.secret import SECRET_BYTES, SIMULATED_NOTE, secret_torch_gen
from fedsight.state import ClientStateStore
from fedsight.training import ClientContext
from fedsight.training.context import ClientState
from fedsight.training.local import LocalTraining

from helpers import tiny

DP = {"name": "dp_sgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0, "sampling": "shuffle"}
#: three clients, all sampled every round: every client draws its secret in round 1
RUN = {"partition.num_clients": 3, "server.clients_per_round": 3, "server.rounds": 3, "eval.every": 3,
       "eval.local": False, "engine.threads": 1, "model.norm": "group", "run.checkpoint_keep": 0,
       "recipe.components": [DP]}


def _cfg(noise: str | None, **over):
    raw = tiny(**{**RUN, **over})
    if noise is not None:
        raw["privacy"] = {"noise": noise}
    return validate(raw)


def _model(run_dir):
    return load_file(str(run_dir / "model.safetensors"))


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- the noise of one step: regenerated from the seed, or not ----------------------------------------------------


def _dp_step_noise(tmp_path, noise: str, seed: int = 5, client: int = 2, rnd: int = 3):
    """The noise DP-SGD adds in one step of ``client`` in round ``rnd`` (per-example gradients all zero: the
    step's gradient times the expected batch is the noise itself), and the client's store."""
    torch.manual_seed(0)
    model = torch.nn.Linear(50, 40)
    z, c, n, batch = 1.3, 0.7, 40, 8
    comp = R.build(R.COMPONENTS, "dp_sgd", {"noise_multiplier": z, "max_grad_norm": c, "sampling": "shuffle"})
    store = ClientStateStore(tmp_path / "client_state")
    ctx = ClientContext(client_id=client, round=rnd, model=model, global_params={}, num_examples=n, seed=seed,
                        num_steps=1, local=LocalTraining(batch_size=batch, lr=0.1, steps=1),
                        state=ClientState(store, client, rnd), noise=noise)
    comp.client_start(ctx)
    model(torch.zeros(batch, 50)).sum().mul(0).backward()
    comp.after_backward(ctx)
    comp._release()
    return [p.grad.detach().clone() * batch for p in model.parameters()], (z * c, seed, client, rnd), store


def _regenerated(std, seed, client, rnd, shapes, gen=None):
    """What a party holding the config and seed computes: the stream (seed, "dp_sgd", round, client)."""
    gen = gen or torch_gen(seed, "dp_sgd", rnd, client)
    return [torch.normal(0.0, std, size=s, generator=gen) for s in shapes]


def test_simulated_noise_is_the_seeds_stream(tmp_path):
    """Today's behaviour, unchanged: the seed's holder regenerates the noise exactly (and no secret is drawn)."""
    noise, (std, seed, client, rnd), store = _dp_step_noise(tmp_path, "simulated")
    again = _regenerated(std, seed, client, rnd, [t.shape for t in noise])
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(noise, again))
    assert not (tmp_path / "client_state" / "secret").exists()


def test_secret_noise_is_not_the_seeds_stream_and_only_the_secret_regenerates_it(tmp_path):
    """The attacker's regeneration from the seed is uncorrelated with the noise actually added; the secret file in
    the client's private folder (and only it) regenerates it."""
    noise, (std, seed, client, rnd), store = _dp_step_noise(tmp_path, "secret")
    shapes = [t.shape for t in noise]
    guess = torch.cat([t.flatten() for t in _regenerated(std, seed, client, rnd, shapes)])
    actual = torch.cat([t.flatten() for t in noise])
    assert not torch.allclose(actual, guess, atol=1e-3)
    corr = float(torch.corrcoef(torch.stack([actual, guess]))[0, 1])
    assert abs(corr) < 0.1  # 2,040 coordinates: |corr| of independent draws is about 0.02
    residual = actual - guess  # what subtracting the regenerated noise leaves: still noise of about twice the variance
    assert float(residual.std()) > std
    key = tmp_path / "client_state" / "secret" / f"client-{client:07d}.key"
    secret = key.read_bytes()
    assert len(secret) == SECRET_BYTES and (key.stat().st_mode & 0o777) == 0o600
    own = _regenerated(std, seed, client, rnd, shapes, secret_torch_gen(secret, "dp_sgd", rnd, client))
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(noise, own))
    # the same client's next round, from the same kept secret: fresh noise, no new draw
    noise2, *_ = _dp_step_noise(tmp_path, "secret", rnd=rnd + 1)
    assert not torch.allclose(noise2[0], noise[0]) and key.read_bytes() == secret


def test_secret_dct_noise_is_not_the_seeds_stream(tmp_path):
    """DCT-DP's activation noise: the seed's holder reproduces the noised activation under simulated noise, and
    not under secret noise."""
    from fedsight.functional.dct import dct_mechanism

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1))
    x = torch.randn(6, 3, 16, 16)
    outs = {}
    for noise in ("simulated", "secret"):
        comp = R.build(R.COMPONENTS, "dct_dp", {"epsilon": 2.0, "tau": 4})
        store = ClientStateStore(tmp_path / noise)
        ctx = ClientContext(client_id=1, round=2, model=model, global_params={}, num_examples=6, seed=9, num_steps=1,
                            local=LocalTraining(batch_size=6, lr=0.1, steps=1), state=ClientState(store, 1, 2),
                            noise=noise)
        model.train()
        comp.client_start(ctx)
        with torch.no_grad():
            noised = model(x)
        comp._remove()
        with torch.no_grad():
            raw = model(x)
        gen = torch.Generator().manual_seed(derive_seed(9, "dct_dp", 2, 1))  # the attacker's regeneration
        guess = dct_mechanism(raw, comp.p.c_max, comp.p.tau, comp.sigma, gen, comp.p.low_from)
        outs[noise] = torch.allclose(noised, guess, atol=1e-5)
    assert outs == {"simulated": True, "secret": False}


def test_secure_mode_uses_opacus_floating_point_safe_sampler(tmp_path):
    """``secure_mode``: Opacus's sampler (sum of four draws, halved; one draw discarded) on the same generator:
    the same standard deviation, other values than the plain draw."""
    from opacus.optimizers.optimizer import _generate_noise

    comp = R.build(R.COMPONENTS, "dp_sgd", {"noise_multiplier": 1.0, "secure_mode": True})
    p = torch.zeros(200, 100)
    got = comp._noise(2.0, p, torch_gen(0, "x"))
    assert torch.equal(got, _generate_noise(2.0, p, generator=torch_gen(0, "x"), secure_mode=True))
    assert not torch.equal(got, torch.normal(0.0, 2.0, size=p.shape, generator=torch_gen(0, "x")))
    assert float(got.std()) == pytest.approx(2.0, rel=0.03)


# -- runs ----------------------------------------------------------------------------------------------------------


def test_a_simulated_run_says_so_in_run_json_and_the_summary(tmp_path):
    execute(_cfg(None, **{"server.rounds": 1}), tmp_path / "r")
    [session] = json.loads((tmp_path / "r" / "run.json").read_text())["sessions"]
    assert session["privacy_noise"] == f"{SIMULATED_NOTE} (dp_sgd)"
    assert SIMULATED_NOTE in (tmp_path / "r" / "summary.md").read_text()
    assert not (tmp_path / "r" / "client_state" / "secret").exists()
    # a run without protecting noise says nothing about it
    execute(validate(tiny(**{**RUN, "server.rounds": 1, "recipe.components": []})), tmp_path / "plain")
    assert "privacy_noise" not in json.loads((tmp_path / "plain" / "run.json").read_text())["sessions"][0]


def test_secret_runs_of_one_seed_differ_and_simulated_ones_do_not(tmp_path):
    for noise in ("simulated", "secret"):
        for name in ("a", "b"):
            execute(_cfg(noise, **{"server.rounds": 1}), tmp_path / noise / name)
    assert _same(_model(tmp_path / "simulated" / "a"), _model(tmp_path / "simulated" / "b"))
    assert not _same(_model(tmp_path / "secret" / "a"), _model(tmp_path / "secret" / "b"))
    keys = [(tmp_path / "secret" / n / "client_state" / "secret" / "client-0000000.key").read_bytes() for n in "ab"]
    assert keys[0] != keys[1]


def _files(run_dir):
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_the_secret_is_only_in_the_clients_private_folder(tmp_path):
    """Every secret's bytes (raw, hex, base64-free text forms) appear in no file of the run directory but its own
    key file: not in config.json, run.json, metrics, checkpoints or the summary."""
    run = tmp_path / "r"
    execute(_cfg("secret"), run)
    files = _files(run)
    keys = {k: v for k, v in files.items() if k.startswith("client_state/secret/")}
    assert sorted(keys) == [f"client_state/secret/client-{c:07d}.key" for c in range(3)]
    config = json.loads(files["config.json"])
    assert config["privacy"] == {"noise": "secret", "central_dp": None}  # (no central DP in this run)
    for name, secret in keys.items():
        forms = [secret, secret.hex().encode(), secret.hex().upper().encode(), hashlib.sha256(secret).hexdigest().encode()]
        for other, data in files.items():
            if other != name:
                assert not any(f in data for f in forms), f"{name}'s secret found in {other}"
    session = json.loads(files["run.json"])["sessions"][0]
    assert session["privacy_noise"].startswith("secret:")
    assert "secret:" in files["summary.md"].decode()


def test_resume_under_secret_noise_is_bit_identical(tmp_path, monkeypatch):
    """A run stopped after round 1 and resumed ends bit-identical to the uninterrupted run (the same draws from the
    OS: the draw is replaced by a fixed sequence, so that a second draw on resume would show), and the resume
    reads every secret back instead of drawing it again."""
    import fedsight.secret as S

    draws = []

    def fake_draw():
        draws.append(hashlib.sha256(f"draw {len(draws)}".encode()).digest())
        return draws[-1]

    monkeypatch.setattr(S, "draw_secret", fake_draw)
    execute(_cfg("secret"), tmp_path / "whole")
    whole_draws = list(draws)
    draws.clear()
    execute(_cfg("secret"), tmp_path / "part", stop_after=1)
    fork = tmp_path / "fork"
    shutil.copytree(tmp_path / "part", fork)
    out = execute(_cfg("secret"), tmp_path / "part", resume=True)
    assert out.status == "complete"
    assert draws == whole_draws  # three clients, three draws: none on resume
    assert _same(_model(tmp_path / "whole"), _model(tmp_path / "part"))
    # without the fake: a resume from a copy of the stopped run reads the same secrets (real draws would differ)
    monkeypatch.undo()
    execute(_cfg("secret"), fork, resume=True)
    assert _same(_model(fork), _model(tmp_path / "whole"))


@pytest.mark.parametrize("damage", ["short", "missing"])
def test_a_damaged_or_missing_secret_stops_the_resume_naming_the_file(tmp_path, damage):
    """A secret the checkpoint says was drawn must be there and whole: a new draw would silently change the run's
    noise. The resume stops before anything changes."""
    from fedsight.errors import RunFileError

    execute(_cfg("secret"), tmp_path / "r", stop_after=1)
    key = tmp_path / "r" / "client_state" / "secret" / "client-0000001.key"
    if damage == "short":
        key.write_bytes(b"short")
    else:
        key.unlink()
    before = {k: v for k, v in _files(tmp_path / "r").items() if not k.startswith("client_state/secret/")}
    with pytest.raises(RunFileError, match="client-0000001.key"):
        execute(_cfg("secret"), tmp_path / "r", resume=True)
    after = {k: v for k, v in _files(tmp_path / "r").items() if not k.startswith("client_state/secret/")}
    assert after == before  # nothing changed: no new secret drawn, no round run
    assert key.exists() == (damage == "short")


# -- the watermark key ---------------------------------------------------------------------------------------------


WM = {"name": "watermark", "p": 0.2, "min_carriers": 20, "beta": 0.05}


def _wm_cfg(noise, **wm):
    return _cfg(noise, **{"server.rounds": 2, "eval.every": 2, "recipe.components": [{**WM, **wm}]})


def test_watermark_key_from_a_key_file_never_enters_the_run(tmp_path):
    from fedsight.recipe.ppfl import verify

    key_file = tmp_path / "wm.key"
    key_file.write_bytes(bytes(range(7, 39)))
    cfg = _wm_cfg("secret", key_file=str(key_file))
    execute(cfg, tmp_path / "r")
    files = _files(tmp_path / "r")
    assert not any(bytes(range(7, 39)) in d or bytes(range(7, 39)).hex().encode() in d for d in files.values())
    params = next(c for c in cfg.recipe.components if c.name == "watermark")
    model = _model(tmp_path / "r")
    from fedsight.api import build_task

    template = build_task(cfg).build_model()
    assert verify(model, params, template=template).passed  # the key file's holder verifies the mark
    seed_params = params.model_copy(update={"key_file": None})  # the config holder's guess: the seed's key
    assert not verify(model, seed_params, seed=cfg.seed, template=template).passed


def test_secret_watermark_key_is_drawn_by_the_clients_and_kept_privately(tmp_path):
    from fedsight.api import build_task
    from fedsight.recipe.ppfl import run_watermark_secret, verify

    cfg = _wm_cfg("secret")
    execute(cfg, tmp_path / "r")
    secret = run_watermark_secret(tmp_path / "r")
    assert secret is not None and len(secret) == SECRET_BYTES
    params = next(c for c in cfg.recipe.components if c.name == "watermark")
    template = build_task(cfg).build_model()
    model = _model(tmp_path / "r")
    assert verify(model, params, template=template, secret=secret).passed
    assert not verify(model, params, seed=cfg.seed, template=template).passed  # the seed's key is not the key


def test_a_key_in_the_config_is_refused_under_secret_noise(tmp_path):
    with pytest.raises(ConfigError, match="key_file"):
        _wm_cfg("secret", key="ab" * 16)
    with pytest.raises(ConfigError, match="key_file"):
        _wm_cfg("simulated", key="ab" * 16, key_file=str(tmp_path / "k"))
    with pytest.raises(ConfigError, match="no such file"):
        execute(_wm_cfg("secret", key_file=str(tmp_path / "missing.key")), tmp_path / "r")
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
