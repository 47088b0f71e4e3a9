"""ImageNet ResNets (He et al. 2016) in torchvision's layout, so torchvision's published checkpoints load.

The architecture is torchvision's ``resnet18`` / ``resnet34`` / ``resnet50`` (the "ResNet v1.5" of its
``models/resnet.py``: in a Bottleneck the stride sits on the 3x3 convolution, not the first 1x1): a 7x7 stride-2
stem convolution, BatchNorm, ReLU and a 3x3 stride-2 max-pool; four stages of BasicBlocks (expansion 1) or
Bottlenecks (expansion 4) at 64/128/256/512 planes, the first block of stages 2-4 at stride 2 and a 1x1 projection
shortcut (``downsample``) wherever the stride or the width changes; global average pooling; a linear classifier.

Module names are torchvision's under FedSight's ``backbone`` / ``head`` split: torchvision's ``conv1.weight`` is
``backbone.conv1.weight``, its ``layer3.1.downsample.0.weight`` is ``backbone.layer3.1.downsample.0.weight`` and its
``fc`` is ``head`` (``fedsight.weights`` converts the keys). Initialisation is torchvision's default: Kaiming-normal
(fan_out, ReLU) convolutions, norm weights 1 and biases 0, PyTorch's default Linear (``zero_init_residual`` off).

These are the ImageNet networks: on 32x32 CIFAR images they downsample to 1x1 by the last stage; the CIFAR ResNets
(``resnet8``, ``resnet18``) keep the resolution and are the better choice there when training from scratch.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from fedsight.models.base import FedModel, ModelIO, norm_capabilities, state_keys
from fedsight.models.layers import init_weights, norm_layer
from fedsight.registry import MODELS, Params

#: name -> (block type, blocks per stage), as torchvision defines them
ARCHS: dict[str, tuple[str, list[int]]] = {
    "resnet18": ("basic", [2, 2, 2, 2]),
    "resnet34": ("basic", [3, 4, 6, 3]),
    "resnet50": ("bottleneck", [3, 4, 6, 3]),
}
PLANES = (64, 128, 256, 512)


class ImageNetResNetParams(Params):
    norm: Literal["batch", "group"] = Field("batch", description="batch (loads torchvision's statistics) or group")
    group_norm_groups: int = Field(32, gt=0, description="groups of GroupNorm (norm = group)")


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int, norm: str, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = norm_layer(norm, planes, groups)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = norm_layer(norm, planes, groups)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(cin, planes * self.expansion, stride, norm, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int, norm: str, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = norm_layer(norm, planes, groups)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)  # v1.5: stride here
        self.bn2 = norm_layer(norm, planes, groups)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = norm_layer(norm, planes * self.expansion, groups)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(cin, planes * self.expansion, stride, norm, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


def _downsample(cin: int, cout: int, stride: int, norm: str, groups: int) -> nn.Module | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), norm_layer(norm, cout, groups))


class ImageNetResNetBackbone(nn.Module):
    def __init__(self, arch: str, in_channels: int, norm: str, groups: int):
        super().__init__()
        kind, blocks = ARCHS[arch]
        block = BasicBlock if kind == "basic" else Bottleneck
        self.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = norm_layer(norm, 64, groups)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        cin = 64
        for i, (planes, n) in enumerate(zip(PLANES, blocks, strict=True)):
            layer = []
            for j in range(n):
                layer.append(block(cin, planes, 2 if i > 0 and j == 0 else 1, norm, groups))
                cin = planes * block.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*layer))
        self.out_channels = cin
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.feature_map(x))


class ImageNetResNet(FedModel):
    def __init__(self, arch: str, p: ImageNetResNetParams, *, num_classes: int, in_channels: int):
        super().__init__()
        self.backbone = ImageNetResNetBackbone(arch, in_channels, p.norm, p.group_norm_groups)
        self.feature_dim = self.backbone.out_channels
        self.head = nn.Linear(self.feature_dim, num_classes)
        init_weights(self)

    def blocks(self) -> dict[str, list[str]]:
        """The stem (conv1, bn1), every residual block, and the head (the blocks FedVG scores for ResNets)."""
        b = self.backbone
        out = {"backbone.stem": state_keys(b.conv1, "backbone.conv1") + state_keys(b.bn1, "backbone.bn1")}
        for i in range(1, 5):
            for j, block in enumerate(getattr(b, f"layer{i}")):
                out[f"backbone.layer{i}.{j}"] = state_keys(block, f"backbone.layer{i}.{j}")
        out["head"] = state_keys(self.head, "head")
        return out


def _provides(p: ImageNetResNetParams) -> frozenset[str]:
    return frozenset({"parameter_groups", "linear_head"}) | norm_capabilities(p.norm)


def _register(arch: str, help: str) -> None:
    def build(p: ImageNetResNetParams, *, io: ModelIO) -> FedModel:
        return ImageNetResNet(arch, p, num_classes=io.num_outputs, in_channels=io.in_channels)

    MODELS.register(f"{arch}_imagenet", params=ImageNetResNetParams, help=help, provides=_provides)(build)


_register("resnet18", "ImageNet ResNet-18 in torchvision's layout (7x7 stem, max-pool; loads torchvision weights)")
_register("resnet34", "ImageNet ResNet-34 in torchvision's layout (loads torchvision weights)")
_register("resnet50", "ImageNet ResNet-50 (v1.5 Bottleneck) in torchvision's layout (loads torchvision weights)")
