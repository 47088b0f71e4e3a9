"""Client-level DP-SGD through Opacus: per-example clipping and Gaussian noise on every local step, with
an (epsilon, delta) accountant per client across every step and round it takes part in.

Mechanism (Abadi et al. 2016, Algorithm 1; Opacus's ``DPOptimizer``). Opacus's ``GradSampleModule`` hooks
compute the per-example gradient g_i of the batch-mean task loss (plus every component's data-dependent
terms: they flow through the model) for each trainable parameter. Each step, with clipping norm C and
noise multiplier z:

    g_i <- g_i / max(1, ||g_i||_2 / C)          (the norm over all trainable parameters together)
    g   <- (sum_i g_i + N(0, z^2 C^2 I)) / E[B] + g_reg

where E[B] is the expected batch size (q n_k with Poisson sampling, the batch size with shuffling) and
g_reg the gradient of data-independent loss terms (a proximal term, a watermark regulariser), which do
not touch the data and need no noise: g_reg = (gradient of the whole objective) - mean_i g_i. The loop's
optimiser step (SGD; Adam through ``train.optimizer``, whose transform runs after this hook when ``dp_sgd`` is
listed before any ``scaffold``, or through ``local_adam`` listed *after* ``dp_sgd``) then uses g: post-processing
of a private gradient stays private.

Sampling and accounting. ``sampling = "poisson"`` (default) draws every local batch by including each of
the client's n_k examples independently with probability q = batch_size / n_k (so batches vary in size and
may be empty: a noise-only step), the sampling the RDP and PRV accountants assume. ``"shuffle"`` keeps the
loop's shuffled fixed-size batches and accounts them *as if* Poisson at the same q: the common practice
(Opacus with ``poisson_sampling=False``), which is not a proof for shuffling; the run says so in the
``privacy_spent`` event (``sampling``). Each round a client trains adds (z, q, steps) to its history, kept
in its state on disk even when its update is later rejected (privacy spent is never forgotten); the
client's epsilon at ``delta`` composes its whole history with Opacus's RDP (Mironov et al.) or PRV
(Gopi et al. 2021) accountant. The RDP orders extend Opacus's default (1.1 .. 63) with 64 .. 1024
(``RDP_ORDERS``): with much noise the optimal order lies above 63 and the default grid over-states epsilon
(z = 20, q = 0.1, 10 steps, delta = 1e-5: 0.111 at order 63 against 0.052 at order 212, Google's dp-accounting:
0.054); an order is only ever a candidate of the minimum, so more orders never loosen the bound.

What is protected: every record of a client's local data, in everything the client releases over the run
(its uploads are post-processing of the noisy steps), at record level ("add/remove one example", Opacus's
neighbouring relation), for the client's own dataset. Not protected: the number of examples a client holds
(``num_examples`` is uploaded for weighting), anything outside the training steps (evaluation metrics a
client reports on its local test set), and nothing is claimed at client (user) level.

``target_epsilon`` instead of ``noise_multiplier``: the multiplier is calibrated per client (its q differs)
with ``opacus.accountants.utils.get_noise_multiplier`` so that ``planned_rounds`` rounds of that client's
steps spend ``target_epsilon`` (``server.rounds`` is the worst case, a client sampled every round); the history
still records what was actually spent.

Where the noise comes from (``[privacy] noise``, ``fedsight.secret``). ``"simulated"`` (the in-process default):
the noise of client k in round r is drawn from the stream (seed, "dp_sgd", r, k) and Poisson batches from the
loop's (seed, "shuffle", r, k): anyone holding the config, the server included, can regenerate the noise and
subtract it, so the epsilon describes the mechanism, not a protection (``run.json`` and ``summary.md`` say so).
``"secret"`` (always on a Flower node): both come from the client's own secret (32 bytes from the OS CSPRNG,
kept in its private state), streams (secret, "dp_sgd", r, k) and (secret, "dp_sgd_sample", r, k); a resumed run
reads the secret back and draws the same noise.

``secure_mode = true``: Opacus's floating-point-safe Gaussian sampling (``opacus.optimizers.optimizer.
_generate_noise(..., secure_mode=True)``: one draw discarded, then the sum of four draws of std sigma halved,
after Holohan & Braghin 2021, which makes reconstructing the noise from the low-order bits of the released
floats (Mironov 2012; Jin et al. 2022 for Opacus) cost about 2^159 instead of 2^53). Opacus's other half of its
secure mode, a CSPRNG generator (``torchcsprng``, which ``PrivacyEngine(secure_mode=True)`` imports), is not
available for torch 2 (its last release, 0.2.1, targets torch 1.8): the draws come from the secret-seeded
Mersenne-Twister stream above, which is not a CSPRNG. It costs four normal draws per parameter per step.

Trained together (``engine.vectorize``: ``vector_step``, ``fedsight.training.private_step``): Opacus's hooks are
removed and the trainer takes each example's gradient under a vmap over the client's batch (torch.func's
per-sample-gradient pattern; through the model's forward only, as the hooks see it, so data-independent terms
stay the unclipped, un-noised ``g_reg``), clips it with the same factor and hands the clipped sum and the unclipped
mean to ``vector_step``'s ``grads``, which applies the formula above. The batches are this component's
``batch_positions`` (an empty Poisson batch is one masked padding example: a noise-only step), the noise is drawn
outside the vectorised call from the same generator, parameter by parameter in the same order (so equal streams
give equal noise), and the accountant gets the same (z, q, steps): the same epsilon. It needs the task's loss to be
a mean of per-example losses (``Task.loss_is_example_mean``: each example's gradient alone is then Opacus's
per-sample gradient) and no component that reruns the model or noises a layer; otherwise the stage trains one
client at a time (``fedsight.training.vectorized.blockers``).

Models with BatchNorm mix examples in a batch and have no per-example gradient: refused at config time
(Opacus's ``ModuleValidator``; use ``norm = "group"``). Loss terms must be batch means (every FedSight task
and component's are) so that Opacus's ``loss_reduction = "mean"`` recovers per-example gradients.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
from pydantic import Field, model_validator
from torch.utils._pytree import tree_flatten, tree_map

from ..metrics import MetricSpec
from ..records import ClientResult
from ..registry import COMPONENTS, Params
from ..secret import noise_generator
from ..device import model_device
from ..errors import ConfigError
from ..training import ClientContext, Component, ServerContext, VectorStep

_HISTORY = "dp_sgd"
# Opacus's backward hooks fire on module outputs when the inputs need no gradient (always, for data): benign
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect to module outputs")


class DPSGDParams(Params):
    noise_multiplier: float | None = Field(None, ge=0, description="z: noise std / clipping norm (set this or target_epsilon)")
    target_epsilon: float | None = Field(None, gt=0, description="calibrate z per client so planned_rounds rounds spend this epsilon")
    delta: float = Field(1e-5, gt=0, lt=1, description="the delta of the reported (epsilon, delta)")
    max_grad_norm: float = Field(1.0, gt=0, description="C: per-example gradient clipping norm (over all trainable parameters)")
    accountant: Literal["rdp", "prv"] = Field("rdp", description="Opacus accountant: Renyi DP or privacy random variables")
    sampling: Literal["poisson", "shuffle"] = Field("poisson", description="Poisson batches (what the accountant assumes) or shuffled fixed-size batches accounted as Poisson")
    planned_rounds: int | None = Field(None, ge=1, description="rounds a client may train (with target_epsilon): z spends target_epsilon over them")
    secure_mode: bool = Field(False, description="Opacus's floating-point-safe Gaussian sampling (4 draws per "
                              "coordinate); the generator stays FedSight's (secret under [privacy] noise = \"secret\")")

    @model_validator(mode="after")
    def _one_of(self) -> "DPSGDParams":
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("set exactly one of noise_multiplier and target_epsilon")
        if self.target_epsilon is not None and self.planned_rounds is None:
            raise ValueError("target_epsilon needs planned_rounds (the rounds a client may train; server.rounds for "
                             "a client sampled every round)")
        return self


RDP_ORDERS = list(range(64, 256, 4)) + [256, 320, 384, 512, 768, 1024]


def _orders(accountant: str) -> dict[str, Any]:
    """The keyword that gives Opacus's RDP accountant ``RDP_ORDERS`` (PRV has no orders)."""
    if accountant != "rdp":
        return {}
    from opacus.accountants import RDPAccountant

    return {"alphas": list(RDPAccountant.DEFAULT_ALPHAS) + RDP_ORDERS}


