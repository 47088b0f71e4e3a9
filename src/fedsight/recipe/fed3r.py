"""Closed-form classifiers from client statistics: Fed3R, Fed3R-RF, Fed3R-Sync and FedNCM (thesis
ch. 3, Alg. 3-6).

A stage whose recipe lists ``fed3r`` (or ``fedncm``) trains nothing: every parameter is frozen, each
client passes its training data once through the frozen feature extractor phi (eval mode, no
augmentation: the authors' code) and uploads sufficient statistics; the server accumulates them and
writes the solved classifier into the global model's head after every round, so the classifier is
usable after each round (Fed3R-Sync's property 7) and exact once every client has reported (property 3).

* **Fed3R** (Alg. 3): A_k = Z_k^T Z_k (upper triangle on the wire, p(p+1)/2 numbers) and the class sums
  b_k^c for the client's classes only (eq. 3.26); the server starts from A = lambda I, b = 0 and solves
  W = A^{-1} b (eq. 3.23) by Cholesky in float64, then normalises each class column to unit L2 norm
  (Alg. 3 last line). Bias: the features get an appended constant 1 (eq. 3.9; the authors' code), so
  lambda also regularises the bias row, and the normalisation divides the bias by its column's weight
  norm (ambiguity A3).
* **Fed3R-RF** (Alg. 4): ``rff_dim = D`` puts the random Fourier map of eq. 3.21 between phi and the
  classifier (a ``RandomFourierFeatures`` module inside the model's head, regenerated from the run seed,
  so every client uses the same map and it is never communicated). ``rff_convention = "rbf"`` (default)
  draws omega ~ N(0, sigma^-2 I), the map whose kernel is eq. 3.20's exp(-||x - x'||^2 / (2 sigma^2));
  ``"thesis"`` draws omega ~ N(0, (2/sigma) I) as eq. 3.21 is printed, whose kernel is
  exp(-||x - x'||^2 / sigma), i.e. sigma_thesis = 2 sigma_rbf^2 (ambiguity A2). The thesis uses sigma =
  1000 with MobileNetV2 features; pick sigma on the scale of your feature distances.
* **Fed3R-Sync** (Alg. 5): ``sync = true`` uploads the full d x C class-sum matrix (zeros for absent
  classes): the fixed-shape message secure aggregation needs, at the communication cost of Table 3.2.
  In this simulator, which adds client messages one by one, the result is the same as a group sum's (up to
  float64 rounding). Under Flower's SecAgg+ (``fedsight.flower.secagg``) every variant here, Fed3R, Fed3R-RF,
  Fed3R-Sync and FedNCM, uploads this all-classes form inside the masked sum (``secure_fields``), and the server
  checks and absorbs only the group's sum (``secure_sum``).
* **FedNCM** (the thesis names it only, A14): per-class feature sums and counts; the classifier is the
  nearest class mean (Euclidean, as a linear layer) or, with ``normalize = true``, unit-norm class means.

What the server accepts (``extras_spec``; ``fedsight.engine.contract``): exactly the fields above, float64
(classes int64), ``A`` of p(p+1)/2 entries, ``b`` [k, p] and ``counts`` [k] for the k classes the client lists
(1 <= k <= C, all C under Sync), classes distinct, sorted and in range, whole counts summing to the client's
examples (its bias statistics equal to them), no value above 1e150 in magnitude, and A_k positive semi-definite
within lambda / (2K): nothing a client sends can make the server's solve fail (up to float64 rounding of the
sums). A client can still send statistics of that form that skew the classifier.

Client order: a stage with ``fed3r`` visits each client exactly once, in a random order drawn from the
run seed, ``clients_per_round`` at a time (groups of kappa for Fed3R-Sync, A17); a rejected update
(non-finite statistics) puts the client back in the queue. ``ceil(K / kappa)`` rounds visit everyone;
later rounds of the stage have no client left and are logged as skipped. ``sampling = "replacement"`` is the
thesis's other protocol (Sec. 3.9.5, Fig. 3.9): each round samples kappa of all K clients as FedAvg does, and
those already reported send nothing (a round of only those is skipped), so covering everyone takes a batch
coupon collector's number of rounds (Table 3.6); the classifier, once everyone has reported, is the same. Client weights play no role:
statistics are summed, never averaged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
from pydantic import Field
from torch import nn

from ..training.local import Trainer
from ..functional.ridge import (
    RandomFourierFeatures,
    RidgeAccumulator,
    augment,
    client_statistics,
    ncm_classifier,
    normalize_columns,
    pack_upper,
    unpack_upper,
)
from ..metrics import MetricSpec
from ..records import ClientResult
from ..registry import COMPONENTS, Params
from ..rng import derive_seed, np_rng
from ..training import ClientContext, Component, ExtrasSpec, ServerContext, UploadContext


def pow2_at_least(x: float) -> float:
    """The smallest power of two at or above ``x`` (> 0): a scale that divides a float exactly."""
    return float(2.0 ** math.ceil(math.log2(x)))


#: the largest statistic the server accepts: far above any real one, small enough that the sums of K clients'
#: statistics and the products of the server's solve stay finite in float64
STAT_MAX = 1e150


class RFFHead(nn.Module):
    """A classifier on random Fourier features: ``linear(rff(z))`` (Fed3R-RF's psi)."""

    def __init__(self, rff: RandomFourierFeatures, linear: nn.Linear):
        super().__init__()
        self.rff, self.linear = rff, linear

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.linear(self.rff(z))


def head_linear(model: nn.Module) -> nn.Linear:
    head = getattr(model, "head", None)
    if isinstance(head, RFFHead):
        return head.linear
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"fed3r/fedncm need a model with a linear classifier `head` and `features()`; {type(model).__name__} has none"
        )
    return head


