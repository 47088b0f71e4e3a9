"""LADD (thesis Sec. 5.3, Algorithms 9-10): source-free federated domain adaptation with style clustering,
as four recipe parts used in three stages, not a class with its own loop.

* ``client_styles`` (stage "styles", one round, every client): a statistics pass. Each client uploads its
  style, the mean ``(2 half + 1)^2`` low-frequency amplitude window of its images (Sec. 5.3.3; 27 numbers at
  ``half = 1``, the authors' setting); the server clusters the styles (Alg. 9: k-means with restarts, k by
  silhouette; ``fedsight.functional.clustering``) and records styles and clusters as run facts.
* ``source_pretrain`` (stage "source", server-only rounds): SGD on the server's labelled source set
  (``task.source``) with every source image FDA-restyled by a random client style (Sec. 5.3.3), poly
  schedule over ``steps``; the result is theta^0, kept as a run fact for distillation.
* ``self_training`` (stage "adapt"): the clients' unlabelled images train on pseudo-labels (the authors'
  thresholding: confidence above ``threshold`` OR among the ``fraction`` most confident pixels of its
  class) from the SWA teacher of the client's cluster (eq. 5.22, updated every ``every`` rounds from
  ``start`` on) or from the client's own model; optional entropy term (eq. 5.18 or the code's normalised
  4th power) and distillation towards theta^0 (the code's soft-target CE with the teacher's logits times
  ``kd_alpha``, masked to the pseudo-labelled pixels, weight ``kd_lambda``; or eq. 5.20's KL). ``pseudo =
  "own_ce_kl"`` trains eq. 5.19 as the thesis writes it instead (CE to the student's own pseudo-labels +
  KL(student || teacher)); with the Shannon entropy at weight 1 and the KL distillation the loss is eq. 5.21.
* ``cluster_aggregation`` (stage "adapt"): the ``part`` entries (head, norm, backbone or all) are
  cluster-specific: each cluster's clients receive and train their cluster's values, which are averaged
  within the cluster (eq. 5.17, data-size weights); the rest is averaged over all clients as usual. A test
  image goes to the cluster whose centroid is nearest to its style and is evaluated with that cluster's
  model (Sec. 5.3.8, as the authors' code: no test-time FDA; ``restyle = true`` FDA-restyles it to its
  cluster's centroid style first, as the thesis describes). The global model holds the clusters' mean for
  cluster-specific entries. List it before other components whose client hooks read the received values.

Ambiguities resolved (digest Sec. 7, item 11): the pseudo-label loss, KD form and weights follow the released
code (``reduction = "all"``: CE summed over kept pixels divided by all pixels); a cluster with no sampled client
keeps its entries; clustering happens once; the teacher is per cluster (the global teacher without
``cluster_aggregation``); a client receives theta^0 once and keeps it in its state (it is counted once in its
download). Cluster-specific entries are averaged plainly whatever the server optimizer. The frozen models (the
SWA teacher, theta^0) normalise with the client's batch statistics (``frozen_bn = "batch"``): the thesis is
silent; the authors' code calls its teacher, a copy of the trained model, without switching it to eval mode,
and evaluates SWA models with BatchNorm on batch statistics (``switch_bn_stats_to_test``). Their running
statistics are the federation's average over every target domain: with them (``"running"``) the SWA teacher's
pseudo-labels cost 5 mIoU points on the generated street scenes (docs/ladd.md).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from ..device import model_device
from ..functional.clustering import cluster_styles, clustering_accuracy, contingency
from ..metrics import MetricSpec
from ..records import ClientResult
from ..registry import COMPONENTS, FACT_REPORTS, Params
from ..rng import np_rng
from ..training import ClientContext, Component, ExtrasSpec, ServerContext, UploadContext
from ..training.local import Trainer

STYLES, HALF, GROUPS, CENTROIDS = "ladd/styles", "ladd/half", "ladd/groups", "ladd/centroids"
THETA0 = "ladd/theta0:"


def cluster_prefix(s: int) -> str:
    return f"ladd/cluster{s}:"


def _entries(facts: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in facts.items() if k.startswith(prefix)}


# ------------------------------------------------------------------------------------------ client styles


class ClientStylesParams(Params):
    half: int = Field(1, ge=0, description="style window (2 half + 1)^2 around DC (the authors' fda_b = 1: 3 x 3)")
    ks: list[int] = Field([2, 3, 4, 5, 6, 7, 8], description="candidate numbers of clusters (Alg. 9's m..n-1)")
    seeds: list[int] = Field([0, 1, 2, 3, 4], min_length=1, description="k-means seeds tried per candidate (Alg. 9's R)")


class StyleTrainer(Trainer):
    """A client's part of the styles stage: its style, no training."""

    name = "client_styles"
    trains = False
    downloads_model = False

    def __init__(self, component: "ClientStyles"):
        self.component = component

    def train(self, ctx: ClientContext, components: Sequence[Component]) -> ClientResult:
        style = ctx.task.client_style(ctx.client_id, self.component.params.half)
        result = ClientResult(client_id=ctx.client_id, num_examples=ctx.num_examples, delta={}, num_steps=0)
        result.extras[self.component.name] = {"style": style.detach().cpu()}
        return result