def epsilon(history: list[tuple[float, float, int]], delta: float, accountant: str = "rdp") -> float:
    """The epsilon at ``delta`` of a history of (noise multiplier, sample rate, steps) entries composed by
    Opacus's accountant (inf for a noiseless step, 0 for no step)."""
    from opacus.accountants import PRVAccountant, RDPAccountant

    steps = [(float(z), float(q), int(n)) for z, q, n in history if n > 0]
    if not steps:
        return 0.0
    if any(z == 0 for z, _, _ in steps):
        return float("inf")
    acc = RDPAccountant() if accountant == "rdp" else PRVAccountant()
    acc.history = steps
    return float(acc.get_epsilon(delta, **_orders(accountant)))


def _standard_layout(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The model's inputs copied into the standard (row-major) strides. Opacus 1.5's per-sample gradients of a
    convolution are wrong when its input activation is laid out channels-last: a one-channel image batch of strides
    (64, 1, 8, 1), as the digits task serves it, is ambiguous, torch propagates channels-last from it, and the
    second convolution of the digits CNN got per-sample gradients whose mean was 0.08 off the batch's gradient (each
    example's own, computed alone, agreed to 1e-7 with the batch's). ``tests/test_dp_vectorized.py``'s
    ``two_convs_dropout_adam`` case compares with the vectorised step, which takes each example's gradient alone."""
    def standard(t: Any) -> Any:
        return t.clone(memory_format=torch.contiguous_format) if isinstance(t, torch.Tensor) and t.dim() >= 4 else t
    return tuple(tree_map(standard, list(args)))