@torch.no_grad()
def client_features(ctx: ClientContext, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The classifier's inputs for all of a client's training data (RFF-lifted if the head has a map),
    with the model in eval mode, and the labels."""
    model = ctx.model
    was = model.training
    model.eval()
    zs, ys = [], []
    n = ctx.num_examples
    for s in range(0, n, batch_size):
        x, y = ctx.batch(torch.arange(s, min(n, s + batch_size)))
        z = model.features(x)
        if isinstance(model.head, RFFHead):
            z = model.head.rff(z)
        zs.append(z)
        ys.append(y)
    model.train(was)
    return torch.cat(zs), torch.cat(ys)


class StatisticsTrainer(Trainer):
    """A client's Fed3R / FedNCM round: one pass through the frozen extractor, statistics in
    ``result.extras[component]``, no delta, nothing downloaded (phi is the public pre-trained model)."""

    trains = False
    downloads_model = False

    def __init__(self, component: "ClosedFormClassifier"):
        self.component = component
        self.name = component.name

    def train(self, ctx: ClientContext, components: Sequence[Component]) -> ClientResult:
        z, y = client_features(ctx, max(ctx.local.batch_size, 256))
        stats = self.component.statistics(z, y, ctx.task.num_classes)
        result = ClientResult(client_id=ctx.client_id, num_examples=ctx.num_examples, delta={}, num_steps=0)
        result.extras[self.component.name] = stats
        if ctx.cost is not None:
            ctx.flops += self.component.flops(ctx, z.shape[1])
        result.flops = ctx.flops
        return result


class ClosedFormClassifier(Component):
    """Shared machinery: the once-per-client queue, the trainer claim, writing the head."""

    name = "closed_form"
    uploads_extras = True  # the ridge statistics (its trainer's upload)

    def __init__(self) -> None:
        self.visited: np.ndarray | None = None

    def trainer(self) -> Trainer:
        return StatisticsTrainer(self)

    def _visited(self, num_clients: int) -> np.ndarray:
        if self.visited is None:
            self.visited = np.zeros(num_clients, dtype=bool)
        return self.visited

    def sample(self, round: int, num_clients: int, m: int, seed: int) -> list[int]:
        """``sampling = "once"``: the next ``m`` clients of a seeded permutation that have not reported (Alg. 5:
        everyone in ceil(K / m) rounds). ``"replacement"``: the ``m`` clients FedAvg would sample this round
        (``engine.plan.sample_clients``), of whom only those that have not reported yet send statistics (the
        thesis's sampling with replacement, Fig. 3.9 and Table 3.6: a batch coupon collector, so reaching every
        client takes many more rounds)."""
        visited = self._visited(num_clients)
        if getattr(self.p, "sampling", "once") == "replacement":
            from ..engine.plan import sample_clients

            return [c for c in sample_clients(seed, round, num_clients, m) if not visited[c]]
        order = np_rng(seed, f"{self.name}-order").permutation(num_clients)
        return sorted(int(c) for c in order[~visited[order]][:m])

    def statistics(self, z: torch.Tensor, y: torch.Tensor, num_classes: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    # -- what a client uploads (the reply contract) ---------------------------------------------------

    #: whether every client sends all C classes (Fed3R-Sync), else only its own (a size the server cannot know)
    fixed_classes: bool = False

    def stat_dim(self, linear: nn.Linear) -> int:
        """The statistics' feature dimension q for the head ``linear`` (Fed3R appends the bias feature)."""
        return linear.in_features

    def extras_spec(self, ctx: UploadContext) -> ExtrasSpec:
        """The statistics of ``statistics`` (``functional.ridge.client_statistics``): ``classes`` int64 [k],
        ``b`` float64 [k, q], ``counts`` float64 [k] (and Fed3R's ``A``), where q is the head's input size
        (plus the bias feature) and k the number of classes the client holds, 1..C, which the server does not
        know (exactly C under Fed3R-Sync). Their values must be consistent (``check_statistics``)."""
        linear = head_linear(ctx.model)
        C = self.classes_of(ctx.model, ctx.task)
        q = self.stat_dim(linear)
        if ctx.secure_sum:  # a share of a secure sum (fedsight.flower.secagg): all C classes, checked as a sum there
            tensors = {"classes": ((C,), torch.int64), "b": ((C, q), torch.float64), "counts": ((C,), torch.float64),
                       **self.more_statistics(q)}
            return ExtrasSpec(tensors, check=lambda group, result: self.check_share(group, C))
        k: int | str = C if self.fixed_classes else "k"
        tensors = {"classes": ((k,), torch.int64), "b": ((k, q), torch.float64), "counts": ((k,), torch.float64)}
        tensors.update(self.more_statistics(q))
        return ExtrasSpec(tensors, sizes={"k": (1, C)},
                          check=lambda group, result: self.check_statistics(group, result, C, q, ctx.num_clients))

    def more_statistics(self, q: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {}

    def classes_of(self, model: nn.Module, task) -> int:
        """C: the task's number of classes (else the head's outputs)."""
        return int(getattr(task, "num_classes", None) or head_linear(model).out_features)

    # -- under secure aggregation (fedsight.flower.secagg): the statistics as a sum --------------------

    def secure_aggregation_problem(self, weighting: str) -> str | None:
        return None  # the statistics are sums: SecAgg+ carries them (secure_fields, secure_sum)

    def input_bound(self, model: nn.Module, feature_bound: float) -> float:
        """The largest magnitude of an entry of the classifier's input: an RFF head's ``sqrt(2 / D)`` (its
        features are ``sqrt(2 / D) cos(.)``), else ``feature_bound`` (no FedSight extractor bounds its features: the
        CNN's end in a ReLU, the others in average pooling)."""
        head = getattr(model, "head", None)
        return math.sqrt(2.0 / head.rff.out_dim) if isinstance(head, RFFHead) else float(feature_bound)

    def secure_fields(self, model: nn.Module, num_classes: int, max_examples: int,
                      feature_bound: float) -> list[tuple[str, tuple[int, ...], float]]:
        """(name, shape, bound) of each statistic a client adds to a secure sum, in the all-classes form
        (``functional.ridge.dense_statistics``). ``bound`` is a power of two at or above every entry of an honest
        client with at most ``max_examples`` examples whose classifier inputs are at most ``r = input_bound`` in
        magnitude: ``|b_ci| <= n r``, ``counts <= n`` (Fed3R adds ``|A_ij| <= n r^2``)."""
        q = self.stat_dim(head_linear(model))
        n, r = float(max(1, max_examples)), self.input_bound(model, feature_bound)
        return [("b", (num_classes, q), pow2_at_least(n * r)), ("counts", (num_classes,), pow2_at_least(n)),
                *self.more_fields(q, n, r)]

    def more_fields(self, q: int, n: float, r: float) -> list[tuple[str, tuple[int, ...], float]]:
        return []

    def check_share(self, stats, num_classes: int) -> str | None:
        """A reply's share of a secure sum: all classes, every value within ``STAT_MAX`` (the sum itself was
        checked, ``secure_sum``)."""
        if not torch.equal(stats["classes"].cpu(), torch.arange(num_classes)):
            return "classes are not 0..C-1 (a share of a secure sum holds all classes)"
        big = sorted(k for k, t in stats.items() if t.is_floating_point() and bool((t.abs() > STAT_MAX).any()))
        return f"{', '.join(big)} exceed {STAT_MAX:g} in magnitude" if big else None

    def secure_sum(self, sums: dict[str, torch.Tensor], num_examples: int, num_summed: int, num_clients: int,
                   errors: dict[str, float]) -> tuple[str | None, dict[str, torch.Tensor]]:
        """(why no ``num_summed`` honest clients with ``num_examples`` examples in all can have the secure sum
        ``sums`` (float64, all classes, each entry within ``errors[name]`` of the clients' true sum), or None; the
        group's statistics). The counts must be whole numbers (within their error, which is far below 1/2) that
        are non-negative and sum to ``num_examples``; they are set to those whole numbers."""
        counts = sums["counts"]
        whole = counts.round()
        if bool(((counts - whole).abs() > errors["counts"]).any()) or bool((whole < 0).any()) \
                or float(whole.sum()) != num_examples:
            return (f"the summed counts are not whole numbers of examples summing to the {num_examples} examples of "
                    f"its {num_summed} clients"), {}
        return None, {"classes": torch.arange(counts.numel()), "b": sums["b"].clone(), "counts": whole}

    def check_statistics(self, stats, result: ClientResult, num_classes: int, q: int, num_clients: int) -> str | None:
        """Why ``stats`` cannot be one client's statistics (the server would crash on them or could not tell them
        from an honest client's), or None: classes sorted, distinct and in range (all of them under Sync),
        counts whole and non-negative (positive for a listed class) summing to the client's examples, every
        value small enough (``STAT_MAX``) that the server's sums and products stay finite."""
        classes, counts = stats["classes"], stats["counts"]
        if self.fixed_classes:
            if not torch.equal(classes.cpu(), torch.arange(num_classes)):
                return "classes are not 0..C-1 (every Sync client sends all classes)"
        elif int(classes[0]) < 0 or int(classes[-1]) >= num_classes or bool((classes[1:] <= classes[:-1]).any()):
            return f"classes are not distinct sorted classes in [0, {num_classes})"
        if bool((counts != counts.round()).any()) or bool((counts < (0 if self.fixed_classes else 1)).any()):
            return "counts are not whole numbers of examples" + ("" if self.fixed_classes else " (>= 1 per listed class)")
        if float(counts.sum()) != result.num_examples:
            return f"counts sum to {float(counts.sum()):g}, the client has {result.num_examples} examples"
        big = sorted(k for k, t in stats.items() if t.is_floating_point() and bool((t.abs() > STAT_MAX).any()))
        if big:
            return f"{', '.join(big)} exceed {STAT_MAX:g} in magnitude"
        return None

    def flops(self, ctx: ClientContext, p: int) -> float:
        raise NotImplementedError

    def server_round_end(self, sctx: ServerContext, results, weights) -> None:
        self._visited(sctx.num_clients)
        linear = head_linear(sctx.model)
        for res in results:
            self.absorb(res.extras[self.name], linear)
            self.visited[res.client_id] = True
        if results:
            self.write_head(linear)
        sctx.metrics[f"{self.name}/clients_reported"] = float(self.visited.sum())

    def absorb(self, stats: dict[str, torch.Tensor], linear: nn.Linear) -> None:
        """Add one client's statistics (``linear`` is the head they are for)."""
        raise NotImplementedError

    def write_head(self, linear: nn.Linear) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"visited": torch.from_numpy(self.visited.astype(np.uint8)) if self.visited is not None else torch.zeros(0)}

    def load_state_dict(self, state: dict) -> None:
        v = state.get("visited")
        self.visited = v.cpu().numpy().astype(bool) if v is not None and v.numel() else None


class Fed3RParams(Params):
    lam: float = Field(0.01, gt=0, description="ridge lambda (A_0 = lambda I; thesis: 0.01)")
    normalize: bool = Field(True, description="unit L2 norm per class column after each solve (Alg. 3)")
    bias: bool = Field(True, description="append a constant feature so the classifier has a bias (eq. 3.9)")
    sync: bool = Field(False, description="Fed3R-Sync: upload the full d x C class sums (fixed shape, for SecAgg)")
    sampling: Literal["once", "replacement"] = Field(
        "once", description="once: each client exactly once, clients_per_round a round (Alg. 5); replacement: the "
        "round's usual sample, only clients not yet reported send (Fig. 3.9, Table 3.6)")
    rff_dim: int | None = Field(None, ge=1, description="Fed3R-RF: number D of random Fourier features (none: linear)")
    rff_sigma: float = Field(1000.0, gt=0, description="Fed3R-RF kernel width sigma (thesis: 1000)")
    rff_convention: Literal["rbf", "thesis"] = Field(
        "rbf", description="rbf: omega ~ N(0, 1/sigma^2), kernel exp(-d^2/(2 sigma^2)); thesis: omega ~ N(0, 2/sigma) as eq. 3.21 is printed"
    )


class Fed3R(ClosedFormClassifier):
    name = "fed3r"

    def __init__(self, params: Fed3RParams | None = None):
        super().__init__()
        self.p = params or Fed3RParams()
        self.acc: RidgeAccumulator | None = None

    def adapt_model(self, model: nn.Module, seed: int) -> None:
        linear = head_linear(model)  # a model without a linear head fails here, before any round
        if self.p.rff_dim is None:
            return
        rff = RandomFourierFeatures(
            linear.in_features, self.p.rff_dim, self.p.rff_sigma, derive_seed(seed, "fed3r-rff"), self.p.rff_convention
        )
        head = nn.Linear(self.p.rff_dim, linear.out_features, bias=linear.bias is not None)
        # in the model's dtype and on its device (a float64 model keeps a float64 head)
        model.head = RFFHead(rff, head).to(device=linear.weight.device, dtype=linear.weight.dtype)

    def statistics(self, z, y, num_classes):
        return client_statistics(augment(z) if self.p.bias else z, y, num_classes, full_b=self.p.sync)

    @property
    def fixed_classes(self) -> bool:
        return self.p.sync

    def stat_dim(self, linear: nn.Linear) -> int:
        return linear.in_features + int(self.p.bias)

    def more_statistics(self, q: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"A": ((q * (q + 1) // 2,), torch.float64)}

    def input_bound(self, model: nn.Module, feature_bound: float) -> float:
        r = super().input_bound(model, feature_bound)
        return max(r, 1.0) if self.p.bias else r  # the appended bias feature is 1

    def more_fields(self, q: int, n: float, r: float) -> list[tuple[str, tuple[int, ...], float]]:
        return [("A", (q * (q + 1) // 2,), pow2_at_least(n * r * r))]

    def secure_sum(self, sums, num_examples, num_summed, num_clients, errors):
        """Also: with the bias feature, A's bias entry must be ``num_examples`` and b's bias column the counts
        (within their errors; then set exactly); A must be positive semi-definite within ``num_summed lambda / (2
        K)`` (the slack ``check_statistics`` gives each client) plus ``q`` times its error per entry (a bound on
        the spectral norm of the quantisation's error). A that is within that but not positive semi-definite is
        replaced by its nearest positive semi-definite matrix (negative eigenvalues set to 0; a change of at most
        that bound), so every group adds a positive semi-definite A and the server's solve never fails."""
        why, out = super().secure_sum(sums, num_examples, num_summed, num_clients, errors)
        if why is not None:
            return why, out
        q = out["b"].shape[1]
        a = sums["A"].clone()
        if self.p.bias:
            if abs(float(a[-1]) - num_examples) > errors["A"] or \
                    bool(((out["b"][:, -1] - out["counts"]).abs() > errors["b"]).any()):
                return f"the summed bias statistics are not the {num_examples} examples counted", {}
            a[-1] = float(num_examples)
            out["b"][:, -1] = out["counts"]
        values, vectors = torch.linalg.eigh(unpack_upper(a, q))
        tol = num_summed * self.p.lam / (2.0 * max(num_clients, 1)) + q * errors["A"]
        if float(values.min()) < -tol:
            return f"the summed A is not positive semi-definite (within {tol:g})", {}
        if float(values.min()) < 0:
            a = pack_upper((vectors * values.clamp(min=0)) @ vectors.T)
        out["A"] = a
        return None, out

    def check_statistics(self, stats, result, num_classes, q, num_clients):
        """Also: with the bias feature, its Gram entry is the example count and its class sums the counts; and
        A_k is positive semi-definite within lambda / (2 K) (a Cholesky factorisation of A_k + lambda / (2 K) I),
        so the K clients of the stage together cannot take A = lambda I + sum_k A_k below lambda / 2: the
        server's solve never fails. An honest A_k fails this only if float64 rounding in Z_k^T Z_k exceeds
        lambda / (2 K) (statistics some 1e9 lambda / K large); raise ``lam`` then. Costs one q x q Cholesky
        factorisation per reply."""
        why = super().check_statistics(stats, result, num_classes, q, num_clients)
        if why:
            return why
        a = stats["A"]
        if self.p.bias:
            if float(a[-1]) != result.num_examples:
                return f"A's bias entry is {float(a[-1]):g}, the client has {result.num_examples} examples"
            if not torch.equal(stats["b"][:, -1], stats["counts"]):
                return "b's bias column differs from the counts"
        tol = self.p.lam / (2.0 * max(num_clients, 1))
        gram = unpack_upper(a.to(device="cpu", dtype=torch.float64), q)
        gram.diagonal().add_(tol)
        if int(torch.linalg.cholesky_ex(gram).info) != 0:
            return f"A is not positive semi-definite (within lambda / (2 K) = {tol:g})"
        return None

    def flops(self, ctx: ClientContext, p: int) -> float:
        """n (F_phi + [RFF projection 2 d D] + p(p+1) + p): the outer products' upper triangle and the
        class sum, per example (Table 3.3 with FLOPs = 2 multiply-adds)."""
        n = ctx.num_examples
        rff = 0.0
        if self.p.rff_dim is not None:
            rff = 2.0 * ctx.model.head.rff.in_dim * self.p.rff_dim
        q = p + int(self.p.bias)
        return n * (ctx.cost.features + rff + q * (q + 1) + q)

    def absorb(self, stats, linear):
        if self.acc is None:
            self.acc = RidgeAccumulator(linear.in_features + int(self.p.bias), linear.out_features, self.p.lam)
        self.acc.add(stats)

    @torch.no_grad()
    def write_head(self, linear: nn.Linear) -> None:
        w = self.acc.solve()
        if self.p.normalize:
            w = normalize_columns(w, has_bias_row=self.p.bias)
        weight = w[:-1] if self.p.bias else w
        linear.weight.copy_(weight.T.to(linear.weight.dtype))
        if linear.bias is not None:
            linear.bias.copy_(w[-1].to(linear.bias.dtype) if self.p.bias else torch.zeros_like(linear.bias))

    def state_dict(self) -> dict:
        out = super().state_dict()
        if self.acc is not None:
            out["acc"] = self.acc.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "acc" in state:
            s = state["acc"]
            self.acc = RidgeAccumulator(int(s["dim"]), int(s["num_classes"]), float(s["lam"]))
            self.acc.load_state_dict(s)


@COMPONENTS.register(
    "fed3r", params=Fed3RParams, help="Fed3R closed-form ridge classifier (+ RF features, Sync) from frozen features",
    requires={"class_labels", "linear_head"},
    metrics=(MetricSpec("fed3r/clients_reported", None, "clients whose statistics were absorbed so far"),),
)
def _fed3r(params: Fed3RParams) -> Fed3R:
    return Fed3R(params)


class FedNCMParams(Params):
    normalize: bool = Field(
        False, description="false: Euclidean nearest class mean; true: unit-norm class means (cosine prototypes)"
    )
    sampling: Literal["once", "replacement"] = Field(
        "once", description="once: each client exactly once, clients_per_round a round (Alg. 5); replacement: the "
        "round's usual sample, only clients not yet reported send (Fig. 3.9, Table 3.6)")


class FedNCM(ClosedFormClassifier):
    name = "fedncm"

    def __init__(self, params: FedNCMParams | None = None):
        super().__init__()
        self.p = params or FedNCMParams()
        self.sums: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def adapt_model(self, model: nn.Module, seed: int) -> None:
        head_linear(model)  # a model without a linear head fails here, before any round

    def statistics(self, z, y, num_classes):
        stats = client_statistics(z, y, num_classes)
        return {"classes": stats["classes"], "b": stats["b"], "counts": stats["counts"]}

    def flops(self, ctx: ClientContext, p: int) -> float:
        return ctx.num_examples * (ctx.cost.features + p)

    def absorb(self, stats, linear):
        if self.sums is None:
            self.sums = torch.zeros(linear.out_features, linear.in_features, dtype=torch.float64)
            self.counts = torch.zeros(linear.out_features, dtype=torch.float64)
        dev = self.sums.device
        classes = stats["classes"].long().to(dev)
        self.sums.index_add_(0, classes, stats["b"].to(device=dev, dtype=torch.float64))
        self.counts.index_add_(0, classes, stats["counts"].to(device=dev, dtype=torch.float64))

    @torch.no_grad()
    def write_head(self, linear: nn.Linear) -> None:
        weight, bias = ncm_classifier(self.sums, self.counts, self.p.normalize)
        linear.weight.copy_(weight.to(linear.weight.dtype))
        if linear.bias is not None:
            linear.bias.copy_(bias.to(linear.bias.dtype))

    def state_dict(self) -> dict:
        out = super().state_dict()
        if self.sums is not None:
            out.update(sums=self.sums.clone(), counts=self.counts.clone())
        return out

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "sums" in state:
            self.sums, self.counts = state["sums"].to(torch.float64), state["counts"].to(torch.float64)


@COMPONENTS.register("fedncm", params=FedNCMParams, help="FedNCM: nearest-class-mean classifier from frozen features",
                     requires={"class_labels", "linear_head"},
                     metrics=(MetricSpec("fedncm/clients_reported", None, "clients whose class means were absorbed so far"),))
def _fedncm(params: FedNCMParams) -> FedNCM:
    return FedNCM(params)
