"""PPFL-RDSN's client-side acceptance of a received global model (He & Joshi, section 3, "Local EtLC"; Fig. 1).

The paper's client, on receiving the aggregate: "execute[s] a model integrity check using their embedded watermark.
Successful verification leads to performance testing, involving inputting lossy or low-resolution images into the
global model. Depending on the test outcomes, the client either retains the global model or reinitiates local
training iterations." The watermark check is ``fedsight.recipe.ppfl.Watermark``; this module holds the two other
pieces, which the paper names but does not specify:

``perf_test`` (the performance test). The paper gives no criterion; ours compares the received model with the
client's *own* model, the one it holds from its last participation (its locally trained weights, kept in its
private state under ``own_model``), on the same sample of its own training pairs (low-resolution inputs, their
high-resolution targets): accept when ``score(received) >= score(own) - tolerance``, the score being the mean
per-image PSNR in dB (``metric = "psnr"``, RGB, no border crop: the patches are small) or the negative task loss
(``metric = "loss"``, any task). The default tolerance, 0.5 dB, lets an honest aggregate through: with 0, a client
of ``examples/ppfl_rdsn.toml`` refused an honest round-2 aggregate that scored 0.02 dB below its own model on
its own patches (a smoke run); a poisoned model loses far more. A client with no own model yet (its first
participation) accepts: it has nothing to compare with. The sample: ``examples`` of the client's training examples drawn from the stream (seed,
"perf_test", round, client), their random crops from torch's generator re-seeded from (seed, "perf_test-crop",
round, client) inside ``torch.random.fork_rng`` (the training that follows draws exactly what it would without the
test). Both models are evaluated in eval mode, on the same batch.

The fallback after a refusal (``fallback``, here and on ``watermark``), the two the paper names:

* ``"keep_own"``: the client keeps the model it holds and trains nothing this round (``ModelRefused``: the server
  logs a ``model_refused`` event and aggregates without it); its stored own model is not touched (bit for bit).
  On ``watermark`` this is the default and the behaviour before this option existed.
* ``"reinitiate"``: the client "reinitiates local training iterations": it discards the received model, loads its
  own model into the work model and trains this round from there, and uploads the result (its delta is taken
  against the received model, so FedAvg's new global is the weighted mean of the uploaded models, as ever). A client
  without an own model re-initialises its weights (every module's ``reset_parameters``, torch's generator re-seeded
  from (seed, "reinitiate", round, client)): the paper's "if a client lacks a pretrained model, it initialises
  theta_0 and performs local training" (section 4.1-III). That is PyTorch's default initialisation of each layer,
  which is RDSN's own (it sets no other); a model with a custom initialisation gets the defaults instead.

Every refusal counts in the round's ``clients/refused`` (``fedsight.engine.server``): the ``model_refused`` events
(keep_own) plus the clients that re-initiated (their result's ``REFUSED`` metric).

The own model costs one copy of the model's state per client in the client state store (on disk in a run
directory), written only by components that need it: ``perf_test`` always, ``watermark`` under ``reinitiate``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from ..errors import ConfigError, ModelRefused
from ..functional.image_metrics import psnr
from ..metrics import MetricSpec
from ..records import ClientResult
from ..registry import COMPONENTS, Params
from ..rng import derive_seed, torch_gen
from ..training import ClientContext, Component, ServerContext

__all__ = ["OWN", "REFUSED", "PerfTest", "PerfTestParams", "keep_own_model", "refuse"]

#: client-state key of the client's own model (its state dict at the end of its last local training)
OWN = "own_model"
#: metric of a client's result: 1.0 when it refused the received model and re-initiated training
REFUSED = "clients/refused"

Fallback = Literal["keep_own", "reinitiate"]


def keep_own_model(ctx: ClientContext) -> None:
    """Hold the client's trained model (its whole state dict) as its own model; written when its update is kept."""
    if ctx.state is not None:
        ctx.state.save(OWN, dict(ctx.model.state_dict()))


def own_model(ctx: ClientContext) -> dict[str, torch.Tensor] | None:
    """The client's own model, or None before its first kept update (or without a state store)."""
    return ctx.state.load(OWN) if ctx.state is not None else None