class ClientStyles(Component):
    name = "client_styles"
    uploads_extras = True  # the client's style vector (its trainer's upload)

    def __init__(self, params: ClientStylesParams):
        self.params = params

    def trainer(self) -> Trainer:
        return StyleTrainer(self)

    def sample(self, round: int, num_clients: int, m: int, seed: int) -> list[int]:
        return list(range(num_clients))  # every client reports once in the round

    def extras_spec(self, ctx: UploadContext) -> ExtrasSpec:
        """``style``: float32 [3, 2 half + 1, 2 half + 1] (``data.seg_pipeline.style_entry``'s windows) of
        amplitudes, so non-negative (float32 values keep k-means' float64 squared distances finite)."""
        w = 2 * self.params.half + 1

        def check(group, result) -> str | None:
            style = group["style"]
            if bool((style < 0).any()):
                return "style has negative values (it holds amplitudes)"
            return None

        return ExtrasSpec({"style": ((3, w, w), torch.float32)}, check=check)

    def server_round_end(self, sctx: ServerContext, results: list[ClientResult], weights: torch.Tensor) -> None:
        w = 2 * self.params.half + 1
        styles = sctx.facts.get(STYLES)
        if styles is None:
            styles = torch.full((sctx.num_clients, 3, w, w), float("nan"), dtype=torch.float64)
        for res in results:
            styles[res.client_id] = res.extras[self.name]["style"].to(torch.float64)
        sctx.facts[STYLES] = styles
        sctx.facts[HALF] = torch.tensor(self.params.half)
        reported = ~torch.isnan(styles.reshape(len(styles), -1)).any(1)
        sctx.metrics["clusters/clients_reported"] = float(reported.sum())
        if bool(reported.all()):
            res = cluster_styles(styles.reshape(len(styles), -1).numpy(), self.params.ks, self.params.seeds)
            sctx.facts[GROUPS] = torch.from_numpy(res.labels)
            sctx.facts[CENTROIDS] = torch.from_numpy(res.centroids)
            sctx.metrics["clusters/k"] = float(res.k)
            if res.k in res.scores:
                sctx.metrics["clusters/silhouette"] = res.scores[res.k][1]
            truth = true_domains(sctx.task)
            if truth is not None:  # evaluation only: the server's clustering never reads the true domains
                acc = clustering_accuracy(contingency(truth, res.labels))
                sctx.metrics["clusters/accuracy_majority"] = acc["majority"]
                sctx.metrics["clusters/accuracy_matching"] = acc["matching"]


@COMPONENTS.register(
    "client_styles", params=ClientStylesParams, requires={"styles"},
    help="LADD: every client reports its mean low-frequency amplitude window; k-means + silhouette cluster them",
    metrics=(MetricSpec("clusters/*", None, "clients reported, clusters chosen and their silhouette"),),
)
def _client_styles(params: ClientStylesParams) -> ClientStyles:
    return ClientStyles(params)


