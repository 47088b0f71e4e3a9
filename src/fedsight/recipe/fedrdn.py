"""FedRDN, random domain normalisation (Yan & Zhu, "A Simple Data Augmentation for Feature Distribution Skewed
Federated Learning", CVPR 2025, arXiv 2306.09363; the thesis's [157], combined with Fed3R in Table 3.9).

**Algorithm** (the paper's Sec. 3, as used by the thesis, which gives no detail of its own):

1. Each client k computes the channel-wise statistics of its local images (pixels in [0, 1], before any
   normalisation): every image's per-channel mean mu_i and standard deviation sigma_i over its H x W pixels
   (population std), averaged over the client's N_k images: mu^k = (1/N_k) sum_i mu_i, sigma^k = (1/N_k) sum_i
   sigma_i. It uploads (mu^k, sigma^k), 2C numbers, and nothing else (no image, no per-image value).
2. The server keeps the bank {(mu^j, sigma^j)} of the federation's clients and sends it with the global model.
3. Training: every training image x of client k is normalised with a pair drawn uniformly from the bank (the
   client's own pair included, each client once): x_hat = (x - mu^j) / sigma^j, instead of one fixed
   normalisation. An augmentation at the input, so the model, its update and the aggregation are unchanged.
4. Evaluation: a client's local test images are normalised with its own pair (the paper's test phase); the global
   test set (no client of its own: the thesis's centralised iNaturalist test set) with the mean of the bank's
   pairs (our choice: the federation's average statistics; the paper evaluates per client only).

Where we read it: the arXiv abstract and a summary of the CVPR paper (papernotes, "Core Idea": x_hat_i^k =
(x_i^k - mu^j) / sigma^j with (mu^j, sigma^j) drawn from all clients' statistics). The averaging of image-level
statistics in step 1 and the per-client test normalisation in step 4 are our reading of the paper's Sec. 3, not
re-verified against its text here (the authors' code was announced, not found).

**FedSight's form.** The task (``classification``) feeds standardised images (x - m) / s (m, s: the training
pool's statistics, ``ClassificationTask.mean/std``); this component undoes that per batch (x = x_std * s + m) and
applies step 3 (``transform_batch``) or step 4 (a forward pre-hook of the model inside ``eval_context``, removed
on exit). The bank fills as clients are sampled: a client's pair joins it the first round it reports (the paper
collects every pair before training; with partial participation the bank is complete once every client has
been sampled, a deviation the docs name). Until the bank has a pair, evaluation falls back to the task's own
standardisation. The pairs are uploaded under ``result.extras["fedrdn"]`` (``mean``, ``std``: [C] float32 each,
declared in ``extras_spec``; a reply carrying anything else is refused by the engine's reply contract).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ..records import ClientResult
from ..registry import COMPONENTS, NoParams
from ..rng import torch_gen
from ..training import ClientContext, Component, EvalContext
from ..training.component import ExtrasSpec
from ..training.context import ServerContext, UploadContext


def per_image_statistics(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image's channel means and population stds over its pixels: ([N, C], [N, C]) in float64."""
    x = images.to(torch.float64).flatten(2)
    return x.mean(2), x.std(2, unbiased=False)


def _standardisation(task: Any) -> tuple[torch.Tensor, torch.Tensor]:
    mean, std = getattr(task, "mean", None), getattr(task, "std", None)
    if mean is None or std is None:
        raise ValueError(f"fedrdn needs a classification task standardising its images; task "
                         f"{getattr(task, 'name', task)!r} has no mean/std")
    return mean, std


