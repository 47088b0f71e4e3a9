"""The model contract every task family shares.

**Factory.** Every registered model is built as ``factory(params, *, io: ModelIO)``: ``params`` are its
validated parameters, ``io`` what the task says about inputs and outputs (channels, classes or output
channels, image size, SR scale, frames). One signature for every family, so generic code (the engine,
the conformance suite, ``fedsight list``) builds any model the same way.

**Structure.** A model is a ``FedModel``. Parameter groups come from declared structure and module
types, never from substring matching on parameter names:

* ``backbone`` and ``head``: by default everything under ``self.backbone`` and ``self.head``; a model
  whose forward is not ``head(features(x))`` (a VSR model with a global skip) overrides
  ``parameter_groups`` and sets ``split_head = False``;
* ``norm``: parameters and buffers of normalisation layers (by module type).

Optional: ``features(x)`` (the backbone's output), ``feature_maps(x)`` (multi-scale feature maps,
highest resolution first, for dense heads and feature distillation; ``multi_scale = True``) and
``blocks()`` (named units for block-level methods such as FedVG's).

**Capabilities.** A registry entry declares what its model provides (``linear_head``, ``norm_layers``,
``norm_stats``, ``parameter_groups``; ``fedsight.capabilities``) as a function of its parameters, so a
recipe that needs, say, BatchNorm statistics fails at config time; ``detect_capabilities`` reads the
same from a built model, and the conformance suite checks that the two agree for every model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)


@dataclass(frozen=True)
class ModelIO:
    """What a task tells a model factory about its inputs and outputs."""

    family: str
    in_channels: int = 3
    #: classes (classification, segmentation), keypoints, or output channels (super-resolution)
    num_outputs: int = 0
    #: the (square) training input size, for models whose layers depend on it; None if any size works
    image_size: int | None = None
    #: upscaling factor (super-resolution)
    scale: int = 1
    #: frames per input clip (video), None otherwise
    num_frames: int | None = None


class FedModel(nn.Module):
    """Base class: subclasses set ``self.backbone`` (images -> features) and ``self.head`` (a linear
    classifier for classification, a dense head otherwise) and ``self.feature_dim`` where it exists."""

    backbone: nn.Module
    head: nn.Module
    feature_dim: int
    #: whether ``forward(x) == head(features(x))`` (cost accounting and Fed3R rely on it)
    split_head: bool = True
    #: whether ``feature_maps`` is implemented
    multi_scale: bool = False
    #: whether ``forward`` folds another dimension into the batch (a video model's frames: its layers see ``B T``
    #: rows), so a layer's per-sample gradients are per frame, not per example (``dp_sgd`` refuses such a model
    #: unless it trains vectorised, which takes each example's gradient alone)
    folds_batch: bool = False

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def feature_maps(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Multi-scale feature maps, highest resolution first (models with ``multi_scale = True``)."""
        raise NotImplementedError(f"{type(self).__name__} has no multi-scale feature maps")

    def parameter_groups(self) -> dict[str, list[str]]:
        """Qualified names of parameters *and* buffers in each declared group.

        Groups: ``backbone``, ``head``, ``norm`` (a norm layer inside the backbone is in both
        ``backbone`` and ``norm``). Names match ``state_dict()`` keys.
        """
        groups: dict[str, list[str]] = {"backbone": [], "head": [], "norm": []}
        keys = set(self.state_dict(keep_vars=True))  # non-persistent buffers (Fed3R-RF's map) are not state
        for part in ("backbone", "head"):
            module = getattr(self, part)
            for name, _ in list(module.named_parameters()) + list(module.named_buffers()):
                groups[part].append(f"{part}.{name}")
        groups["norm"] = norm_keys(self)
        return {g: [k for k in names if k in keys] for g, names in groups.items()}

    def blocks(self) -> dict[str, list[str]]:
        """Named blocks of ``state_dict()`` keys (parameters and buffers), in forward order, for
        block-level methods (FedVG's block granularity, App. A.7.3 E.17). Default: one block per direct
        child of ``backbone`` that holds any state (the backbone itself if it has no children), plus
        ``head``; a model without a backbone attribute: one block per direct child. Families override
        this with their natural units (a residual block, a conv stage)."""
        if not hasattr(self, "backbone"):
            out = {name: state_keys(m, name) for name, m in self.named_children()}
            return {k: v for k, v in out.items() if v}
        children = [(f"backbone.{n}", m) for n, m in self.backbone.named_children()] or [("backbone", self.backbone)]
        out = {name: state_keys(m, name) for name, m in children}
        out["head"] = state_keys(self.head, "head")
        return {k: v for k, v in out.items() if v}


