"""A frozen feature extractor pre-trained on a public split held by the server (``[pretrain]``).

Fed3R (thesis ch. 3) assumes a frozen pre-trained backbone phi, f = psi o phi: the clients only send
the statistics A_k = Z_k^T Z_k and b_k of Z_k = phi(X_k) for the closed-form ridge classifier
W = (lambda I + sum_k A_k)^{-1} sum_k b_k (thesis eqs. 3.23-3.26), and the fine-tuning stages start
from phi. The thesis uses ImageNet weights; none can be downloaded
here, so FedSight pre-trains phi itself, centrally, on a *public* split that only the server holds:

* ``source = "samples"``: the server's split P is cut out of the training pool (after the validation
  carve-out, so P is also disjoint from the server validation set V) before the pool is partitioned.
  No client ever holds an example of P. Class c contributes ``round(fraction * n_c)`` of its n_c pool
  examples (round half up), drawn uniformly from stream ``np_rng(seed, "pretrain")``; with
  ``classes`` only the listed classes contribute (a class-disjoint transfer setting: phi never sees the
  other classes). Every class must keep at least one example for the clients.
* pre-training: the task's model is initialised from stream ``"pretrain-init"`` and trained with SGD
  on the cross-entropy of P for ``epochs`` passes, batches shuffled by ``torch_gen(seed,
  "pretrain-shuffle", epoch)``. Only the backbone (``model.parameter_groups()["backbone"]``, i.e. phi)
  is written, as safetensors; the classifier of the federated run is its own seeded initialisation
  (or Fed3R's closed-form solution). A JSON sidecar (``<file>.json``) records the setup, the per-epoch
  training loss and the pre-trained model's accuracy on the global test set with its own head.
* caching: unless ``weights`` names a file, the extractor lives at
  ``<run.output_dir>/pretrained/<key>.safetensors`` where ``key`` hashes the data, model, pretrain and
  validation sections and the seed, so every run (and variant) with the same setup shares one file and
  ``fedsight run`` pre-trains only when that file is missing. The same config gives a bit-identical
  file.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, field_validator, model_validator
from torch import nn

from .device import model_device, to_device
from .errors import ConfigError
from .registry import Params, off_but_set
from .rng import PROCESS_STREAM, derive_seed, seed_torch, torch_gen

#: bumped when the pre-training procedure changes, so cached extractors of an older procedure are not reused
PRETRAIN_VERSION = 1


class PretrainSection(Params):
    """``[pretrain]``: a feature extractor pre-trained by the server on a split no client holds."""

    source: Literal["none", "samples"] = Field(
        "none", description="none; samples: pre-train on a stratified split carved out of the training pool"
    )
    fraction: float = Field(0.3, gt=0, lt=1, description="share of each (listed) class's pool examples the server holds")
    classes: list[int] | None = Field(
        None, description="take the server's split only from these class indices (class-disjoint transfer)"
    )
    epochs: int = Field(10, ge=1, description="pre-training passes over the server's split",
                        json_schema_extra={"smoke": 1})
    batch_size: int = Field(64, ge=1)
    lr: float = Field(0.05, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(5e-4, ge=0)
    weights: str | None = Field(
        None, description="safetensors file of the extractor (default: <run.output_dir>/pretrained/<key>.safetensors)"
    )

    @field_validator("classes")
    @classmethod
    def _classes(cls, value: list[int] | None) -> list[int] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("an empty list takes no class; leave pretrain.classes unset to use every class")
        if any(c < 0 for c in value):
            raise ValueError("class indices are >= 0")
        if len(set(value)) != len(value):
            raise ValueError(f"class {sorted(c for c in set(value) if value.count(c) > 1)} listed twice")
        return sorted(value)

    @model_validator(mode="after")
    def _used(self) -> "PretrainSection":
        if self.source == "none":
            off_but_set(self, "pretrain", "nothing is pre-trained")
        return self


# -- where the extractor lives ----------------------------------------------------------------------


def pretrain_key(cfg: Any) -> str:
    """A short hash of everything that determines the extractor: data, model, pretrain (without the
    file name) and validation sections, the seed and the procedure's version."""
    dump = cfg.model_dump(mode="json")
    pre = {k: v for k, v in dump["pretrain"].items() if k != "weights"}
    what = {
        "version": PRETRAIN_VERSION,
        "seed": dump["seed"],
        "task": dump["task"],
        "data": dump["data"],
        "model": dump["model"],
        "validation": dump["validation"],
        "pretrain": pre,
    }
    text = json.dumps(what, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def pretrain_weights_path(cfg: Any) -> Path:
    """``pretrain.weights`` if set, else ``<run.output_dir>/pretrained/<pretrain_key(cfg)>.safetensors``."""
    if cfg.pretrain.weights is not None:
        return Path(cfg.pretrain.weights)
    return Path(cfg.run.output_dir) / "pretrained" / f"{pretrain_key(cfg)}.safetensors"


def sidecar_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".json")