class DPSGD(Component):
    """Per-example clipping and noise on every local step (Opacus), with per-client accounting."""

    name = "dp_sgd"
    #: its noise protects the client's data: secret under ``[privacy] noise = "secret"``
    uses_secrets = True
    #: trained together, the trainer computes each example's clipped gradient (``fedsight.training.private_step``)
    clips_examples = True

    def __init__(self, params: DPSGDParams):
        self.p = params
        self.spent: dict[int, float] = {}  # server side: the latest epsilon each client reported
        self._gsm: Any = None  # the hooks on the work model during one client's training
        self._relayout: Any = None  # ... and the input's re-layout (``_standard_layout``)
        self._inplace: list[Any] = []  # in-place activations switched off meanwhile

    # -- client ----------------------------------------------------------------------------------

    def _rate(self, ctx: ClientContext) -> float:
        return min(1.0, ctx.local.batch_size / max(ctx.num_examples, 1))

    def _multiplier(self, ctx: ClientContext, q: float) -> float:
        if self.p.noise_multiplier is not None:
            return float(self.p.noise_multiplier)
        from opacus.accountants.utils import get_noise_multiplier

        steps = int(self.p.planned_rounds or 1) * ctx.num_steps
        return float(get_noise_multiplier(target_epsilon=self.p.target_epsilon, target_delta=self.p.delta,
                                          sample_rate=q, steps=steps, accountant=self.p.accountant,
                                          **_orders(self.p.accountant)))

    def client_start(self, ctx: ClientContext) -> None:
        from opacus import GradSampleModule

        self._release()  # hooks left behind by a client whose training raised
        q = self._rate(ctx)
        # Opacus's hooks wrap module outputs in views that in-place activations must not modify
        self._inplace = [m for m in ctx.model.modules() if getattr(m, "inplace", False) is True]
        for m in self._inplace:
            m.inplace = False
        self._gsm = GradSampleModule(ctx.model, batch_first=True, loss_reduction="mean", strict=True)
        self._relayout = ctx.model.register_forward_pre_hook(_standard_layout)
        ctx.scratch[self.name] = {"q": q, "z": self._multiplier(ctx, q),
                                  "gen": noise_generator(ctx, "dp_sgd"), "steps": 0}

    def batch_positions(self, ctx: ClientContext, num_steps: int, gen: torch.Generator) -> list[torch.Tensor] | None:
        if self.p.sampling != "poisson":
            return None
        q = ctx.scratch[self.name]["q"]
        if ctx.noise == "secret":  # which examples a step used is part of the secret (amplification assumes it)
            gen = noise_generator(ctx, "dp_sgd_sample")
        return [torch.nonzero(torch.rand(ctx.num_examples, generator=gen) < q).flatten() for _ in range(num_steps)]

    @torch.no_grad()
    def after_backward(self, ctx: ClientContext) -> None:
        s = ctx.scratch[self.name]
        s["steps"] += 1  # the accountant counts the noisy steps actually taken
        params = [p for p in ctx.model.parameters() if p.requires_grad]
        samples = [getattr(p, "grad_sample", None) for p in params]
        first = next((g for g in samples if g is not None), None)
        n = 0 if first is None else first.shape[0]
        if n:
            self._check_rows(n, ctx.inputs)
        expected = s["q"] * ctx.num_examples if self.p.sampling == "poisson" else float(max(n, 1))
        c = self.p.max_grad_norm
        if n:
            norms = torch.zeros(n, device=first.device, dtype=torch.float64)
            for g in samples:
                if g is not None:
                    norms += g.reshape(n, -1).to(torch.float64).pow(2).sum(1)
            factor = (c / (norms.sqrt() + 1e-6)).clamp(max=1.0)
        for p, g in zip(params, samples):
            total = torch.zeros_like(p) if p.grad is None else p.grad
            if g is not None and n:
                reg = total - g.mean(0)  # data-independent terms (proximal, watermark): no noise needed
                clipped = torch.einsum("i,i...->...", factor.to(g.dtype), g)
            else:
                reg, clipped = total, torch.zeros_like(p)
            noise = self._noise(s["z"] * c, p, s["gen"])
            p.grad = (clipped + noise) / expected + reg
            p.grad_sample = None

    def _check_rows(self, rows: int, inputs: Any) -> None:
        """A ``ConfigError`` unless Opacus's per-sample gradients have one row per example of the batch: a model that
        folds another dimension into the batch (a video model's frames, ``sliding_vsr``: ``[B T, ...]``) gives one
        per frame, so each frame would be clipped to C (a clip moving the update by up to T C against noise for C)
        and scaled by T. Vectorised training takes each example's gradient alone and has no such rows."""
        leaves = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
        examples = leaves[0].shape[0] if leaves and leaves[0].dim() else None
        if examples is not None and rows != examples:
            raise ConfigError(f"dp_sgd: the model's layers compute on {rows} rows for a batch of {examples} examples "
                              f"(it folds another dimension, such as a clip's frames, into the batch), so Opacus's "
                              f"per-sample gradients would not be per example; train this stage vectorised "
                              f"(engine.vectorize = true), which takes each example's gradient alone")

    def vector_step(self, ctx: ClientContext) -> VectorStep:
        """``after_backward`` for the vectorised step (``fedsight.training.private_step``): the trainer hands the
        clipped sum, the unclipped mean and the number of real examples; this client's noise is drawn outside the
        step (``step_draw``) from its own generator, parameter by parameter in the model's order, as
        ``after_backward`` draws it (the same draws: equal noise on equal streams). Opacus's hooks are removed (the
        trainer's per-example vmap replaces them)."""
        self._release()
        s, p = ctx.scratch[self.name], self.p
        std, c = s["z"] * p.max_grad_norm, p.max_grad_norm
        params = [(k, q) for k, q in ctx.model.named_parameters() if q.requires_grad]
        poisson = p.sampling == "poisson"

        def step_draw() -> dict[str, torch.Tensor]:
            s["steps"] += 1
            return {k: self._noise(std, q, s["gen"]) for k, q in params}

        def grads(own: Any, _params: Any, grads: Any) -> dict[str, torch.Tensor]:
            # the sequential ``(clipped + noise) / E[B] + (p.grad - mean_i g_i)``, E[B] = q n_k (Poisson) or the
            # batch's size (shuffle)
            expected = own["expected"] if poisson else own["examples"].clamp(min=1)
            return {k: (own["clipped_sum"][k] + own["drawn"][k]) / expected + (g - own["example_mean"][k])
                    for k, g in grads.items()}

        expected = torch.tensor(s["q"] * ctx.num_examples, dtype=torch.float64, device=model_device(ctx.model))
        return VectorStep(tensors={"expected": expected}, grads=grads, clip_examples=c, step_draw=step_draw)

    def _noise(self, std: float, p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """N(0, std^2) of ``p``'s shape and dtype on ``p``'s device, drawn from ``gen`` (CPU): plainly, or by Opacus's
        floating-point-safe sampler (``secure_mode``)."""
        if not self.p.secure_mode:
            return torch.normal(0.0, std, size=p.shape, generator=gen, dtype=p.dtype).to(p.device)
        from opacus.optimizers.optimizer import _generate_noise

        ref = torch.empty(p.shape, dtype=p.dtype)  # on the generator's device (CPU)
        return _generate_noise(std, ref, generator=gen, secure_mode=True).to(device=p.device, dtype=p.dtype)

    def client_end(self, ctx: ClientContext, result: ClientResult) -> None:
        s = ctx.scratch.pop(self.name)
        self._release()
        held = ctx.state.load(_HISTORY) if ctx.state is not None else None
        prev = held["history"].tolist() if held is not None else []
        history = prev + [[s["z"], s["q"], float(s["steps"])]]
        if ctx.state is not None:
            ctx.state.save(_HISTORY, {"history": torch.tensor(history, dtype=torch.float64)}, always=True)
        eps = epsilon([(z, q, int(n)) for z, q, n in history], self.p.delta, self.p.accountant)
        result.metrics.update({"privacy/epsilon": eps, "privacy/noise_multiplier": s["z"], "privacy/sample_rate": s["q"]})

    def _release(self) -> None:
        """Remove the per-example-gradient hooks and attributes from the work model; restore in-place activations."""
        if self._gsm is not None:
            self._gsm._close()
            self._gsm = None
        if self._relayout is not None:
            self._relayout.remove()
            self._relayout = None
        for m in self._inplace:
            m.inplace = True
        self._inplace = []

    # -- server ----------------------------------------------------------------------------------

    def server_results(self, sctx: ServerContext, results: list[ClientResult]) -> list[ClientResult]:
        for res in results:
            eps = res.metrics.get("privacy/epsilon")
            if eps is None:
                continue
            self.spent[res.client_id] = float(eps)
            sctx.events.append({"event": "privacy_spent", "client": res.client_id, "epsilon": float(eps),
                                "delta": self.p.delta, "noise_multiplier": res.metrics.get("privacy/noise_multiplier"),
                                "sample_rate": res.metrics.get("privacy/sample_rate"), "accountant": self.p.accountant,
                                "sampling": self.p.sampling})
        if self.spent:
            sctx.metrics["privacy/epsilon_max"] = max(self.spent.values())
            sctx.metrics["privacy/delta"] = self.p.delta
        return results

    def state_dict(self) -> dict[str, Any]:
        return {"spent": torch.tensor([[c, e] for c, e in sorted(self.spent.items())], dtype=torch.float64).reshape(-1, 2)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        t = state.get("spent")
        self.spent = {int(c): float(e) for c, e in t.tolist()} if t is not None else {}


def _check(spec: DPSGDParams, cfg: Any) -> str | None:
    """Models whose layers mix the examples of a batch (BatchNorm) have no per-example gradients, and a model that
    folds a clip's frames into the batch (``FedModel.folds_batch``) has per-frame rows under Opacus: refused before
    anything is written unless the stage trains vectorised (a model that folds without declaring it, a plugin, is
    refused at its first step by ``DPSGD._check_rows``)."""
    import torch as _torch
    from opacus.validators import ModuleValidator

    from ..models import build_model
    from ..tasks.base import component_params

    try:
        with _torch.device("meta"):
            model = build_model(cfg.model.name, component_params(cfg.model), in_channels=3, num_outputs=3, image_size=32, scale=2)
    except Exception:  # noqa: BLE001 - placeholder shapes; the real build reports its own errors
        return None
    if getattr(model, "folds_batch", False) and cfg.engine.vectorize is not True:
        return (f"'dp_sgd' needs per-example gradients, but model {cfg.model.name!r} folds a clip's frames into the "
                f"batch, so Opacus's per-sample gradients would be per frame; set engine.vectorize = true (vectorised "
                f"DP-SGD takes each example's gradient alone)")
    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        first = str(errors[0]).splitlines()[0]
        return (f"'dp_sgd' needs per-example gradients, but model {cfg.model.name!r} has {len(errors)} layer(s) that "
                f"Opacus cannot handle ({first}); use a model without BatchNorm (e.g. norm = \"group\")")
    return None


@COMPONENTS.register(
    "dp_sgd", params=DPSGDParams, check=_check,
    help="DP-SGD through Opacus: per-example clipping + Gaussian noise, per-client (epsilon, delta) accounting",
    metrics=(MetricSpec("privacy/epsilon_max", False, "largest epsilon any client has spent so far"),
             MetricSpec("privacy/delta", None, "the delta of the reported epsilons")),
)
def _dp_sgd(params: DPSGDParams) -> DPSGD:
    return DPSGD(params)
