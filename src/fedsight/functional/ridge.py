"""Closed-form classifiers on frozen features: Fed3R ridge regression, random Fourier features, FedNCM.

Pure tensor math (no engine code). The model is f = psi o phi with a frozen, pre-trained feature
extractor phi (features z in R^d) and a linear classifier psi (thesis Sec. 3.4). Clients compute
additive sufficient statistics once; the server sums them and solves ridge regression in closed form:

    A = lam * I + sum_k A_k,   A_k = Z_k^T Z_k                      (eq. 3.24, 3.26)
    B = sum_k b_k,             b_k^c = sum_{(x, y=c) in D_k} phi(x)  (eq. 3.25, 3.26)
    W = A^{-1} B                                                    (eq. 3.23 / 3.14)

Because the statistics are sums, the result is the same for any partition of the data into clients
and any arrival order, and equals centralised ridge regression on the pooled data (Alg. 3, property 3).

All statistics are float64: A accumulates n * ||z||^2-sized sums and is then inverted, so float32 would
lose the equivalence with the centralised solution.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "RandomFourierFeatures",
    "RidgeAccumulator",
    "augment",
    "client_statistics",
    "dense_statistics",
    "ncm_classifier",
    "normalize_columns",
    "pack_upper",
    "unpack_upper",
]

_STAT_FIELDS = ("A", "classes", "b", "counts")


def augment(z: torch.Tensor) -> torch.Tensor:
    """``[z, 1]``: append a constant-one column to features ``z`` of shape [n, d] -> [n, d + 1].

    This is the bias trick of eq. (3.9): x~ = [x; 1], W~ = [W; beta], so the last row of the solved
    W is the per-class intercept. As in the authors' code (ambiguity A3), the intercept is not
    treated specially afterwards: the ridge term lam * I of A_0 = lam * I (Alg. 3) regularises the
    bias row like every weight row. The result keeps ``z``'s dtype and device.
    """
    if z.dim() != 2:
        raise ValueError(f"augment expects features of shape [n, d], got {tuple(z.shape)}")
    return torch.cat([z, z.new_ones(z.shape[0], 1)], dim=1)


def _triu(p: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = torch.triu_indices(p, p, device=device)
    return rows, cols


def pack_upper(a: torch.Tensor) -> torch.Tensor:
    """The upper triangle (diagonal included) of the square matrix ``a`` [p, p], row-major, as a vector.

    This is what goes on the wire for the symmetric A_k = Z_k^T Z_k: p (p + 1) / 2 numbers
    (thesis Table 3.2). Entries below the diagonal are ignored; ``unpack_upper`` inverts this for
    symmetric ``a``.
    """
    if a.dim() != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"pack_upper expects a square matrix, got shape {tuple(a.shape)}")
    rows, cols = _triu(a.shape[0], a.device)
    return a[rows, cols]


def unpack_upper(v: torch.Tensor, p: int) -> torch.Tensor:
    """The symmetric [p, p] matrix whose row-major upper triangle is ``v`` (inverse of ``pack_upper``)."""
    expected = p * (p + 1) // 2
    if p < 0 or v.dim() != 1 or v.numel() != expected:
        raise ValueError(f"unpack_upper expects a vector of {expected} entries for p={p}, got shape {tuple(v.shape)}")
    rows, cols = _triu(p, v.device)
    out = v.new_zeros(p, p)
    out[rows, cols] = v
    out[cols, rows] = v
    return out


def client_statistics(
    z: torch.Tensor, y: torch.Tensor, num_classes: int, full_b: bool = False
) -> dict[str, torch.Tensor]:
    """One client's Fed3R message (eq. 3.26, Alg. 3 client step), computed in float64.

    Args:
        z: features [n, p] (already ``augment``-ed and/or lifted by ``RandomFourierFeatures`` if wanted).
        y: integer labels [n] in ``[0, num_classes)``.
        num_classes: C.
        full_b: Fed3R-Sync (Alg. 5 / Alg. 6): send a fixed-shape b for all C classes, as secure
            aggregation needs equal shapes from every client; absent classes get zero rows.

    Returns:
        ``"A"``: packed upper triangle (``pack_upper``) of A_k = z^T z, p (p + 1) / 2 entries;
        ``"classes"``: sorted LongTensor of the classes present at the client, C_k
        (``arange(C)`` with ``full_b``);
        ``"b"``: [len(classes), p], row i = sum of the features of class ``classes[i]`` (the
        non-averaged prototype b_k^c; b is stored transposed w.r.t. the thesis's d x C b);
        ``"counts"``: [len(classes)] float64 number of examples of each class (FedNCM needs them).
    """
    if z.dim() != 2:
        raise ValueError(f"z must have shape [n, p], got {tuple(z.shape)}")
    if y.dim() != 1 or y.shape[0] != z.shape[0]:
        raise ValueError(f"y must have shape [{z.shape[0]}], got {tuple(y.shape)}")
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise ValueError(f"y must hold integer labels, got dtype {y.dtype}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be positive, got {num_classes}")
    y = y.to(torch.long)
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got range [{int(y.min())}, {int(y.max())}]")
    z64 = z.to(torch.float64)
    p = z64.shape[1]
    a = pack_upper(z64.T @ z64)
    if full_b:
        classes = torch.arange(num_classes, device=z64.device)
        index = y
    else:
        classes, index = torch.unique(y, sorted=True, return_inverse=True)
    b = z64.new_zeros(classes.numel(), p).index_add_(0, index, z64)
    counts = z64.new_zeros(classes.numel()).index_add_(0, index, z64.new_ones(y.numel()))
    return {"A": a, "classes": classes, "b": b, "counts": counts}


def dense_statistics(stats: Mapping[str, torch.Tensor], num_classes: int) -> dict[str, torch.Tensor]:
    """``client_statistics`` for all ``num_classes`` classes (the ``full_b`` form: zero rows for the classes the
    client lacks), whichever form ``stats`` has: what a client adds to a secure sum. Other fields (``A``) as they
    are."""
    classes = stats["classes"].to(torch.long)
    out = {k: v for k, v in stats.items() if k not in ("classes", "b", "counts")}
    out["classes"] = torch.arange(num_classes, device=classes.device)
    b = stats["b"]
    out["b"] = b.new_zeros(num_classes, b.shape[1]).index_copy_(0, classes, b)
    out["counts"] = stats["counts"].new_zeros(num_classes).index_copy_(0, classes, stats["counts"])
    return out


class RidgeAccumulator:
    """Server side of Fed3R / Fed3R-RF / Fed3R-Sync (Alg. 3-6): running sums of client statistics.

    ``A`` [dim, dim] float64 starts at lam * I (Alg. 3, "A_0 = lambda I"), ``B`` [dim, C] at zero and
    ``counts`` [C] at zero. ``add`` is order-independent; ``solve`` returns W = A^{-1} B, which after
    all clients equals centralised ridge regression (eq. 3.14 / 3.23). ``lam`` may be 0 (plain least
    squares), in which case ``solve`` needs the pooled features to have full column rank.
    """

    def __init__(self, dim: int, num_classes: int, lam: float) -> None:
        if dim < 1 or num_classes < 1:
            raise ValueError(f"dim and num_classes must be positive, got {dim} and {num_classes}")
        if not math.isfinite(lam) or lam < 0:
            raise ValueError(f"lam must be finite and non-negative, got {lam}")
        self.dim = int(dim)
        self.num_classes = int(num_classes)
        self.lam = float(lam)
        self.A = self.lam * torch.eye(self.dim, dtype=torch.float64)
        self.B = torch.zeros(self.dim, self.num_classes, dtype=torch.float64)
        self.counts = torch.zeros(self.num_classes, dtype=torch.float64)
        self.num_updates = 0

    def _validated(self, stats: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        for name in _STAT_FIELDS:
            if name not in stats:
                raise ValueError(f"statistics lack field {name!r} (need {', '.join(_STAT_FIELDS)})")
            if not isinstance(stats[name], torch.Tensor):
                raise ValueError(f"statistics field {name!r} must be a tensor, got {type(stats[name]).__name__}")
        a, classes, b, counts = (stats[name] for name in _STAT_FIELDS)
        packed = self.dim * (self.dim + 1) // 2
        if a.dim() != 1 or a.numel() != packed:
            raise ValueError(
                f"field 'A' must be a packed upper triangle of {packed} entries (dim={self.dim}), "
                f"got shape {tuple(a.shape)}"
            )
        if classes.dim() != 1 or classes.is_floating_point() or classes.is_complex() or classes.dtype == torch.bool:
            raise ValueError(
                f"field 'classes' must be a 1-D integer tensor, got shape {tuple(classes.shape)}, dtype {classes.dtype}"
            )
        classes = classes.to(device=self.B.device, dtype=torch.long)
        if classes.numel():
            if int(classes.min()) < 0 or int(classes.max()) >= self.num_classes:
                raise ValueError(f"field 'classes' has entries outside [0, {self.num_classes}): {classes.tolist()}")
            if torch.unique(classes).numel() != classes.numel():
                raise ValueError(f"field 'classes' has repeated entries: {classes.tolist()}")
        k = classes.numel()
        if b.dim() != 2 or tuple(b.shape) != (k, self.dim):
            raise ValueError(f"field 'b' must have shape ({k}, {self.dim}) = (len(classes), dim), got {tuple(b.shape)}")
        if counts.dim() != 1 or counts.numel() != k:
            raise ValueError(f"field 'counts' must have shape ({k},) = (len(classes),), got {tuple(counts.shape)}")
        a, b, counts = (t.to(device=self.A.device, dtype=torch.float64) for t in (a, b, counts))
        for name, t in (("A", a), ("b", b), ("counts", counts)):
            if not torch.isfinite(t).all():
                raise ValueError(f"field {name!r} has non-finite entries")
        if (counts < 0).any():
            raise ValueError("field 'counts' has negative entries")
        return a, classes, b, counts

    def add(self, stats: Mapping[str, torch.Tensor]) -> None:
        """Add one client's (Alg. 3/4) or one secure-aggregated group's (Alg. 5/6) statistics.

        ``stats`` has the layout of ``client_statistics``; a group message is the field-wise sum of its
        clients' ``full_b=True`` statistics. A_{t+1} = A_t + A_k and b^c_{t+1} = b^c_t + b^c_k for
        c in ``classes``. Everything is validated before anything changes: a malformed message raises
        ``ValueError`` naming the bad field and leaves the accumulator untouched.
        """
        a, classes, b, counts = self._validated(stats)
        self.A += unpack_upper(a, self.dim)
        self.B.index_add_(1, classes, b.T)
        self.counts.index_add_(0, classes, counts)
        self.num_updates += 1

    def solve(self) -> torch.Tensor:
        """W = A^{-1} B [dim, C] in float64 (eq. 3.23 / 3.14), via a Cholesky factorisation of A.

        Classes never seen have a zero column. Raises ``torch.linalg.LinAlgError`` if A is not
        positive definite (only possible with lam = 0 and rank-deficient pooled features).
        """
        factor, info = torch.linalg.cholesky_ex(self.A)
        if int(info) != 0:
            raise torch.linalg.LinAlgError(
                f"ridge system A = lam*I + sum_k Z_k^T Z_k is not positive definite (leading minor of order "
                f"{int(info)} fails; lam={self.lam}, {self.num_updates} updates): use lam > 0 or more data"
            )
        return torch.cholesky_solve(self.B, factor)

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint: ``A`` packed (it is exactly symmetric), ``B``, ``counts`` (float64 copies) and ints.

        ``lam`` (a float) is included so that loading into an accumulator with another lam is caught.
        """
        return {
            "A": pack_upper(self.A).clone(),
            "B": self.B.clone(),
            "counts": self.counts.clone(),
            "num_updates": self.num_updates,
            "dim": self.dim,
            "num_classes": self.num_classes,
            "lam": self.lam,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a ``state_dict`` exactly; dim, num_classes and lam must match this accumulator."""
        for name in ("dim", "num_classes", "lam"):
            if name not in state:
                raise ValueError(f"state lacks field {name!r}")
            if state[name] != getattr(self, name):
                raise ValueError(f"state has {name}={state[name]!r}, this accumulator has {getattr(self, name)!r}")
        shapes = {
            "A": (self.dim * (self.dim + 1) // 2,),
            "B": (self.dim, self.num_classes),
            "counts": (self.num_classes,),
        }
        for name, shape in shapes.items():
            t = state.get(name)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"state field {name!r} must be a tensor of shape {shape}, got {got}")
        if "num_updates" not in state:
            raise ValueError("state lacks field 'num_updates'")
        self.A = unpack_upper(state["A"].to(torch.float64), self.dim).clone()
        self.B = state["B"].to(torch.float64).clone()
        self.counts = state["counts"].to(torch.float64).clone()
        self.num_updates = int(state["num_updates"])


def normalize_columns(w: torch.Tensor, has_bias_row: bool) -> torch.Tensor:
    """Column-wise L2 normalisation W^c <- W^c / ||W^c|| (last line of Alg. 3; ambiguity A4).

    With ``has_bias_row`` the last row of ``w`` [p, C] is the intercept (``augment``): the norm is taken
    over the weight rows ``w[:-1]`` only and the bias is divided by the same per-class norm, as in the
    authors' code (ambiguity A3). Columns whose (weight) norm is zero, e.g. classes never seen, are
    returned unchanged, so an all-zero column stays zero and no NaN appears. Returns a new tensor.
    """
    if w.dim() != 2:
        raise ValueError(f"normalize_columns expects a [p, C] matrix, got shape {tuple(w.shape)}")
    if has_bias_row and w.shape[0] < 2:
        raise ValueError("with has_bias_row the matrix needs at least one weight row above the bias row")
    weights = w[:-1] if has_bias_row else w
    norms = torch.linalg.vector_norm(weights, dim=0)
    return w / torch.where(norms > 0, norms, torch.ones_like(norms))


class RandomFourierFeatures(torch.nn.Module):
    """Random Fourier features (Rahimi & Recht), the lifting of Fed3R-RF (eq. 3.21, Alg. 4 and 6).

    phi(z) = sqrt(2 / D) * cos(z @ omega + offset), omega [in_dim, D], offset [D] ~ U(0, 2 pi).

    omega and offset are drawn from a ``torch.Generator`` seeded with ``seed``: every client builds the
    same map from the shared seed, so the map itself is never communicated. They are registered as
    non-persistent buffers and never enter ``state_dict`` (they follow ``.to(device/dtype)``).

    ``convention`` (ambiguity A2):
        ``"rbf"`` (default): omega ~ N(0, sigma^-2 I), the standard choice for which
        E[phi(x) . phi(x')] = exp(-||x - x'||^2 / (2 sigma^2)), the RBF kernel of eq. (3.20).
        ``"thesis"``: omega ~ N(0, (2 / sigma) I) as eq. (3.21) is printed; the implied kernel is then
        exp(-||x - x'||^2 / sigma), so the same sigma means a different bandwidth.
    The draw is made in float64 on the CPU (deterministic for a seed); ``forward`` computes in the
    input's dtype.
    """

    omega: torch.Tensor
    offset: torch.Tensor

    def __init__(self, in_dim: int, out_dim: int, sigma: float, seed: int, convention: str = "rbf") -> None:
        super().__init__()
        if in_dim < 1 or out_dim < 1:
            raise ValueError(f"in_dim and out_dim must be positive, got {in_dim} and {out_dim}")
        if not math.isfinite(sigma) or sigma <= 0:
            raise ValueError(f"sigma must be finite and positive, got {sigma}")
        if convention == "rbf":
            std = 1.0 / sigma
        elif convention == "thesis":
            std = math.sqrt(2.0 / sigma)
        else:
            raise ValueError(f"convention must be 'rbf' or 'thesis', got {convention!r}")
        self.in_dim, self.out_dim, self.sigma = int(in_dim), int(out_dim), float(sigma)
        self.seed, self.convention = int(seed), convention
        gen = torch.Generator().manual_seed(self.seed)
        omega = torch.randn(self.in_dim, self.out_dim, generator=gen, dtype=torch.float64) * std
        offset = torch.rand(self.out_dim, generator=gen, dtype=torch.float64) * (2.0 * math.pi)
        self.register_buffer("omega", omega, persistent=False)
        self.register_buffer("offset", offset, persistent=False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if z.shape[-1] != self.in_dim:
            raise ValueError(f"expected features with last dimension {self.in_dim}, got shape {tuple(z.shape)}")
        omega = self.omega.to(device=z.device, dtype=z.dtype)
        offset = self.offset.to(device=z.device, dtype=z.dtype)
        return math.sqrt(2.0 / self.out_dim) * torch.cos(z @ omega + offset)

    def extra_repr(self) -> str:
        return (
            f"in_dim={self.in_dim}, out_dim={self.out_dim}, sigma={self.sigma}, seed={self.seed}, "
            f"convention={self.convention!r}"
        )


#: how far below the lowest real bias an absent class is put in the Euclidean NCM layer
_ABSENT_MARGIN = 1e6


def ncm_classifier(sums: torch.Tensor, counts: torch.Tensor, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FedNCM as a linear layer (weight [C, p], bias [C]) from per-class feature sums and counts (float64).

    The thesis only names FedNCM (ambiguity A14). The class means mu_c = sums_c / counts_c come from the
    same additive statistics as Fed3R (``RidgeAccumulator.B.T`` and ``.counts``).

    ``normalize=False``: exact Euclidean nearest class mean: weight mu_c, bias -||mu_c||^2 / 2, since
    argmax_c (z . mu_c - ||mu_c||^2 / 2) = argmin_c ||z - mu_c||^2.
    ``normalize=True``: cosine prototype classifier (Legate et al., 2023, FedNCM): weight
    mu_c / ||mu_c||, bias 0.

    Classes with count 0 get weight 0 and a finite bias (no -inf, which would give NaN in a softmax
    cross-entropy): Euclidean, the smallest bias of the present classes minus 1e6, so such a class wins
    only if z is so far from every mean that all present logits drop that low (never for non-negative
    features, e.g. after a ReLU, as then z . mu_c >= 0); cosine, -1, which no present class goes below
    when the features are L2-normalised (cosine logits lie in [-1, 1]; at an exact tie argmax picks the
    lowest index). A present class whose mean is the zero vector gets weight 0 and bias 0. If no class
    is present, weight and bias are all zero.
    """
    if sums.dim() != 2:
        raise ValueError(f"sums must have shape [C, p], got {tuple(sums.shape)}")
    if counts.dim() != 1 or counts.shape[0] != sums.shape[0]:
        raise ValueError(f"counts must have shape [{sums.shape[0]}], got {tuple(counts.shape)}")
    sums = sums.to(torch.float64)
    counts = counts.to(device=sums.device, dtype=torch.float64)
    if (counts < 0).any() or not torch.isfinite(counts).all():
        raise ValueError("counts must be finite and non-negative")
    present = counts > 0
    mu = sums / torch.where(present, counts, torch.ones_like(counts)).unsqueeze(1)
    mu = torch.where(present.unsqueeze(1), mu, torch.zeros_like(mu))
    if normalize:
        norms = torch.linalg.vector_norm(mu, dim=1, keepdim=True)
        weight = mu / torch.where(norms > 0, norms, torch.ones_like(norms))
        bias = torch.where(present, 0.0, -1.0).to(torch.float64)
        if not present.any():
            bias = torch.zeros_like(bias)
        return weight, bias
    bias = -0.5 * (mu * mu).sum(dim=1)
    if present.any() and not present.all():
        floor = bias[present].min() - _ABSENT_MARGIN
        bias = torch.where(present, bias, floor)
    return mu, bias