def reinitialise(model: nn.Module, seed: int, rnd: int, client: int) -> None:
    """theta_0 of a client without an own model: every module's ``reset_parameters`` (PyTorch's default
    initialisation of each layer) under torch's generator seeded from (seed, "reinitiate", round, client)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "reinitiate", rnd, client))
        for m in model.modules():
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()


def refuse(ctx: ClientContext, fallback: str, message: str, **info: Any) -> None:
    """Apply ``fallback`` to a refused received model (module docstring): raise ``ModelRefused`` (keep_own), or
    load the client's own model (re-initialised without one) into ``ctx.model`` and mark the client as refusing
    (reinitiate); the components after it then see a refused round (``refused``)."""
    if fallback == "keep_own":
        raise ModelRefused(message, fallback="keep_own", **info)
    own = own_model(ctx)
    with torch.no_grad():
        if own is None:
            reinitialise(ctx.model, ctx.seed, ctx.round, ctx.client_id)
        else:
            ctx.model.load_state_dict(own)
    ctx.scratch[REFUSED] = {"message": message, "from": "own" if own is not None else "init", **info}


def refused(ctx: ClientContext) -> bool:
    """Whether a component before has refused the received model this round (and re-initiated)."""
    return REFUSED in ctx.scratch


class PerfTestParams(Params):
    metric: Literal["psnr", "loss"] = Field("psnr", description="psnr: mean per-image PSNR (dB, RGB) of the outputs "
                                            "against the targets (image tasks); loss: the task loss (any task)")
    tolerance: float = Field(0.5, ge=0, description="accept when score(received) >= score(own) - tolerance (dB for "
                             "psnr, loss units for loss)")
    examples: int = Field(16, ge=1, description="training examples of the client tested (a fresh sample each round)")
    batch_size: int = Field(16, ge=1, description="examples per forward of the test")
    from_round: int = Field(2, ge=1, description="first round whose received model is tested")
    fallback: Fallback = Field("keep_own", description="after a failed test: keep_own (train nothing) or "
                               "reinitiate (train from the own model)")


class PerfTest(Component):
    """The performance test of the received model against the client's own (see the module docstring)."""

    name = "perf_test"
    refuses_models = True

    def __init__(self, params: PerfTestParams | None = None):
        self.p = params or PerfTestParams()

    @torch.no_grad()
    def scores(self, ctx: ClientContext, own: dict[str, torch.Tensor]) -> tuple[float, float]:
        """(score of the model in ``ctx.model``, score of ``own``) on this round's sample; ``ctx.model`` holds the
        received model again on return."""
        n = ctx.task.num_train_examples(ctx.client_id)
        gen = torch_gen(ctx.seed, "perf_test", ctx.round, ctx.client_id)
        positions = torch.randperm(n, generator=gen)[: self.p.examples]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(ctx.seed, "perf_test-crop", ctx.round, ctx.client_id))
            batches = [ctx.batch(positions[i:i + self.p.batch_size])
                       for i in range(0, len(positions), self.p.batch_size)]
        model = ctx.model
        received = {k: v.detach().clone() for k, v in model.state_dict().items()}
        was_training = model.training
        model.eval()
        try:
            s_received = self._score(ctx, batches)
            model.load_state_dict(own)
            s_own = self._score(ctx, batches)
        finally:
            model.load_state_dict(received)
            model.train(was_training)
        if ctx.cost is not None:
            ctx.flops += 2 * len(positions) * ctx.cost.forward
        return s_received, s_own

    def _score(self, ctx: ClientContext, batches: list[tuple[Any, Any]]) -> float:
        """The mean per-image PSNR (every frame of a clip an image) or the example-weighted mean loss, negated."""
        total, count = 0.0, 0
        for x, y in batches:
            out = ctx.task.predict(ctx.model, x)
            if self.p.metric == "loss":
                b = int(y.shape[0]) if isinstance(y, torch.Tensor) else len(x)
                total, count = total + float(ctx.task.loss(out, y)) * b, count + b
                continue
            if not (isinstance(out, torch.Tensor) and isinstance(y, torch.Tensor) and out.shape == y.shape
                    and out.dim() >= 3 and out.shape[-3] == 3):
                raise ConfigError("perf_test: metric = \"psnr\" needs RGB image outputs the shape of the targets "
                                  "(an image task); use metric = \"loss\"")
            values = psnr(out.clamp(0, 1), y, 0, "rgb")
            total, count = total + float(values.sum()), count + values.numel()
        mean = total / max(count, 1)
        return -mean if self.p.metric == "loss" else mean

    def client_start(self, ctx: ClientContext) -> None:
        own = own_model(ctx)
        if refused(ctx) or own is None or ctx.round < self.p.from_round:
            return
        s_received, s_own = self.scores(ctx, own)
        ctx.scratch[self.name] = (s_received, s_own)
        if not s_received >= s_own - self.p.tolerance:
            unit = "dB" if self.p.metric == "psnr" else "(negative loss)"
            refuse(ctx, self.p.fallback,
                   f"performance test failed: {self.p.metric} {s_received:.4g} of the received model < "
                   f"{s_own:.4g} of the own model - tolerance {self.p.tolerance:g} {unit}",
                   received=s_received, own=s_own, tolerance=self.p.tolerance)

    def client_end(self, ctx: ClientContext, result: ClientResult) -> None:
        keep_own_model(ctx)
        tested = ctx.scratch.get(self.name)
        if tested is not None:
            result.metrics["perf/received"], result.metrics["perf/own"] = tested
        result.metrics[REFUSED] = 1.0 if refused(ctx) else 0.0

    def server_round_end(self, sctx: ServerContext, results: list[ClientResult], weights: torch.Tensor) -> None:
        for key in ("perf/received", "perf/own"):
            vals = [float(r.metrics[key]) for r in results if key in r.metrics]
            if vals:
                sctx.metrics[key] = sum(vals) / len(vals)


#: the tasks whose outputs are RGB images the shape of their targets (``metric = "psnr"``)
IMAGE_TASKS = ("image_sr", "video_sr")


def _check_perf_test(spec: PerfTestParams, cfg: Any) -> str | None:
    """PSNR needs an image task: refused when the run is configured, not in round ``from_round``."""
    task = getattr(getattr(cfg, "task", None), "name", None)
    if spec.metric == "psnr" and task is not None and task not in IMAGE_TASKS:
        return (f"'perf_test' with metric = \"psnr\" needs an image task ({', '.join(IMAGE_TASKS)}), not task {task!r}; "
                "use metric = \"loss\"")
    return None


@COMPONENTS.register(
    "perf_test", params=PerfTestParams, check=_check_perf_test,
    help="PPFL-RDSN: test the received model against the client's own on its own images; keep own or reinitiate",
    metrics=(MetricSpec("perf/received", None, "test score of the received model (client mean; dB or -loss)"),
             MetricSpec("perf/own", None, "test score of the clients' own models (client mean)")),
)
def _perf_test(params: PerfTestParams) -> PerfTest:
    return PerfTest(params)