def norm_keys(model: nn.Module) -> list[str]:
    """State keys (parameters and buffers) of the model's normalisation layers, found by module type."""
    out = []
    for mod_name, module in model.named_modules():
        if isinstance(module, NORM_TYPES):
            prefix = f"{mod_name}." if mod_name else ""
            for name, _ in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
                out.append(prefix + name)
    return out


def detect_capabilities(model: nn.Module) -> frozenset[str]:
    """The model capabilities (``fedsight.capabilities``) a built model has, read from its structure."""
    out = set()
    if callable(getattr(model, "parameter_groups", None)):
        out.add("parameter_groups")
    head = getattr(model, "head", None)
    # a head that wraps its linear classifier (Fed3R-RF's random-feature map + linear) still is one
    linear = head if isinstance(head, nn.Linear) else getattr(head, "linear", None)
    if isinstance(linear, nn.Linear) and getattr(model, "split_head", False):
        out.add("linear_head")
    norms = [m for m in model.modules() if isinstance(m, NORM_TYPES)]
    if norms:
        out.add("norm_layers")
    if any(isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats for m in norms):
        out.add("norm_stats")
    return frozenset(out)


def norm_capabilities(norm: str) -> frozenset[str]:
    """The capabilities a ``norm`` parameter ("batch", "group", "none") gives a model family."""
    return frozenset({"batch": {"norm_layers", "norm_stats"}, "group": {"norm_layers"}}.get(norm, set()))


def state_keys(module: nn.Module, prefix: str) -> list[str]:
    """``state_dict()`` keys of ``module`` as seen from its parent at ``prefix``."""
    return [f"{prefix}.{k}" for k in module.state_dict(keep_vars=True)]


def save_weights(model: nn.Module, path: str | Path) -> None:
    """Write ``model.state_dict()`` as safetensors, atomically (temporary file, then rename)."""
    import os
    import tempfile

    from safetensors.torch import save_file

    from ..safe_write import file_mode

    path = Path(path)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(state, tmp)
        os.chmod(tmp, file_mode(path))  # not mkstemp's 0600: the mode of any file written there
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_weights(path: str | Path, what: str = "weights") -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; a missing or unreadable file raises an error naming it."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} file not found: {path}")
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None


def load_weights(model: nn.Module, path: str | Path, strict: bool = True) -> None:
    """Load a safetensors file into ``model``; a missing file or mismatched keys name the file."""
    path = Path(path)
    state = read_weights(path)
    if not set(state) & set(model.state_dict()):
        raise ValueError(
            f"{path}: none of its {len(state)} entries is a key of the model (file keys: {sorted(state)[:5]}); "
            "is it the weights of another model?"
        )
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shape mismatch
        raise ValueError(f"{path}: weights do not match the model ({exc})") from None
    if strict and (missing or unexpected):
        raise ValueError(
            f"{path}: weights do not match the model (missing: {sorted(missing)[:5]}, unexpected: {sorted(unexpected)[:5]})"
        )


@contextlib.contextmanager
def swap_entries(model: nn.Module, values: dict[str, torch.Tensor]) -> Iterator[None]:
    """Temporarily copy ``values`` into the model's state entries (in place), restoring them on exit."""
    state = model.state_dict(keep_vars=True)
    saved = {k: state[k].detach().clone() for k in values}
    try:
        with torch.no_grad():
            for k, v in values.items():
                state[k].copy_(v)
        yield
    finally:
        with torch.no_grad():
            for k, v in saved.items():
                state[k].copy_(v)
