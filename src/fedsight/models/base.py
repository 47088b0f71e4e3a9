"""The interface every classification model exposes.

A model is ``features`` (the backbone, ``x -> [N, feature_dim]``) followed by ``head`` (a linear
classifier). Parameter groups come from this declared structure and from module types, never from
substring matching on parameter names: ``backbone`` = everything under ``self.backbone``, ``head`` =
everything under ``self.head``, ``norm`` = parameters and buffers of normalisation layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)


class FedModel(nn.Module):
    """Base class: subclasses set ``self.backbone`` (an nn.Module mapping images to features),
    ``self.head`` (nn.Linear) and ``self.feature_dim``."""

    backbone: nn.Module
    head: nn.Linear
    feature_dim: int

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

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
        for mod_name, module in self.named_modules():
            if isinstance(module, NORM_TYPES):
                for name, _ in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
                    groups["norm"].append(f"{mod_name}.{name}")
        return {g: [k for k in names if k in keys] for g, names in groups.items()}

    def blocks(self) -> dict[str, list[str]]:
        """Named blocks of ``state_dict()`` keys (parameters and buffers), in forward order, for
        block-level methods (FedVG's block granularity, App. A.7.3 E.17). Default: one block per direct
        child of ``backbone`` that holds any state (the backbone itself if it has no children), plus
        ``head``. Families override this with their natural units (a residual block, a conv stage)."""
        children = [(f"backbone.{n}", m) for n, m in self.backbone.named_children()] or [("backbone", self.backbone)]
        out = {name: state_keys(m, name) for name, m in children}
        out["head"] = state_keys(self.head, "head")
        return {k: v for k, v in out.items() if v}


def state_keys(module: nn.Module, prefix: str) -> list[str]:
    """``state_dict()`` keys of ``module`` as seen from its parent at ``prefix``."""
    return [f"{prefix}.{k}" for k in module.state_dict(keep_vars=True)]


def save_weights(model: nn.Module, path: str | Path) -> None:
    """Write ``model.state_dict()`` as safetensors, atomically (temporary file, then rename)."""
    import os
    import tempfile

    from safetensors.torch import save_file

    path = Path(path)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(state, tmp)
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