def true_domains(task: Any) -> np.ndarray | None:
    """Every client's true domain, the one most of its training images come from (a CrossCity client's city);
    None when the task knows no domains."""
    if not hasattr(task, "client_domain_counts"):
        return None
    counts = np.asarray(task.client_domain_counts())
    return counts.argmax(1) if counts.ndim == 2 and counts.shape[1] else None


def report_style_clusters(run_dir: Path, facts: dict[str, torch.Tensor], task: Any) -> None:
    """``clusters.json`` (every client's cluster and main domain, the centroids, and with domains the table of
    clients per domain in each cluster (the thesis's Table 5.19) and the clustering accuracies against the true
    domain, ``functional.clustering.clustering_accuracy``) and ``plots/style_clusters.png``: the clients' styles
    in 2-D (PCA), coloured by cluster and by the client's main domain, and that table (when the task knows
    domains): whether the clusters found the planted styles."""
    from sklearn.decomposition import PCA

    from ..reporting.plots import _new_figure, _save

    if GROUPS not in facts:
        return
    styles = facts[STYLES].reshape(len(facts[STYLES]), -1).cpu().numpy()
    groups = facts[GROUPS].cpu().numpy()
    truth = true_domains(task)
    names = list(task.data.domain_names) if truth is not None else []
    main = [names[int(i)] for i in truth] if truth is not None else []
    info: dict[str, Any] = {"k": int(groups.max()) + 1, "clients": [
        {"client": c, "cluster": int(g), **({"domain": main[c]} if main else {})} for c, g in enumerate(groups)],
        "centroids": facts[CENTROIDS].cpu().numpy().tolist() if CENTROIDS in facts else []}
    table = acc = None
    if truth is not None:
        table = contingency(truth, groups, len(names), info["k"])
        present = np.flatnonzero(table.sum(1))  # the domains some client holds
        table, row_names = table[present], [names[int(i)] for i in present]
        acc = clustering_accuracy(table)
        info["accuracy"] = acc
        info["table"] = {"domains": row_names, "clusters": list(range(info["k"])), "clients": table.tolist()}
    (run_dir / "clusters.json").write_text(json.dumps(info, indent=1) + "\n")
    xy = PCA(n_components=2).fit_transform(styles) if len(styles) > 2 and styles.std(0).sum() > 0 else \
        np.column_stack([styles[:, 0], styles[:, min(1, styles.shape[1] - 1)]])
    fig, axes = _new_figure(3 if main else 1, f"LADD style clusters of {len(groups)} clients")
    panels = [("style clusters (k-means, k by silhouette)", groups, [f"cluster {g}" for g in range(info["k"])])]
    if main:
        ids = np.unique(main, return_inverse=True)
        panels.append(("clients' main domain", ids[1], list(ids[0])))
    for ax, (title, colour, labels) in zip(axes, panels):
        for j, label in enumerate(labels):
            sel = colour == j
            if sel.any():
                ax.scatter(xy[sel, 0], xy[sel, 1], s=28, label=label, color=f"C{j % 10}",
                           marker="osD^v<>ph*"[j // 10 % 10])
        ax.set_title(title)
        ax.set_xlabel("style PC 1")
        ax.set_ylabel("style PC 2")
        if len(labels) > 4:  # a domain per client pair: below the panel, where it covers no point
            ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, columnspacing=0.8,
                      handletextpad=0.2)
        else:
            ax.legend(fontsize=7, loc="best")
    if table is not None and acc is not None:
        _plot_table(axes[2], table, info["table"]["domains"], acc)
    _save(fig, run_dir / "plots" / "style_clusters.png")


def _plot_table(ax: Any, table: np.ndarray, rows: list[str], acc: dict[str, float]) -> None:
    """Clients per true domain (rows) in each cluster (columns), annotated, as the thesis's Table 5.19."""
    ax.imshow(table, cmap="Blues", aspect="auto", vmin=0)
    for (i, j), v in np.ndenumerate(table):
        ax.text(j, i, str(int(v)), ha="center", va="center", fontsize=8,
                color="white" if v > 0.6 * max(1, table.max()) else "black")
    ax.set_xticks(range(table.shape[1]), [f"cluster {j}" for j in range(table.shape[1])], fontsize=7)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.set_title(f"clients per domain and cluster\naccuracy: majority {100 * acc['majority']:.1f}%, "
                 f"one-to-one {100 * acc['matching']:.1f}%", fontsize=9)


FACT_REPORTS[GROUPS] = report_style_clusters

# ---------------------------------------------------------------------------------------- source pre-training


class SourcePretrainParams(Params):
    steps: int = Field(1500, ge=1, description="SGD steps on the source set in all (the authors: 15000 on GTA5)",
                       json_schema_extra={"smoke": 2})
    steps_per_round: int = Field(100, ge=1, description="steps per server-only round (each round is evaluated)",
                                 json_schema_extra={"smoke": 2})
    batch_size: int = Field(8, ge=1)
    lr: float = Field(5e-3, gt=0, description="initial rate of the poly schedule over ``steps`` (power 0.9)")
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    style: Literal["fda", "none"] = Field("fda", description="FDA with a random client style per image (needs the "
                                          "styles stage), or plain source images")


class SourcePretrain(Component):
    name = "source_pretrain"

    def __init__(self, params: SourcePretrainParams):
        self.params = params
        self.done = 0
        self.momentum: list[torch.Tensor] = []

    def sample(self, round: int, num_clients: int, m: int, seed: int) -> list[int]:
        return []  # server-only rounds

    def server_step(self, sctx: ServerContext) -> None:
        p, task, model = self.params, sctx.task, sctx.model
        todo = min(p.steps - self.done, p.steps_per_round)
        if todo <= 0:
            return
        styles = half = None
        if p.style == "fda":
            if STYLES not in sctx.facts:
                raise ValueError("source_pretrain: style = 'fda' needs the clients' styles; run client_styles in an "
                                 "earlier stage (or set style = 'none')")
            styles, half = sctx.facts[STYLES], int(sctx.facts[HALF])
            styles = styles[~torch.isnan(styles.reshape(len(styles), -1)).any(1)]
        params = [q for q in model.parameters() if q.requires_grad]
        opt = torch.optim.SGD(params, lr=p.lr, momentum=p.momentum, weight_decay=p.weight_decay)
        for q, buf in zip(params, self.momentum):
            opt.state[q]["momentum_buffer"] = buf.to(q.device).clone()
        was_training = model.training
        model.train()
        n, losses = len(task.source), []
        for _ in range(todo):
            step = self.done
            for g in opt.param_groups:
                g["lr"] = p.lr * (1 - step / p.steps) ** 0.9
            idx = np_rng(sctx.seed, "source", step).choice(n, p.batch_size, replace=n < p.batch_size)
            x, y = task.source_batch(idx, ("source", step), styles, half if half is not None else 1, sctx.seed)
            loss = task.loss(model(x.to(model_device(model))), y.to(model_device(model)))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            self.done += 1
        model.train(was_training)
        self.momentum = [opt.state[q]["momentum_buffer"].detach().clone() for q in params if "momentum_buffer" in opt.state[q]]
        sctx.metrics["source/loss"] = float(np.mean(losses))
        sctx.metrics["source/steps"] = float(self.done)
        if self.done >= p.steps:  # theta^0: what the adaptation stage distils towards
            for k, v in model.state_dict().items():
                sctx.facts[THETA0 + k] = v.detach().clone()

    def state_dict(self) -> dict[str, Any]:
        return {"done": torch.tensor(self.done), "momentum": {str(i): b for i, b in enumerate(self.momentum)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.done = int(state.get("done", 0))
        mom = state.get("momentum", {})
        self.momentum = [mom[str(i)] for i in range(len(mom))]


@COMPONENTS.register(
    "source_pretrain", params=SourcePretrainParams, requires={"styles"},
    help="LADD: the server trains on its labelled source set, FDA-restyled with the clients' styles",
    metrics=(MetricSpec("source/loss", False, "mean source loss of the round's server steps"),
             MetricSpec("source/steps", None, "source steps so far")),
)
def _source_pretrain(params: SourcePretrainParams) -> SourcePretrain:
    return SourcePretrain(params)
