"""Small building blocks shared by the model families: normalisation choice and standard init."""

from __future__ import annotations

from torch import nn

from fedsight.models.base import NORM_TYPES


class NormGroupsError(ValueError):
    """A group-norm group count that does not divide a layer's channels (found at config time by building the
    model on the meta device, ``fedsight.config.model_problems``)."""


def norm_layer(kind: str, channels: int, groups: int = 2) -> nn.Module:
    """A 2-d normalisation layer: ``batch`` (BatchNorm2d), ``group`` (GroupNorm) or ``none`` (Identity)."""
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        if channels % groups:
            raise NormGroupsError(f"a layer has {channels} channels which {groups} groups do not divide")
        return nn.GroupNorm(groups, channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm {kind!r}")


def init_weights(model: nn.Module) -> None:
    """Kaiming-normal (fan_out, ReLU) convolutions with zero bias, norm weight 1 and bias 0.

    Linear layers keep PyTorch's default init. Draws come from torch's global RNG, so a model built
    after ``torch.manual_seed`` is reproducible.
    """
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, NORM_TYPES) and getattr(m, "weight", None) is not None:
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
