"""MobileNetV2 (Sandler et al. 2018): inverted residual blocks with linear bottlenecks and ReLU6.

``cifar_stem=True`` (the default) uses stride 1 in the stem and in the first stride-2 stage (the 24-channel
one), so a 32x32 image ends at 4x4 rather than 1x1; ``cifar_stem=False`` is the ImageNet configuration.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from fedsight.models.base import FedModel, ModelIO, norm_capabilities, state_keys
from fedsight.models.layers import init_weights, norm_layer
from fedsight.registry import MODELS, Params

# expansion t, output channels c, repeats n, first stride s (Table 2 of the paper)
SETTINGS = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]
STEM, LAST = 32, 1280


def _make_divisible(v: float, divisor: int = 8) -> int:
    """Round ``v`` to the nearest multiple of ``divisor``, never going more than 10% below ``v``."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class MobileNetV2Params(Params):
    width_mult: float = Field(1.0, gt=0)
    norm: Literal["batch", "group"] = "batch"
    group_norm_groups: int = Field(2, gt=0)
    dropout: float = Field(0.2, ge=0, lt=1)
    cifar_stem: bool = True


def _conv_norm_act(
    cin: int, cout: int, k: int, stride: int, norm: str, g: int, groups: int = 1, dilation: int = 1
) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride=stride, padding=dilation * (k // 2), dilation=dilation, groups=groups, bias=False),
        norm_layer(norm, cout, g),
        nn.ReLU6(inplace=True),
    )


class InvertedResidual(nn.Module):
    """``dilation`` (default 1) dilates the depthwise 3x3 convolution (DeepLab's atrous backbone)."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int, norm: str, g: int, dilation: int = 1):
        super().__init__()
        hidden = round(cin * expand)
        self.use_residual = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(_conv_norm_act(cin, hidden, 1, 1, norm, g))
        layers += [
            _conv_norm_act(hidden, hidden, 3, stride, norm, g, groups=hidden, dilation=dilation),  # depthwise
            nn.Conv2d(hidden, cout, 1, bias=False),  # linear bottleneck
            norm_layer(norm, cout, g),
        ]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x) if self.use_residual else self.block(x)


class MobileNetV2Backbone(nn.Module):
    def __init__(self, p: MobileNetV2Params, in_channels: int):
        super().__init__()
        norm, g = p.norm, p.group_norm_groups
        prev = _make_divisible(STEM * p.width_mult)
        last = _make_divisible(LAST * max(1.0, p.width_mult))
        layers: list[nn.Module] = [_conv_norm_act(in_channels, prev, 3, 1 if p.cifar_stem else 2, norm, g)]
        for i, (t, c, n, s) in enumerate(SETTINGS):
            if p.cifar_stem and i == 1:
                s = 1
            out = _make_divisible(c * p.width_mult)
            for j in range(n):
                layers.append(InvertedResidual(prev, out, s if j == 0 else 1, t, norm, g))
                prev = out
        layers.append(_conv_norm_act(prev, last, 1, 1, norm, g))
        self.features = nn.Sequential(*layers)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.dropout = nn.Dropout(p.dropout)
        self.out_channels = last

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.pool(self.features(x)))


class MobileNetV2(FedModel):
    def __init__(self, p: MobileNetV2Params, *, num_classes: int, in_channels: int):
        super().__init__()
        self.backbone = MobileNetV2Backbone(p, in_channels)
        self.feature_dim = self.backbone.out_channels
        self.head = nn.Linear(self.feature_dim, num_classes)
        init_weights(self)

    def blocks(self) -> dict[str, list[str]]:
        """The stem, every inverted residual block, the last 1x1 conv, and the head."""
        out = {f"backbone.features.{i}": state_keys(m, f"backbone.features.{i}") for i, m in enumerate(self.backbone.features)}
        out["head"] = state_keys(self.head, "head")
        return out


def _provides(p: MobileNetV2Params) -> frozenset[str]:
    return frozenset({"parameter_groups", "linear_head"}) | norm_capabilities(p.norm)


@MODELS.register("mobilenetv2", params=MobileNetV2Params, help="MobileNetV2 (CIFAR stem by default)", provides=_provides)
def mobilenetv2(p: MobileNetV2Params, *, io: ModelIO) -> FedModel:
    return MobileNetV2(p, num_classes=io.num_outputs, in_channels=io.in_channels)
