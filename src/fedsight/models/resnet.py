"""CIFAR-style ResNets (He et al. 2016): 3x3 stride-1 stem, no max-pool, BasicBlock stages.

``resnet18`` is the common CIFAR ResNet-18 of kuangliu/pytorch-cifar (64/128/256/512, [2, 2, 2, 2]);
``resnet8`` is the smallest of the CIFAR ResNet-(6n+2) family (16/32/64, n=1). Where a block changes
width or stride, the shortcut is a 1x1 conv + norm projection (as in kuangliu; the paper's CIFAR nets
used zero-padding shortcuts, which have no parameters).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from fedsight.models.base import FedModel, ModelIO, norm_capabilities, state_keys
from fedsight.models.layers import NormGroupsError, init_weights, norm_layer
from fedsight.registry import MODELS, Params


class ResNetParams(Params):
    norm: Literal["batch", "group"] = "batch"
    width: float = Field(1.0, gt=0)
    group_norm_groups: int = Field(2, gt=0)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm: str, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm1 = norm_layer(norm, cout, groups)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.norm2 = norm_layer(norm, cout, groups)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), norm_layer(norm, cout, groups)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNetBackbone(nn.Module):
    def __init__(self, widths: list[int], blocks: list[int], in_channels: int, norm: str, groups: int):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False),
            norm_layer(norm, widths[0], groups),
            nn.ReLU(inplace=True),
        )
        stages: list[nn.Module] = []
        prev = widths[0]
        for i, (w, n) in enumerate(zip(widths, blocks, strict=True)):
            strides = [1 if i == 0 else 2] + [1] * (n - 1)
            stage = []
            for s in strides:
                stage.append(BasicBlock(prev, w, s, norm, groups))
                prev = w
            stages.append(nn.Sequential(*stage))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.feature_map(x))


class ResNet(FedModel):
    def __init__(self, backbone: ResNetBackbone, feature_dim: int, num_classes: int):
        super().__init__()
        self.backbone = backbone
        self.feature_dim = feature_dim
        self.head = nn.Linear(feature_dim, num_classes)
        init_weights(self)

    def blocks(self) -> dict[str, list[str]]:
        """The stem, every residual BasicBlock (as the FedVG paper defines blocks for ResNets; its code
        groups whole stages instead), and the head."""
        return residual_blocks(self)


def residual_blocks(model: nn.Module) -> dict[str, list[str]]:
    """``FedModel.blocks`` of a model whose backbone has a ``stem`` and ``stages`` of residual blocks: the stem,
    every block, the head."""
    out = {"backbone.stem": state_keys(model.backbone.stem, "backbone.stem")}
    for i, stage in enumerate(model.backbone.stages):
        for j, block in enumerate(stage):
            out[f"backbone.stages.{i}.{j}"] = state_keys(block, f"backbone.stages.{i}.{j}")
    out["head"] = state_keys(model.head, "head")
    return out


def _resnet(p: ResNetParams, widths: list[int], blocks: list[int], *, num_classes: int, in_channels: int) -> ResNet:
    """Shared builder: scales ``widths`` by ``p.width``; under group norm every scaled width must be a multiple
    of the group count (a ``NormGroupsError`` naming the widths otherwise: they are never changed to fit)."""
    q = p.group_norm_groups if p.norm == "group" else 1
    scaled = [max(1, round(w * p.width)) for w in widths]
    if any(c % q for c in scaled):
        shown = "/".join(map(str, scaled))
        raise NormGroupsError(f"does not divide the model's widths {shown} (model.width = {p.width}); choose "
                              f"group_norm_groups dividing all of them, or another model.width")
    backbone = ResNetBackbone(scaled, blocks, in_channels, p.norm, p.group_norm_groups)
    return ResNet(backbone, scaled[-1], num_classes)


def _provides(p: ResNetParams) -> frozenset[str]:
    return frozenset({"parameter_groups", "linear_head"}) | norm_capabilities(p.norm)


@MODELS.register("resnet8", params=ResNetParams, help="CIFAR ResNet-8 (16/32/64, one BasicBlock per stage)", provides=_provides)
def resnet8(p: ResNetParams, *, io: ModelIO) -> FedModel:
    return _resnet(p, [16, 32, 64], [1, 1, 1], num_classes=io.num_outputs, in_channels=io.in_channels)


@MODELS.register("resnet18", params=ResNetParams, help="CIFAR ResNet-18 (64-512, [2, 2, 2, 2], 3x3 stem)", provides=_provides)
def resnet18(p: ResNetParams, *, io: ModelIO) -> FedModel:
    return _resnet(p, [64, 128, 256, 512], [2, 2, 2, 2], num_classes=io.num_outputs, in_channels=io.in_channels)