class FedRDN(Component):
    name = "fedrdn"
    uploads_extras = True

    def __init__(self) -> None:
        #: client id -> (mean [C], std [C]) float32, the statistics bank (server side)
        self.bank: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- client --------------------------------------------------------------------------------
    def client_statistics(self, ctx: ClientContext) -> tuple[torch.Tensor, torch.Tensor]:
        """This client's (mean, std) over its training images, computed once and kept in its state."""
        if ctx.state is not None and (got := ctx.state.load(self.name)) is not None:
            return got["mean"].cpu(), got["std"].cpu()
        m, s = _standardisation(ctx.task)
        n, means, stds = ctx.num_examples, [], []
        for a in range(0, n, 256):
            x, _ = ctx.task.train_batch(ctx.client_id, torch.arange(a, min(a + 256, n)))
            mu, sigma = per_image_statistics(x.detach().cpu().to(torch.float64) * s.cpu().to(torch.float64)
                                             + m.cpu().to(torch.float64))
            means.append(mu)
            stds.append(sigma)
        mean = torch.cat(means).mean(0).to(torch.float32)
        std = torch.cat(stds).mean(0).to(torch.float32).clamp_min(1e-6)
        if ctx.state is not None:
            ctx.state.save(self.name, {"mean": mean, "std": std}, always=True)
        return mean, std

    def client_start(self, ctx: ClientContext) -> None:
        mean, std = self.client_statistics(ctx)
        got = ctx.broadcast.get(self.name) or {}
        ids = got.get("client", torch.zeros(0, dtype=torch.int64)).cpu()
        others = ids != ctx.client_id
        means = torch.cat([mean[None], got["mean"].cpu()[others]]) if len(ids) else mean[None]
        stds = torch.cat([std[None], got["std"].cpu()[others]]) if len(ids) else std[None]
        ctx.scratch[self.name] = {"own": (mean, std), "means": means, "stds": stds,
                                  "gen": torch_gen(ctx.seed, self.name, ctx.round, ctx.client_id)}

    def transform_batch(self, ctx: ClientContext, inputs: torch.Tensor, targets: Any) -> tuple[Any, Any]:
        """Step 3: each image normalised with a pair drawn uniformly from the bank (own pair included)."""
        sc = ctx.scratch[self.name]
        j = torch.randint(len(sc["means"]), (len(inputs),), generator=sc["gen"])
        m, s = _standardisation(ctx.task)
        dev = inputs.device
        mu = sc["means"][j].to(dev).view(len(inputs), -1, 1, 1)
        sigma = sc["stds"][j].to(dev).view(len(inputs), -1, 1, 1)
        raw = inputs * s.to(dev) + m.to(dev)
        return (raw - mu) / sigma, targets

    def client_end(self, ctx: ClientContext, result: ClientResult) -> None:
        mean, std = ctx.scratch[self.name]["own"]
        result.extras[self.name] = {"mean": mean.clone(), "std": std.clone()}

    def extras_spec(self, ctx: UploadContext) -> ExtrasSpec | None:
        if not ctx.trains:
            return None
        c = int(_standardisation(ctx.task)[0].numel()) if ctx.task is not None else "channels"
        sizes = {} if isinstance(c, int) else {"channels": (1, 4)}

        def check(group, result) -> str | None:
            if not bool((group["std"] > 0).all()):
                return "a standard deviation is not positive"
            return None

        return ExtrasSpec({"mean": ((c,), torch.float32), "std": ((c,), torch.float32)}, sizes=sizes, check=check)

    # -- server --------------------------------------------------------------------------------
    def server_round_end(self, sctx: ServerContext, results: list[ClientResult], weights: torch.Tensor) -> None:
        for r in results:
            got = r.extras.get(self.name)
            if got is not None:
                self.bank[int(r.client_id)] = (got["mean"].detach().cpu().float(), got["std"].detach().cpu().float())

    def server_broadcast(self, sctx: ServerContext) -> dict[str, torch.Tensor] | None:
        if not self.bank:
            return None
        ids = sorted(self.bank)
        return {"client": torch.tensor(ids, dtype=torch.int64),
                "mean": torch.stack([self.bank[i][0] for i in ids]), "std": torch.stack([self.bank[i][1] for i in ids])}

    def eval_pair(self, split: str | int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Step 4's (mean, std) for ``split``: a client's own pair for its local test set, the bank's mean pair
        for the global test set (and a client not yet in the bank); None while the bank is empty."""
        if not self.bank:
            return None
        if isinstance(split, int) and split in self.bank:
            return self.bank[split]
        means = torch.stack([m for m, _ in self.bank.values()])
        stds = torch.stack([s for _, s in self.bank.values()])
        return means.mean(0), stds.mean(0)

    def eval_context(self, model: nn.Module, ctx: EvalContext) -> contextlib.AbstractContextManager:
        pair = self.eval_pair(ctx.split)
        if pair is None:
            return contextlib.nullcontext()
        m, s = _standardisation(ctx.task)

        def renormalise(module: nn.Module, args: tuple) -> tuple:
            x = args[0]
            dev = x.device
            raw = x * s.to(dev) + m.to(dev)
            return ((raw - pair[0].to(dev).view(1, -1, 1, 1)) / pair[1].to(dev).view(1, -1, 1, 1), *args[1:])

        @contextlib.contextmanager
        def hooked():
            handle = model.register_forward_pre_hook(renormalise)
            try:
                yield
            finally:
                handle.remove()

        return hooked()

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        ids = sorted(self.bank)
        return {"client": torch.tensor(ids, dtype=torch.int64),
                "mean": torch.stack([self.bank[i][0] for i in ids]) if ids else torch.zeros(0),
                "std": torch.stack([self.bank[i][1] for i in ids]) if ids else torch.zeros(0)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bank = {int(i): (state["mean"][k].float(), state["std"][k].float())
                     for k, i in enumerate(state.get("client", torch.zeros(0)).tolist())}


@COMPONENTS.register("fedrdn", requires={"class_labels"},
                     help="FedRDN (Yan & Zhu 2025): clients share channel mean/std; training images normalised "
                          "with a random client's")
def _fedrdn(params: NoParams) -> FedRDN:
    return FedRDN()
