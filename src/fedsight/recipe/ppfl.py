"""PPFL-RDSN's two client-side mechanisms (He & Joshi, sections 3.2-3.3) as recipe components.

``dct_dp``: the DCT-domain activation mechanism of Algorithm 1 (``fedsight.functional.dct.dct_mechanism``) on the
output of one layer of the client's model, during local training only.

**What it protects**: the activation at layer k, per forward pass, per example: each example's noised
high-band DCT coefficients f~ (u + v >= tau, after clipping that example's activation to L2 norm C_max) are one
release of a Gaussian mechanism that is (epsilon, delta)-DP with respect to that example (sensitivity 2 C_max,
sigma from ``calibration``). **What it does not protect**: the layer's low band, which the paper's eq. (2)
passes on without noise (from the unclipped activation by default), so the activation H~ as a whole is *not*
DP; the uploaded weights, which are not DP (layers before k see the raw inputs and their gradients depend on
them directly, and the loss sees the raw targets); and repeated passes: every local step's forward pass of an
example is a separate release and no composition over steps, epochs or rounds is claimed (the paper's "moments
accountant ... 30 local steps with sigma = 0.8" sentence describes DP-SGD, see ``dp_sgd``). The activation is
never sent anywhere here: only weights are uploaded (Algorithm 1's "send H~" is not implemented).

Each round the client reports the single-release (epsilon, delta) and sigma, and how many noised releases each
of its examples made on average (``privacy/dct_passes``: noised entries along the layer output's dimension 0 over
the client's examples; a video model that folds frames into dimension 0 counts each frame as a release): the row
carries them as ``privacy/dct_*``.

The noise comes from a generator on the model's device: under ``[privacy] noise = "simulated"`` (the in-process
default) seeded from (seed, "dct_dp", round, client) (``fedsight.rng``), which anyone holding the config, the server
included, can regenerate; under ``"secret"`` (always on a Flower node) from the client's own secret (OS CSPRNG,
kept in its private state; ``fedsight.secret``), which no one else holds. The forward hook is registered in
``client_start`` on the client's work model and removed in ``client_end``; it acts only while the model is in
training mode and only for the registration of the current client (a hook left by a client refused or failed after
``client_start`` stays inert outside training mode and is removed by the next ``client_start``), so evaluation
and the server's model never see it. Trained together (``engine.vectorize``), the component removes its hook and
hands the trainer the mechanism and each client's noise draws instead (``vector_step``): the same noise from the
same generator, for each client's real examples. "Per example" means per entry of the layer's output along
dimension 0; it assumes the layers up to k treat examples independently (no BatchNorm in training mode before k).

``watermark``: the parameter watermark of section 3.3 (``fedsight.functional.watermark``). Every client adds
lam * L_wm to its local objective (``loss_term``); from round ``verify_from`` on it first verifies the global model
it received: S <= threshold refuses it, with the ``fallback`` of ``fedsight.recipe.ppfl_accept`` ("keep_own", the
default: ``ModelRefused``, the client trains nothing and the server logs a ``model_refused`` event with ``score`` and
``threshold``; "reinitiate": the client trains from its own model instead). A model that passes may then be tested
for performance (``perf_test``, listed after ``watermark``: the paper's order). ``verify_from`` defaults to 2: round 1 starts from the
randomly initialised, unmarked model, and the first aggregate (after round 1) is the first marked one.

The key mk is shared by all clients and must not be known to the server. Where it comes from (``watermark_key``):

* ``key_file`` (recommended; required on Flower): a file of raw random bytes, ``fedsight etlc keygen -o FILE``,
  read by each client where it runs (every node holds the same file at that path); only the path is in the
  config. The server side never reads it (``fedsight.secret.server_side``).
* neither ``key`` nor ``key_file``: under ``[privacy] noise = "simulated"`` derived from the run seed (anyone
  with the config knows it: a simulation of the protocol, not of its secrecy); under ``"secret"`` drawn once by
  the clients from the OS CSPRNG and kept in their private store (``client_state/secret/watermark.key``).
  A Flower node cannot draw a key the other nodes share: there, give ``key_file``.
* ``key`` (hex): in the config, which the server and every log of the config hold: a simulation only; refused
  under ``[privacy] noise = "secret"`` and on Flower.

**Strength of the regulariser.** L_wm is a mean over |J|, so the pull on one carrier is
(2 lam / |J|)(theta_j w_j - beta) per unit learning rate: at the paper's lam = 1e-4 and |J| >= 500 that moves no
weight in any realistic training. The default ``lam = None`` sets lam = |J|: each carrier then feels
(theta_j w_j - beta)^2 with unit weight. Robustness to magnitude pruning needs beta above the pruned magnitude
quantile of the weights (carriers at |theta_j| = beta below it are zeroed with the rest).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field, field_validator, model_validator
from torch import nn

from ..device import model_device
from ..errors import ConfigError
from ..functional.dct import dct_mechanism, dct_noise, draws_noise, gaussian_sigma
from ..functional.watermark import (
    Carrier,
    hoeffding_false_positive,
    model_carrier,
    score_bound,
    select_params,
    wm_loss,
    wm_score,
)
from ..metrics import MetricSpec
from ..records import ClientResult
from ..registry import COMPONENTS, Params
from ..rng import derive_seed
from ..secret import holds_client_secrets, noise_generator, read_key_file
from ..training import ClientContext, Component, OutputNoise, ServerContext, VectorStep
from .ppfl_accept import REFUSED, Fallback, keep_own_model, refuse, refused

__all__ = [
    "DctDP",
    "DctDPParams",
    "Verification",
    "Watermark",
    "WatermarkParams",
    "find_layer",
    "verify",
    "watermark_key",
]


def report_means(sctx: ServerContext, results: list[ClientResult], keys: tuple[str, ...]) -> None:
    """The round's row gets the clients' mean of each of ``keys`` they reported (the server merges only
    ``train/loss`` on its own)."""
    for key in keys:
        vals = [float(r.metrics[key]) for r in results if key in r.metrics]
        if vals:
            sctx.metrics[key] = sum(vals) / len(vals)


# ------------------------------------------------------------------------------------------------ dct_dp


class DctDPParams(Params):
    layer: str = Field("", description="qualified name of the module whose output is noised (layer k); "
                       "empty: the model's first Conv2d")
    epsilon: float = Field(2.75, gt=0, description="epsilon of one release of one example's high band (the paper: 2.75)")
    delta: float = Field(1e-5, gt=0, lt=1, description="delta of one release")
    c_max: float = Field(1.0, gt=0, description="C_max: per-example L2 clip of the activation over C*h*w (the paper "
                         "gives no value; scale-dependent)")
    tau: int = Field(8, ge=0, description="noise on DCT coefficients with u + v >= tau (zero-based)")
    calibration: Literal["classic", "analytic"] = Field(
        "classic", description="classic: 2 C_max sqrt(2 ln(1.25/delta))/epsilon (the paper; proven for epsilon < 1); "
        "analytic: Balle & Wang 2018 (exact for every epsilon)")
    low_from: Literal["unclipped", "clipped"] = Field(
        "unclipped", description="the un-noised low band of eq. (2): from the raw activation (the paper) or the clipped one")


def find_layer(model: nn.Module, name: str) -> tuple[str, nn.Module]:
    """The module ``name`` of ``model`` (empty: its first Conv2d); a one-line ``ConfigError`` listing valid
    names otherwise."""
    modules = dict(model.named_modules())
    if not name:
        for k, m in modules.items():
            if isinstance(m, nn.Conv2d):
                return k, m
        raise ConfigError("dct_dp: the model has no Conv2d; set recipe.components[].layer to a module with "
                          "[N, ..., h, w] outputs")
    if name not in modules:
        valid = [k for k in modules if k][:8]
        raise ConfigError(f"dct_dp: layer {name!r} is not a module of the model; valid names include: "
                          f"{', '.join(valid)}{' ...' if len(modules) > 9 else ''}")
    return name, modules[name]


class DctDP(Component):
    """Algorithm 1 on one layer's output during local training (see the module docstring)."""

    name = "dct_dp"
    noises_a_layer = True
    #: its noise protects the client's data: secret under ``[privacy] noise = "secret"``
    uses_secrets = True

    def __init__(self, params: DctDPParams | None = None):
        self.p = params or DctDPParams()
        self.sigma = gaussian_sigma(self.p.epsilon, self.p.delta, self.p.c_max, self.p.calibration)
        self._handle: Any = None
        self._token: object | None = None

    def _remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
        self._handle, self._token = None, None

    def adapt_model(self, model: nn.Module, seed: int) -> None:
        find_layer(model, self.p.layer)  # an unknown layer fails when the run is built, not in round 1

    def client_start(self, ctx: ClientContext) -> None:
        self._remove()
        name, module = find_layer(ctx.model, self.p.layer)
        dev = model_device(ctx.model)
        gen = noise_generator(ctx, "dct_dp", device=dev)
        token, root, count = object(), ctx.model, [0]
        p, sigma = self.p, self.sigma

        def hook(mod: nn.Module, inputs: Any, output: Any) -> Any:
            if self._token is not token or not root.training:
                return None
            self._check_output(output)
            count[0] += int(output.shape[0])
            return dct_mechanism(output, p.c_max, p.tau, sigma, gen, p.low_from)

        self._handle, self._token = module.register_forward_hook(hook), token
        ctx.scratch[self.name] = {"count": count, "gen": gen, "layer": name}

    def _check_output(self, output: Any) -> None:
        """A one-line ``ConfigError`` unless the layer's output is a floating [N, ..., h, w] tensor."""
        tensor = isinstance(output, torch.Tensor)
        self._check_shape(tuple(output.shape) if tensor else type(output).__name__, output.dtype if tensor else None)

    def _check_shape(self, shape: tuple[int, ...] | str, dtype: torch.dtype | None) -> None:
        """``_check_output`` of an output of ``shape`` (a type's name for anything but a tensor) and ``dtype``."""
        if not isinstance(shape, tuple) or len(shape) < 3 or dtype is None or not dtype.is_floating_point:
            raise ConfigError(f"dct_dp: layer {self.p.layer or 'first Conv2d'!r} outputs {shape}; it needs a "
                              f"floating [N, ..., h, w] tensor")

    def vector_step(self, ctx: ClientContext) -> VectorStep:
        """The mechanism for the trainer to apply (``OutputNoise``), with this client's noise drawn from its own
        generator as the hook draws it; the hook is removed (the vectorised forward draws nothing itself)."""
        self._remove()
        s, p, sigma = ctx.scratch[self.name], self.p, self.sigma
        count, gen, device = s["count"], s["gen"], model_device(ctx.model)

        def draw(shape: Any, dtype: Any) -> torch.Tensor:
            self._check_shape(shape, dtype)
            count[0] += int(shape[0])
            if not draws_noise(shape, p.tau, sigma):  # (the hook draws nothing then)
                return torch.zeros(shape, dtype=dtype, device=device)
            return dct_noise(shape, dtype, gen, device)

        def apply(output: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
            return dct_mechanism(output, p.c_max, p.tau, sigma, None, p.low_from, noise=noise)

        return VectorStep(output_noise=OutputNoise(s["layer"], draw, apply))

    def client_end(self, ctx: ClientContext, result: ClientResult) -> None:
        count = ctx.scratch.get(self.name, {"count": [0]})["count"]
        self._remove()
        result.metrics["privacy/dct_epsilon"] = float(self.p.epsilon)
        result.metrics["privacy/dct_delta"] = float(self.p.delta)
        result.metrics["privacy/dct_sigma"] = float(self.sigma)
        result.metrics["privacy/dct_passes"] = count[0] / max(ctx.num_examples, 1)

    def server_round_end(self, sctx: ServerContext, results: list[ClientResult], weights: torch.Tensor) -> None:
        report_means(sctx, results, ("privacy/dct_epsilon", "privacy/dct_delta", "privacy/dct_sigma", "privacy/dct_passes"))


@COMPONENTS.register(
    "dct_dp", params=DctDPParams,
    help="PPFL-RDSN: clip + DCT + Gaussian noise on the high band of one layer's activation (per example, per pass)",
    metrics=(MetricSpec("privacy/dct_epsilon", None, "epsilon of ONE release of one example's noised high-band "
                        "activation at the layer (not of the model; no composition over steps or rounds)"),
             MetricSpec("privacy/dct_delta", None, "delta of that single release"),
             MetricSpec("privacy/dct_sigma", None, "noise std per high-band DCT coefficient"),
             MetricSpec("privacy/dct_passes", None, "noised releases per example this round (client mean)")),
)
def _dct_dp(params: DctDPParams) -> DctDP:
    return DctDP(params)


# --------------------------------------------------------------------------------------------- watermark


class WatermarkParams(Params):
    key: str | None = Field(None, description="hex key mk in the config (a simulation only: the config is no secret; "
                            "refused under [privacy] noise = \"secret\" and on Flower); prefer key_file")
    key_file: str | None = Field(None, description="file of the clients' shared key (raw bytes, `fedsight etlc keygen "
                                 "-o FILE`), read by each client; none and no key: from the run seed (simulated "
                                 "noise) or the clients' private store (secret)")
    p: float = Field(0.005, gt=0, lt=1, description="carrier probability: J = {j : PRF(mk, j) < p}")
    min_carriers: int = Field(500, ge=1, description="refuse to train with fewer carriers |J| (the paper: >= 500)")
    lam: float | None = Field(None, ge=0, description="lambda of lambda * L_wm; none: |J| (unit weight per carrier; "
                              "the paper's 1e-4 cannot embed with L_wm's 1/|J|)")
    beta: float = Field(0.1, gt=0, description="target of theta_j w_j on the carriers (signs w_j = +-1)")
    threshold: float | None = Field(None, description="accept the received model when S > threshold; none: beta/2")
    params: tuple[str, ...] = Field((), description="name prefixes of the marked parameters; empty: every "
                                    "floating parameter")
    verify_from: int = Field(2, ge=1, description="first round whose received model is verified (round 1's "
                             "is the unmarked initial model)")
    fallback: Fallback = Field("keep_own", description="after a refused model: keep_own (train nothing) or "
                               "reinitiate (train from the own model); fedsight.recipe.ppfl_accept")

    @field_validator("key")
    @classmethod
    def _hex(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            raw = bytes.fromhex(v)
        except ValueError:
            raise ValueError("key must be a hex string (e.g. 32 random bytes: python -c \"import secrets; "
                             "print(secrets.token_hex(32))\")") from None
        if not raw:
            raise ValueError("key must not be empty")
        return v

    @model_validator(mode="after")
    def _one_key(self) -> "WatermarkParams":
        if self.key is not None and self.key_file is not None:
            raise ValueError("give the key once: key or key_file, not both")
        return self

    @property
    def accept_above(self) -> float:
        return self.beta / 2 if self.threshold is None else float(self.threshold)


def watermark_key(params: WatermarkParams, seed: int = 0, secret: bytes | None = None) -> bytes:
    """mk as bytes: the hex ``key``, the bytes of ``key_file``, else ``secret`` (the clients' drawn key) when given,
    else 16 bytes derived from the run seed (simulated: anyone with the config can compute them)."""
    if params.key is not None:
        return bytes.fromhex(params.key)
    if params.key_file is not None:
        return read_key_file(params.key_file, "watermark key_file")
    if secret is not None:
        return secret
    return derive_seed(seed, "watermark-key").to_bytes(8, "little") + derive_seed(seed, "watermark-key", 1).to_bytes(8, "little")


def run_watermark_secret(run_dir: Any) -> bytes | None:
    """The clients' drawn watermark key of an in-process run (``client_state/secret/watermark.key``), for
    ``verify``; None when the run has none (simulated noise, or a key / key_file)."""
    from pathlib import Path

    from ..state import SECRET_DIR

    path = Path(run_dir) / "client_state" / SECRET_DIR / "watermark.key"
    return path.read_bytes() if path.is_file() else None


@dataclass(frozen=True)
class Verification:
    score: float
    threshold: float
    passed: bool
    carriers: int
    #: max |theta_j| over J of the tested model, and the Hoeffding bound with it (a heuristic plug-in)
    bound: float
    false_positive_bound: float


def _resolve(params: WatermarkParams | dict[str, Any]) -> WatermarkParams:
    return params if isinstance(params, WatermarkParams) else WatermarkParams(**params)


def verify(model_or_state: nn.Module | dict[str, torch.Tensor], params: WatermarkParams | dict[str, Any],
           seed: int = 0, template: nn.Module | None = None, secret: bytes | None = None) -> Verification:
    """Algorithm 2's VerifyWatermark on a model, or on a state dict with the parameter names of ``template``
    (a model of the same architecture; without it a state dict's floating tensors except BatchNorm statistics
    are taken, which matches ``select_params`` only for models whose other buffers are not floating). ``secret``: the
    clients' drawn key of a run under ``[privacy] noise = "secret"`` without ``key_file`` (``run_watermark_secret``)."""
    p = _resolve(params)
    if isinstance(model_or_state, nn.Module):
        names = select_params(model_or_state, p.params)
    elif template is not None:
        names = select_params(template, p.params)
    else:
        names = [k for k, v in model_or_state.items() if v.is_floating_point()
                 and not k.endswith(("running_mean", "running_var"))
                 and (not p.params or any(k.startswith(pre) for pre in p.params))]
    c = model_carrier(model_or_state, watermark_key(p, seed, secret), p.p, names=names)
    s, b = wm_score(model_or_state, c), score_bound(model_or_state, c)
    thr = p.accept_above
    return Verification(s, thr, s > thr, c.size, b, hoeffding_false_positive(c.size, thr, b))


class Watermark(Component):
    """Embeds the key's mark through the local objective and verifies the received global model."""

    name = "watermark"
    refuses_models = True

    @property
    def uses_secrets(self) -> bool:
        """Whether its key is known to whoever holds the config unless ``[privacy] noise = "secret"`` (no key_file)."""
        return self.p.key_file is None

    def __init__(self, params: WatermarkParams | None = None):
        self.p = params or WatermarkParams()
        self._carriers: dict[tuple, Carrier] = {}

    def carrier_of(self, model: nn.Module, seed: int, device: torch.device | None = None,
                   key: bytes | None = None) -> Carrier:
        """The model's carrier set for ``key`` (default: ``watermark_key(params, seed)``), cached per architecture,
        key and device."""
        key = watermark_key(self.p, seed) if key is None else key
        names = tuple(select_params(model, self.p.params))
        params = dict(model.named_parameters())
        sig = (names, tuple(params[k].numel() for k in names), hashlib.sha256(key).digest(), str(device))
        c = self._carriers.get(sig)
        if c is None:
            c = model_carrier(model, key, self.p.p, names=names)
            if device is not None:
                parts = tuple((k, pos.to(device), w.to(device)) for k, pos, w in c.parts)
                c = Carrier(c.names, c.numels, c.p, c.indices, c.signs, parts)
            self._carriers[sig] = c
        return c

    def _check_size(self, c: Carrier) -> None:
        if c.size < self.p.min_carriers:
            need = self.p.min_carriers / max(c.d, 1)
            raise ConfigError(
                f"watermark: only {c.size} carrier coordinates (p = {self.p.p:g} of d = {c.d} marked parameters), "
                f"fewer than min_carriers = {self.p.min_carriers}: raise p above about {min(1.3 * need, 1.0):.3g} or mark "
                f"more parameters")

    def adapt_model(self, model: nn.Module, seed: int) -> None:
        # too few carriers fail when the run is built, by a builder that holds the key file (not a server:
        # ``fedsight.secret.server_side``); a key the clients draw is checked with the seed's key here (the same
        # count in distribution) and exactly at each client's start
        if self.p.key_file is None or holds_client_secrets():
            self._check_size(self.carrier_of(model, seed))

    def client_key(self, ctx: ClientContext) -> bytes:
        """The key this client marks and verifies with (``watermark_key``; the clients' drawn key under ``[privacy]
        noise = "secret"`` without key / key_file)."""
        if self.p.key is None and self.p.key_file is None and ctx.noise == "secret":
            if ctx.state is None:
                raise ValueError("watermark: a secret key needs the clients' private state; none is attached")
            return ctx.state.shared_secret("watermark")
        return watermark_key(self.p, ctx.seed)

    def client_start(self, ctx: ClientContext) -> None:
        c = self.carrier_of(ctx.model, ctx.seed, model_device(ctx.model), key=self.client_key(ctx))
        self._check_size(c)
        received = ctx.global_state if ctx.global_state else ctx.model
        score = wm_score(received, c)
        thr = self.p.accept_above
        if ctx.round >= self.p.verify_from and not score > thr:
            refuse(ctx, self.p.fallback, f"watermark check failed: S = {score:.4g} <= threshold {thr:.4g} "
                   f"(|J| = {c.size})", score=score, threshold=thr, carriers=c.size)
        lam = float(c.size) if self.p.lam is None else float(self.p.lam)
        ctx.scratch[self.name] = {"carrier": c, "lam": lam, "score": score}

    def loss_term(self, ctx: ClientContext, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        s = ctx.scratch[self.name]
        if s["lam"] == 0.0:
            return None
        return s["lam"] * wm_loss(ctx.model, s["carrier"], self.p.beta)

    def vector_step(self, ctx: ClientContext) -> VectorStep:
        """``loss_term`` of the client's parameters: the carrier set and lam are every client's (one key, one
        architecture). A marked parameter that does not train (``train.freeze``) still counts in L_wm's value: the
        client's own value rides along in ``tensors``."""
        s = ctx.scratch[self.name]
        if s["lam"] == 0.0:
            return VectorStep()
        c, lam, beta = s["carrier"], s["lam"], self.p.beta
        marked = set(c.names)
        frozen = {k: p.detach().clone() for k, p in ctx.model.named_parameters()  # (the work model moves on)
                  if k in marked and not p.requires_grad}
        return VectorStep(tensors=frozen,
                          loss_term=lambda own, params, outputs, targets: lam * wm_loss({**own, **params}, c, beta))

    def client_end(self, ctx: ClientContext, result: ClientResult) -> None:
        if self.p.fallback == "reinitiate":
            keep_own_model(ctx)
        result.metrics[REFUSED] = 1.0 if refused(ctx) else 0.0
        s = ctx.scratch[self.name]
        result.metrics["wm/score"] = float(s["score"])
        result.metrics["wm/local_score"] = float(wm_score(ctx.model, s["carrier"]))
        result.metrics["wm/carriers"] = float(s["carrier"].size)

    def server_round_end(self, sctx: ServerContext, results: list[ClientResult], weights: torch.Tensor) -> None:
        report_means(sctx, results, ("wm/score", "wm/local_score", "wm/carriers"))


def _check_watermark(spec: WatermarkParams, cfg: Any) -> str | None:
    """A key written into the config is no secret: refused when the run asks for secret noise and keys."""
    privacy = getattr(cfg, "privacy", None)
    if spec.key is not None and getattr(privacy, "noise", "simulated") == "secret":
        return ("watermark key is written in the config (config.json, every node's run config), but privacy.noise = "
                "\"secret\": give key_file instead (`fedsight etlc keygen -o FILE`), or no key (the clients draw one)")
    return None


@COMPONENTS.register(
    "watermark", params=WatermarkParams, check=_check_watermark,
    help="PPFL-RDSN: PRF-keyed sparse parameter watermark, embedded by a regulariser, verified on every received model",
    metrics=(MetricSpec("wm/score", None, "S of the received global model (client mean)"),
             MetricSpec("wm/local_score", None, "S of the clients' models after local training (mean)"),
             MetricSpec("wm/carriers", None, "|J|, the number of carrier coordinates")),
)
def _watermark(params: WatermarkParams) -> Watermark:
    return Watermark(params)