# -- pre-training -----------------------------------------------------------------------------------


@dataclass
class PretrainResult:
    path: Path  # the backbone weights (safetensors)
    meta_path: Path  # the JSON sidecar
    train_loss: list[float]  # mean cross-entropy of each epoch
    test: dict[str, float]  # the pre-trained model (own head) on the global test set: acc, loss
    num_examples: int  # |P|
    class_counts: list[int]
    backbone_keys: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _supports_pretrain(task: Any) -> bool:
    return hasattr(task, "pretrain_batches") and hasattr(task, "num_pretrain_examples")


def _require_support(cfg: Any, task: Any) -> None:

    if not _supports_pretrain(task):
        raise ConfigError(f"task {cfg.task.name!r} does not support a pretrain section; set pretrain.source = \"none\"")
    if task.num_pretrain_examples() == 0:
        raise ConfigError('pretrain: the task holds no server split; set pretrain.source = "samples"')


def backbone_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The backbone (phi) entries of ``model.state_dict()``: parameters and buffers, detached, on CPU."""
    keys = set(model.parameter_groups()["backbone"])
    return {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items() if k in keys}


@torch.no_grad()
def _test_metrics(task: Any, model: nn.Module, batch_size: int, classes: list[int] | None) -> dict[str, float]:
    metrics = dict(task.evaluate(model, "test", batch_size))
    if classes is not None:  # accuracy on the test examples of the classes the extractor saw
        was = model.training
        model.eval()
        device = model_device(model)
        listed = torch.tensor(classes, device=device)
        correct = n = 0
        for xb, yb in task.eval_batches("test", batch_size):
            xb, yb = to_device(xb, device), to_device(yb, device)
            keep = torch.isin(yb, listed)
            if keep.any():
                correct += int((model(xb[keep]).argmax(1) == yb[keep]).sum())
                n += int(keep.sum())
        model.train(was)
        if n:
            metrics["acc_pretrain_classes"] = correct / n
    return metrics


def pretrain(
    cfg: Any,
    task: Any,
    out: str | Path | None = None,
    progress: Callable[[int, float], None] | None = None,
    device: torch.device | str = "cpu",
) -> PretrainResult:
    """Pre-train the task's model centrally on the server's split and write its backbone to ``out``
    (default ``pretrain_weights_path(cfg)``) plus a JSON sidecar; ``progress(epoch, mean_loss)`` is
    called after each epoch. Torch's global RNG is left as it was."""
    from safetensors.torch import save

    from .runs import atomic_write_bytes, atomic_write_text

    p = cfg.pretrain
    if p.source == "none":
        raise ConfigError('pretrain.source = "none": nothing to pre-train on; set pretrain.source = "samples"')
    _require_support(cfg, task)
    path = Path(out) if out is not None else pretrain_weights_path(cfg)
    start = time.perf_counter()
    with PROCESS_STREAM, torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(cfg.seed, "pretrain-init"))
        model = task.build_model().to(device)
        if not hasattr(model, "parameter_groups"):
            raise ConfigError(f"model {cfg.model.name!r} has no backbone/head structure to pre-train")
        opt = torch.optim.SGD(model.parameters(), lr=p.lr, momentum=p.momentum, weight_decay=p.weight_decay)
        model.train()
        losses: list[float] = []
        for epoch in range(p.epochs):
            seed_torch(cfg.seed, "pretrain-dropout", epoch)
            total = torch.zeros((), dtype=torch.float64, device=device)
            n = 0
            for xb, yb in task.pretrain_batches(p.batch_size, torch_gen(cfg.seed, "pretrain-shuffle", epoch)):
                xb, yb = to_device(xb, model_device(model)), to_device(yb, model_device(model))
                loss = task.loss(model(xb), yb)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += loss.detach().double() * len(yb)
                n += len(yb)
            losses.append(float(total) / n)
            if not math.isfinite(losses[-1]):
                raise ValueError(
                    f"pretraining diverged in epoch {epoch + 1} (loss {losses[-1]}); lower pretrain.lr (now {p.lr})"
                )
            if progress is not None:
                progress(epoch + 1, losses[-1])
        test = _test_metrics(task, model, cfg.eval.batch_size, p.classes)
    state = backbone_state(model)
    counts = task.pretrain_class_counts()
    meta = {
        "weights": path.name,
        "key": pretrain_key(cfg),
        "seed": cfg.seed,
        "pretrain": p.model_dump(mode="json"),
        "data": cfg.data.model_dump(mode="json"),
        "model": cfg.model.model_dump(mode="json"),
        "validation": cfg.validation.model_dump(mode="json"),
        "num_examples": int(sum(counts)),
        "class_counts": [int(c) for c in counts],
        "train_loss": losses,
        "test": test,
        "backbone_keys": sorted(state),
        "seconds": round(time.perf_counter() - start, 3),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    # the sidecar first: the weights file appearing is what marks a finished pre-training
    atomic_write_text(sidecar_path(path), json.dumps(meta, indent=1) + "\n")
    # one metadata entry only: safetensors writes metadata from a hash map, so several entries would come
    # out in a varying order and the file would not be bit-identical across runs
    atomic_write_bytes(path, save(state, metadata={"format": "pt"}))
    return PretrainResult(path, sidecar_path(path), losses, test, meta["num_examples"], meta["class_counts"],
                          sorted(state), meta["seconds"])


def ensure_pretrained(cfg: Any, task: Any, device: torch.device | str = "cpu") -> Path:
    """The extractor file of ``cfg``, pre-training it first when it does not exist yet."""
    _require_support(cfg, task)
    path = pretrain_weights_path(cfg)
    if not path.is_file():
        pretrain(cfg, task, path, device=device)
    return path


def load_backbone(model: nn.Module, path: str | Path) -> None:
    """Load a pre-trained extractor into ``model``: every backbone entry of the model must be in the file
    with the model's shape; head entries may be missing (present ones are loaded); anything else is
    an error. Errors are ValueErrors (FileNotFoundError for a missing file) naming the file."""
    from .models.base import read_weights

    path = Path(path)
    state = read_weights(path, "pretrained weights")
    groups = model.parameter_groups()
    backbone, head = set(groups["backbone"]), set(groups["head"])
    missing = sorted(backbone - set(state))
    unexpected = sorted(set(state) - backbone - head)
    if missing or unexpected:
        raise ValueError(
            f"{path}: not a pre-trained extractor of this model (missing backbone entries: {missing[:5]}"
            f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}; unexpected entries: {unexpected[:5]})"
        )
    own = model.state_dict()
    wrong = [f"{k} {tuple(v.shape)} vs model {tuple(own[k].shape)}" for k, v in state.items() if v.shape != own[k].shape]
    if wrong:
        raise ValueError(f"{path}: weights do not match the model's shapes ({'; '.join(wrong[:3])})")
    model.load_state_dict(state, strict=False)


__all__ = [
    "PretrainSection",
    "PretrainResult",
    "pretrain",
    "ensure_pretrained",
    "load_backbone",
    "pretrain_weights_path",
    "pretrain_key",
]
