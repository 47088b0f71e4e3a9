"""Byzantine-robust aggregators and an adversarial-client component for robustness experiments.

Aggregators (``[recipe] aggregator = {name = "median"}``), all on the clients' ``delta`` dicts:

- ``median``: coordinate-wise median (Yin et al. 2018, Definition 1, Algorithm 1 Option I);
- ``trimmed_mean``: coordinate-wise beta-trimmed mean (Yin et al. 2018, Definition 2, Option II);
- ``krum``: Krum / Multi-Krum (Blanchard et al. 2017, Section 4).

Shared buffers (BatchNorm running statistics, uploaded as values) go through the same rule
(``Aggregator.aggregate_buffers``): the coordinate-wise median or trimmed mean of the clients' statistics, or the
statistics of the clients Krum selected, so they cannot bypass it.

The math lives in ``fedsight.functional.robust``. Median and trimmed mean are unweighted as in the
paper: the client weights (data size, ...) are ignored, because weighting by a self-reported quantity
would hand an attacker the aggregate. Krum's selection is unweighted too; Multi-Krum may average the
selected updates with the given client weights (``weighted = true``).

Component (``[recipe] components = [{name = "attack", fraction = 0.2, kind = "flip"}]``):

- ``attack``: a fixed, seed-determined set of malicious clients replaces its upload (scaled, sign
  flipped, or Gaussian noise). It exists to measure robustness, not as a training method.
- ``norm_bound``: the server clips every accepted update to an L2 norm bound before weighting and
  aggregation (Sun et al. 2019, "Can you really backdoor federated learning?", Sec. 3: norm thresholding),
  fixed or a quantile of the round's norms; composes with every aggregator.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

import torch
from pydantic import Field, model_validator

from ..functional.aggregate import weighted_mean_state
from ..functional.robust import check_krum, coordinate_median, krum_select, trim_count, trimmed_mean
from ..records import ClientResult
from ..metrics import MetricSpec
from ..registry import AGGREGATORS, COMPONENTS, NoParams, Params
from ..rng import np_rng, torch_gen
from .aggregators import Aggregator, TooFewUpdates
from ..training import ClientContext, Component, ServerContext


def _keys(results: list[ClientResult]) -> list[str]:
    if not results:
        raise ValueError("no client results to aggregate")
    keys = list(results[0].delta.keys())
    for r in results[1:]:
        if set(r.delta.keys()) != set(keys):
            raise ValueError(f"client {r.client_id} uploads different tensors than client {results[0].client_id}")
    return keys


def _per_key(results: list[ClientResult], fn, part: str = "delta") -> dict[str, torch.Tensor]:
    """Apply a [K, D] -> [D] reduction to every delta entry separately (coordinate-wise rules); ``part =
    "buffers"``: to every shared buffer (BatchNorm statistics, integer counters included) instead."""
    if part == "buffers":
        keys = list(results[0].buffers)
        get = lambda r, k: r.buffers[k]  # noqa: E731
    else:
        keys = _keys(results)
        get = lambda r, k: r.delta[k]  # noqa: E731
    out = {}
    for k in keys:
        ref = get(results[0], k)
        stacked = torch.stack([get(r, k).reshape(-1) for r in results])
        out[k] = fn(stacked).reshape(ref.shape)
    return out


class MedianAggregator(Aggregator):
    """Coordinate-wise median of the client deltas (Yin et al. 2018, Definition 1).

    Weights are ignored. With an even number of clients the median of a coordinate is the mean of
    its two middle values (numpy's convention)."""

    name = "median"

    def aggregate(self, results: list[ClientResult], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        return _per_key(results, coordinate_median)

    def aggregate_buffers(self, results: list[ClientResult], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """The coordinate-wise median of the shared buffers too (BatchNorm statistics bypass no rule)."""
        return _per_key(results, coordinate_median, "buffers")


class TrimmedMeanAggregator(Aggregator):
    """Coordinate-wise beta-trimmed mean of the client deltas (Yin et al. 2018, Definition 2).

    For each coordinate, ``floor(trim * K)`` largest and as many smallest values are dropped and the
    rest averaged without weights (weights are ignored)."""

    name = "trimmed_mean"

    def __init__(self, trim: float = 0.1):
        trim_count(1, trim)  # validates the range
        self.trim = trim

    def aggregate(self, results: list[ClientResult], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        return _per_key(results, lambda x: trimmed_mean(x, self.trim))

    def aggregate_buffers(self, results: list[ClientResult], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """The coordinate-wise trimmed mean of the shared buffers too (BatchNorm statistics bypass no rule)."""
        return _per_key(results, lambda x: trimmed_mean(x, self.trim), "buffers")


class KrumAggregator(Aggregator):
    """Krum / Multi-Krum (Blanchard et al. 2017, Section 4) over the whole flattened delta.

    Each client's score is the sum of squared L2 distances from its delta (all shared tensors
    concatenated) to its ``K - f - 2`` nearest other deltas. Krum (``multi = 1``) returns the delta
    with the lowest score; Multi-Krum (``multi = m``) averages the ``m`` lowest-scored deltas, uniformly
    as in the paper, or with the round's client weights when ``weighted``. Requires ``K > 2f + 2``.
    After each call ``last_selected`` holds the selected client ids, best score first.
    """

    name = "krum"

    def __init__(self, byzantine: int = 1, multi: int = 1, weighted: bool = False, too_few: str = "skip"):
        self.byzantine, self.multi, self.weighted, self.too_few = byzantine, multi, weighted, too_few
        self.last_selected: list[int] = []
        self._selected: list[int] = []  # (indices into the last ``aggregate``'s results)

    def aggregate(self, results: list[ClientResult], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        keys = _keys(results)
        k = len(results)
        f, m = self.byzantine, self.multi
        self.degraded = None
        if self.too_few == "degrade" and k >= 3 and (k <= 2 * f + 2 or m > k):
            f, m = min(f, (k - 3) // 2), min(m, k)  # the largest f with K > 2f + 2
            self.degraded = f"krum: {k} updates; byzantine {self.byzantine} -> {f}, multi {self.multi} -> {m}"
        try:
            check_krum(k, f)
        except ValueError as exc:
            raise TooFewUpdates(str(exc)) from None
        if m > k:
            raise TooFewUpdates(f"krum: multi = {m} exceeds the K = {k} client updates of this round")
        flat = torch.stack(
            [torch.cat([r.delta[key].reshape(-1).to(torch.float64) for key in keys]) for r in results]
        )
        sel = krum_select(flat, f, m)
        self.last_selected = [results[i].client_id for i in sel]
        self._selected = sel
        chosen = [results[i].delta for i in sel]
        if len(sel) == 1:
            return {key: v.clone() for key, v in chosen[0].items()}
        if not self.weighted:
            return weighted_mean_state(chosen, torch.ones(len(sel), dtype=torch.float64))
        if isinstance(weights, Mapping):  # per-tensor weights (FedVG layer/block granularity)
            return weighted_mean_state(chosen, {key: torch.as_tensor(w, dtype=torch.float64)[sel] for key, w in weights.items()})
        return weighted_mean_state(chosen, torch.as_tensor(weights, dtype=torch.float64)[sel])

    def aggregate_buffers(self, results: list[ClientResult], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """The shared buffers (BatchNorm statistics) of the clients ``aggregate`` just selected, combined as their
        deltas were: an unselected client's statistics count nowhere."""
        sel = self._selected
        chosen = [results[i].buffers for i in sel]
        if len(sel) == 1:
            return {key: v.clone() for key, v in chosen[0].items()}
        if not self.weighted or isinstance(weights, Mapping):  # (per-tensor weights name no buffer)
            return weighted_mean_state(chosen, torch.ones(len(sel), dtype=torch.float64))
        return weighted_mean_state(chosen, torch.as_tensor(weights, dtype=torch.float64)[sel])


class TrimmedMeanParams(Params):
    trim: float = Field(0.1, ge=0.0, lt=0.5, description="fraction dropped at each end per coordinate (floor(trim*K) values)")


class KrumParams(Params):
    byzantine: int = Field(1, ge=0, description="f, the number of Byzantine clients tolerated (needs K > 2f + 2)")
    multi: int = Field(1, ge=1, description="m: 1 = Krum, m > 1 = Multi-Krum averaging the m best-scored updates")
    weighted: bool = Field(False, description="Multi-Krum: average the selected updates with the client weights")
    too_few: Literal["skip", "degrade"] = Field(
        "skip", description="a round with K <= 2f + 2 updates (dropout, rejected updates): 'skip' its aggregation, "
        "or 'degrade' to the largest f with K > 2f + 2 (and multi <= K), with an event; below 3 updates it is skipped")


@AGGREGATORS.register("median", params=NoParams, help="coordinate-wise median of client deltas (Yin et al. 2018)")
def _median(params: NoParams) -> MedianAggregator:
    return MedianAggregator()


@AGGREGATORS.register("trimmed_mean", params=TrimmedMeanParams, help="coordinate-wise trimmed mean (Yin et al. 2018)")
def _trimmed_mean(params: TrimmedMeanParams) -> TrimmedMeanAggregator:
    return TrimmedMeanAggregator(params.trim)


def _krum_check(spec: KrumParams, cfg: Any) -> str | None:
    """Krum against the clients a round samples: with ``K <= 2f + 2`` (or ``multi > K``) every round would be
    skipped (``too_few = "skip"``), so such a config is refused before it starts (rounds that lose clients to dropout or rejection
    are still skipped one by one, with an event)."""
    from ..engine.plan import clients_per_round

    s = cfg.server
    k = clients_per_round(cfg.partition.num_clients, s.clients_per_round, s.fraction)
    key = "server.clients_per_round" if s.clients_per_round is not None else (
        "server.fraction" if s.fraction is not None else "partition.num_clients")
    if spec.too_few == "degrade" and k >= 3:  # every short round runs with a smaller f, as asked
        return None
    if k <= 2 * spec.byzantine + 2:
        return (f"byzantine = {spec.byzantine} needs more than 2 * byzantine + 2 = {2 * spec.byzantine + 2} updates a "
                f"round, but {key} gives {k}")
    if spec.multi > k:
        return f"multi = {spec.multi} exceeds the {k} updates a round ({key})"
    return None


@AGGREGATORS.register("krum", params=KrumParams, help="Krum / Multi-Krum selection (Blanchard et al. 2017)",
                      check=_krum_check)
def _krum(params: KrumParams) -> KrumAggregator:
    return KrumAggregator(params.byzantine, params.multi, params.weighted, params.too_few)


# -- adversarial clients ----------------------------------------------------------------------------


def num_malicious(fraction: float, num_clients: int) -> int:
    """``round(fraction * num_clients)`` with halves rounded up."""
    return min(num_clients, int(math.floor(fraction * num_clients + 0.5)))


def malicious_clients(seed: int, fraction: float, num_clients: int) -> list[int]:
    """The run's malicious clients: ``num_malicious`` distinct ids drawn once from the stream
    ``("attackers",)`` of the run seed, so the set is the same every round and in every rerun."""
    m = num_malicious(fraction, num_clients)
    ids = np_rng(seed, "attackers").choice(num_clients, size=m, replace=False)
    return sorted(int(i) for i in ids)


class AttackParams(Params):
    fraction: float = Field(0.2, ge=0.0, le=1.0, description="share of all clients that are malicious")
    kind: Literal["scale", "flip", "gaussian"] = Field(
        "flip", description="scale: scale*delta; flip: -scale*delta; gaussian: N(0, scale^2) noise"
    )
    scale: float = Field(10.0, gt=0.0, allow_inf_nan=False, description="attack magnitude")
    num_clients: int | None = Field(
        None, ge=1, description="total clients (default: sent by the server each round)"
    )


class Attack(Component):
    """Malicious clients that replace their upload, for robustness experiments.

    ``round(fraction * N)`` of all N clients are malicious, chosen once from the run seed's
    ``("attackers",)`` stream. When sampled, a malicious client uploads ``scale * delta`` (kind
    ``scale``), ``-scale * delta`` (``flip``, a sign-flipping attack) or ``N(0, scale^2)`` noise of
    the delta's shapes (``gaussian``, from the stream ``("attack", round, client)``). Every result gets
    the metric ``attack/malicious`` (1.0 or 0.0). N is the ``num_clients`` parameter or, when unset,
    the server's count sent each round as the broadcast ``{"num_clients": tensor}``.
    """

    name = "attack"

    def __init__(self, params: AttackParams):
        self.p = params
        self._cache: tuple[tuple[int, int], frozenset[int]] | None = None

    def server_broadcast(self, sctx: ServerContext) -> dict[str, torch.Tensor] | None:
        if self.p.num_clients is not None:
            return None
        return {"num_clients": torch.tensor(sctx.num_clients, dtype=torch.int64)}

    def _num_clients(self, ctx: ClientContext) -> int:
        if self.p.num_clients is not None:
            return self.p.num_clients
        sent = ctx.broadcast.get(self.name, {})
        if "num_clients" not in sent:
            raise RuntimeError("attack: num_clients is unset and the server broadcast did not carry it")
        return int(sent["num_clients"])

    def malicious(self, seed: int, num_clients: int) -> frozenset[int]:
        key = (seed, num_clients)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, frozenset(malicious_clients(seed, self.p.fraction, num_clients)))
        return self._cache[1]

    @torch.no_grad()
    def client_end(self, ctx: ClientContext, result: ClientResult) -> None:
        bad = ctx.client_id in self.malicious(ctx.seed, self._num_clients(ctx))
        result.metrics["attack/malicious"] = 1.0 if bad else 0.0
        if not bad:
            return
        s = self.p.scale
        if self.p.kind == "scale":
            result.delta = {k: v * s for k, v in result.delta.items()}
        elif self.p.kind == "flip":
            result.delta = {k: v * -s for k, v in result.delta.items()}
        else:
            g = torch_gen(ctx.seed, "attack", ctx.round, ctx.client_id)
            result.delta = {
                k: (torch.randn(v.shape, generator=g, dtype=torch.float64) * s).to(device=v.device, dtype=v.dtype)
                for k, v in result.delta.items()
            }


def _attack_check(spec: AttackParams, cfg: Any) -> str | None:
    """``num_clients`` is the federation's client count N that ``fraction`` is a share of: more than
    ``partition.num_clients`` would choose malicious ids no client has (fewer attackers than asked, silently)."""
    n = cfg.partition.num_clients
    if spec.num_clients is not None and spec.num_clients > n:
        return (f"num_clients = {spec.num_clients} exceeds partition.num_clients = {n} (the federation's clients); "
                f"set it to {n} or leave it unset (the server sends the count)")
    return None


@COMPONENTS.register("attack", params=AttackParams, check=_attack_check,
                     help="malicious clients (scale / sign-flip / Gaussian) for robustness tests")
def _attack(params: AttackParams) -> Attack:
    return Attack(params)


class NormBoundParams(Params):
    bound: float | None = Field(None, gt=0, allow_inf_nan=False, description="fixed L2 bound M of an update")
    quantile: float | None = Field(None, gt=0, le=1, description="or: M is this quantile of the round's update "
                                   "norms (linear interpolation), e.g. 0.5 clips every update above the median")
    buffer_bound: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="fixed L2 bound of a client's change of the shared floating-point "
        "buffers (BatchNorm running statistics); default: the round's quantile (the median with a fixed bound) of "
        "those changes' norms")

    @model_validator(mode="after")
    def _one(self) -> "NormBoundParams":
        if (self.bound is None) == (self.quantile is None):
            raise ValueError("norm_bound needs exactly one of bound or quantile")
        return self


class NormBound(Component):
    """Norm thresholding (Sun et al. 2019, Sec. 3): every accepted update Delta_k becomes
    ``Delta_k * min(1, M / ||Delta_k||_2)``, the norm over all its shared trainable entries, before the
    weighting and the aggregator see it. Shared floating-point buffers (BatchNorm running statistics, which a
    client uploads as values, not changes) are bounded the same way, separately, as their change from the global
    values: ``g + (b_k - g) * min(1, M_b / ||b_k - g||_2)``, with ``M_b`` = ``buffer_bound`` or the round's quantile
    of those norms (``quantile``, else the median: an update's bound says nothing about the statistics' scale);
    integer counters and extras are left alone. Each clipped update is an ``update_clipped`` event (client, norm,
    bound); the round's bounds and numbers clipped are metrics."""

    name = "norm_bound"

    def __init__(self, params: NormBoundParams):
        self.params = params

    def secure_aggregation_problem(self, weighting: str) -> str | None:
        return "clips each client's update by its norm, and the server never sees an update"

    def server_results(self, sctx: ServerContext, results: list[ClientResult]) -> list[ClientResult]:
        norms = [math.sqrt(sum(float(v.detach().double().pow(2).sum()) for v in r.delta.values())) for r in results]
        p = self.params
        bound = p.bound if p.bound is not None else float(np.quantile(norms, p.quantile))
        out, clipped = [], 0
        for res, n in zip(results, norms):
            if n > bound:
                scale = bound / n
                res = dataclasses.replace(res, delta={k: v * scale for k, v in res.delta.items()})
                sctx.events.append({"event": "update_clipped", "client": res.client_id, "norm": n, "bound": bound})
                clipped += 1
            out.append(res)
        sctx.metrics["norm_bound/bound"] = bound
        sctx.metrics["norm_bound/clipped"] = float(clipped)
        return self._bound_buffers(sctx, out)

    def _bound_buffers(self, sctx: ServerContext, results: list[ClientResult]) -> list[ClientResult]:
        keys = [k for k, v in results[0].buffers.items() if v.is_floating_point()] if results else []
        if not keys:
            return results
        state = sctx.model.state_dict()
        ref = {k: state[k].detach().to(results[0].buffers[k].device) for k in keys}
        norms = [math.sqrt(sum(float((r.buffers[k].double() - ref[k].double()).pow(2).sum()) for k in keys))
                 for r in results]
        p = self.params
        bound = p.buffer_bound if p.buffer_bound is not None else float(np.quantile(norms, p.quantile or 0.5))
        out, clipped = [], 0
        for res, n in zip(results, norms):
            if n > bound:
                scale = bound / n
                buffers = {k: (ref[k] + (v - ref[k]) * scale).to(v.dtype) if k in ref else v
                           for k, v in res.buffers.items()}
                res = dataclasses.replace(res, buffers=buffers)
                clipped += 1
            out.append(res)
        sctx.metrics["norm_bound/buffer_bound"] = bound
        sctx.metrics["norm_bound/buffers_clipped"] = float(clipped)
        return out


@COMPONENTS.register(
    "norm_bound", params=NormBoundParams,
    help="server-side L2 norm bound of every update, fixed or a quantile of the round's norms (Sun et al. 2019)",
    metrics=(MetricSpec("norm_bound/*", None, "the round's bound and number of clipped updates"),),
)
def _norm_bound(params: NormBoundParams) -> NormBound:
    return NormBound(params)
