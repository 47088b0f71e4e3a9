"""DeepLabV3 (Chen et al. 2017, "Rethinking Atrous Convolution for Semantic Image Segmentation") and
DeepLabV3+ (Chen et al. 2018, "Encoder-Decoder with Atrous Separable Convolution") on a MobileNetV2
backbone, in plain PyTorch.

**Backbone.** MobileNetV2 in its ImageNet configuration (``fedsight.models.mobilenetv2``'s blocks, with
the same module names ``backbone.features.<i>``, so the classification model's backbone weights load
into it). Its stride-2 layers sit at strides 2 (stem), 4 (24 ch), 8 (32 ch), 16 (64 ch) and 32 (160 ch).
Beyond ``output_stride`` (8, 16 or 32) a stage keeps stride 1 and dilates its depthwise convolutions
instead, as DeepLab does: the stage's first block keeps the previous rate and the following blocks use
the rate multiplied by the skipped stride (TF DeepLab's ``output_stride`` logic, torchvision's
``replace_stride_with_dilation``). So at OS 16 the 160- and 320-channel blocks use rate 2 (the first
160 block rate 1); at OS 8 the 64/96 blocks use rate 2 and the 160/320 blocks rate 4. Every stride-2
layer maps n to ceil(n/2), so the map before the head is ``ceil(H/OS) x ceil(W/OS)``.

**Head** (``head_style``):

* ``"deeplabv3"`` (the default at OS 8 and 16): the MobileNetV2 paper's DeepLabV3 (Sandler et al. 2018,
  Sec. 6.3, Table 7): ASPP on the second-to-last feature map (320 channels, without MobileNetV2's final
  1x1 conv): a 1x1 branch, one 3x3 branch per atrous rate, image pooling (global average pool -> 1x1 ->
  upsample), each conv -> norm -> ReLU with ``aspp_channels`` (256) outputs, concatenated, projected by
  1x1 conv -> norm -> ReLU, dropout, and a 1x1 classifier. Rates (6, 12, 18) at OS 16, doubled (12, 24, 36)
  at OS 8. 4,523,541 parameters with 21 classes (published: 4.52M); ``atrous_rates=()`` gives the
  paper's no-ASPP head (1x1 + image pooling), 2,113,557 (published: 2.11M).
* ``"torchvision"`` (the default at OS 32): torchvision's ``DeepLabHead`` as the LADD code uses it: ASPP
  on the full 1280-channel MobileNetV2 feature map (final 1x1 conv included) with rates (12, 24, 36),
  dropout 0.5 after the projection, then 3x3 conv -> norm -> ReLU and the 1x1 classifier.

**The FedDrive authors' definition.** Their DeepLabV3-MobileNetV2 is LADD's (``Erosinho13/LADD``
``src/modules/deeplabv3.py``; FedDrive's own code has BiSeNetV2 only): torchvision's ``DeepLabV3`` and
``DeepLabHead(1280)`` on d-li14's MobileNetV2 ``features`` without dilation, i.e. ``output_stride = 32`` here (the
``torchvision`` head). Compared layer by layer it is this model: the same blocks, ReLU6 in the backbone, ReLU in
the head, BatchNorm defaults, rates (12, 24, 36), dropout 0.5; 12,652,563 parameters at 19 classes (12,651,021 at
CrossCity's 13), equal to the count of LADD's state dict. Its checkpoints load with the ``ladd`` layout, and an
ImageNet MobileNetV2 (d-li14's, which LADD's code loads, or torchvision's) into any of these backbones
(``adapt_checkpoint`` leaves out its classifier and, at OS 8/16, its final 1x1 conv). torchvision's
``deeplabv3_mobilenet_v3_large`` is another model (MobileNetV3-Large backbone, ASPP on 960 channels, an auxiliary
head) and is refused by name.

``deeplabv3plus_mobilenetv2`` (OS 8 or 16) adds the DeepLabV3+ decoder: the stride-4 stage's 24-channel
map is reduced by 1x1 conv -> norm -> ReLU to ``low_level_channels`` (48), the ASPP output is upsampled
(bilinear) to its size and concatenated, then two 3x3 conv -> norm -> ReLU with ``decoder_channels``
(256; the paper's best decoder, its Table 3) and the 1x1 classifier.

**Output contract.** ``forward(x)`` on ``[B, 3, H, W]`` returns class logits ``[B, C, H, W]`` at the
input resolution (bilinear, ``align_corners=False``) for any H, W, in train and eval mode alike. The
image-pooling branch normalises a ``[B, C, 1, 1]`` map, so BatchNorm in training mode needs a batch of at
least 2 (as in torchvision). ``features(x)`` is the map the head takes (``ceil(H/OS)``);
``feature_maps(x)`` the backbone's pyramid: the ends of the 16-, 24-, 32- and 96-channel stages (strides
2, 4, 8, min(16, OS)) and the head's input (OS), highest resolution first. Parameter groups: ``backbone``
= MobileNetV2 features, ``head`` = ASPP, decoder and classifier.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedsight.models.base import FedModel, ModelIO, norm_capabilities, state_keys
from fedsight.models.layers import init_weights, norm_layer
from fedsight.models.mobilenetv2 import (
    LAST,
    SETTINGS,
    STEM,
    InvertedResidual,
    _conv_norm_act,
    _make_divisible,
)
from fedsight.registry import MODELS, Params

__all__ = ["ASPP", "DeepLabV3", "DeepLabV3Params", "DeepLabV3PlusParams", "MobileNetV2Features", "default_rates"]

#: index in ``backbone.features`` of the last block of each stage of SETTINGS (stem = 0)
STAGE_ENDS = tuple(sum(n for _, _, n, _ in SETTINGS[: i + 1]) for i in range(len(SETTINGS)))  # (1, 3, 6, 10, 13, 16, 17)
#: the stages whose outputs feature_maps returns below the head's input: 16, 24, 32 and 96 channels
PYRAMID_STAGES = (0, 1, 2, 4)
LOW_LEVEL_STAGE = 1  # the 24-channel, stride-4 stage


def default_rates(output_stride: int) -> tuple[int, ...]:
    """DeepLab's ASPP rates: (6, 12, 18) at OS 16, doubled at OS 8; (12, 24, 36) at OS 32 (torchvision)."""
    return {8: (12, 24, 36), 16: (6, 12, 18), 32: (12, 24, 36)}[output_stride]


class _DeepLabCommon(Params):
    width_mult: float = Field(1.0, gt=0, description="MobileNetV2 width multiplier")
    aspp_channels: int = Field(256, ge=1, description="channels of every ASPP branch and of its projection")
    atrous_rates: tuple[Annotated[int, Field(gt=0)], ...] | None = Field(
        None, description="ASPP rates; default (6, 12, 18) at OS 16, (12, 24, 36) at OS 8 and 32; () for no atrous branches"
    )
    dropout: float | None = Field(None, ge=0, lt=1, description="dropout after the ASPP projection (default 0.1; 0.5 torchvision-style)")
    norm: Literal["batch", "group"] = "batch"
    group_norm_groups: int = Field(2, gt=0)


class DeepLabV3Params(_DeepLabCommon):
    output_stride: Literal[8, 16, 32] = Field(16, description="backbone output stride; dilation replaces stride beyond it")
    head_style: Literal["deeplabv3", "torchvision"] | None = Field(
        None, description="'deeplabv3': ASPP on the 320-ch map (MobileNetV2 paper); 'torchvision': on the 1280-ch map "
        "+ 3x3 conv (LADD); default torchvision at OS 32, deeplabv3 otherwise",
    )


class DeepLabV3PlusParams(_DeepLabCommon):
    output_stride: Literal[8, 16] = Field(16, description="backbone output stride; dilation replaces stride beyond it")
    low_level_channels: int = Field(48, ge=1, description="channels the stride-4 skip is reduced to")
    decoder_channels: int = Field(256, ge=1, description="channels of the decoder's two 3x3 convs")


class MobileNetV2Features(nn.Module):
    """MobileNetV2's feature extractor (ImageNet stem) with dilation beyond ``output_stride``;
    ``include_last``: keep the final 1x1 conv to 1280 channels."""

    def __init__(self, in_channels: int, width_mult: float, output_stride: int, include_last: bool, norm: str, g: int):
        super().__init__()
        prev = _make_divisible(STEM * width_mult)
        layers: list[nn.Module] = [_conv_norm_act(in_channels, prev, 3, 2, norm, g)]
        stride, dilation = 2, 1
        self.stage_channels: list[int] = []
        for t, c, n, s in SETTINGS:
            out = _make_divisible(c * width_mult)
            for j in range(n):
                block_stride, block_dilation = (s if j == 0 else 1), dilation
                if block_stride > 1:
                    if stride >= output_stride:  # dilate instead: this block keeps the rate, later ones use it x s
                        block_stride, dilation = 1, dilation * s
                    else:
                        stride *= s
                layers.append(InvertedResidual(prev, out, block_stride, t, norm, g, dilation=block_dilation))
                prev = out
            self.stage_channels.append(out)
        if include_last:
            last = _make_divisible(LAST * max(1.0, width_mult))
            layers.append(_conv_norm_act(prev, last, 1, 1, norm, g))
            prev = last
        self.features = nn.Sequential(*layers)
        self.out_channels = prev
        self.output_stride = stride

    def taps(self, x: torch.Tensor, indices: tuple[int, ...]) -> dict[int, torch.Tensor]:
        """Outputs of ``features[i]`` for each ``i`` in ``indices`` (and of the last layer, key -1)."""
        out = {}
        for i, layer in enumerate(self.features):
            x = layer(x)
            if i in indices:
                out[i] = x
        out[-1] = x
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


def _cna(cin: int, cout: int, k: int, norm: str, g: int, dilation: int = 1) -> nn.Sequential:
    """conv (no bias) -> norm -> ReLU, 'same' padding."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, padding=dilation * (k // 2), dilation=dilation, bias=False), norm_layer(norm, cout, g), nn.ReLU(inplace=True)
    )


class ASPPPooling(nn.Module):
    def __init__(self, cin: int, cout: int, norm: str, g: int):
        super().__init__()
        self.conv = _cna(cin, cout, 1, norm, g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(F.adaptive_avg_pool2d(x, 1))
        return F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)


class ASPP(nn.Module):
    """Atrous spatial pyramid pooling: 1x1, one 3x3 per rate, image pooling; concatenated and projected."""

    def __init__(self, cin: int, cout: int, rates: tuple[int, ...], dropout: float, norm: str, g: int):
        super().__init__()
        self.branches = nn.ModuleList(
            [_cna(cin, cout, 1, norm, g)] + [_cna(cin, cout, 3, norm, g, dilation=r) for r in rates] + [ASPPPooling(cin, cout, norm, g)]
        )
        self.project = nn.Sequential(*_cna(len(self.branches) * cout, cout, 1, norm, g), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(torch.cat([b(x) for b in self.branches], dim=1))


class DeepLabHead(nn.Module):
    """ASPP, (torchvision style) 3x3 conv -> norm -> ReLU, 1x1 classifier."""

    def __init__(self, cin: int, num_classes: int, channels: int, rates: tuple[int, ...], dropout: float,
                 extra_conv: bool, norm: str, g: int):
        super().__init__()
        self.aspp = ASPP(cin, channels, rates, dropout, norm, g)
        self.conv = _cna(channels, channels, 3, norm, g) if extra_conv else nn.Identity()
        self.classifier = nn.Conv2d(channels, num_classes, 1)

    def forward(self, x: torch.Tensor, low_level: torch.Tensor | None = None) -> torch.Tensor:
        return self.classifier(self.conv(self.aspp(x)))


class DeepLabV3PlusHead(nn.Module):
    """ASPP, then the decoder: reduce the stride-4 skip, concatenate, two 3x3 convs, 1x1 classifier."""

    def __init__(self, cin: int, low_in: int, num_classes: int, p: DeepLabV3PlusParams, rates: tuple[int, ...], dropout: float):
        super().__init__()
        norm, g = p.norm, p.group_norm_groups
        self.aspp = ASPP(cin, p.aspp_channels, rates, dropout, norm, g)
        self.reduce = _cna(low_in, p.low_level_channels, 1, norm, g)
        self.decoder = nn.Sequential(
            _cna(p.aspp_channels + p.low_level_channels, p.decoder_channels, 3, norm, g),
            _cna(p.decoder_channels, p.decoder_channels, 3, norm, g),
        )
        self.classifier = nn.Conv2d(p.decoder_channels, num_classes, 1)

    def forward(self, x: torch.Tensor, low_level: torch.Tensor | None = None) -> torch.Tensor:
        assert low_level is not None
        low = self.reduce(low_level)
        y = F.interpolate(self.aspp(x), size=low.shape[-2:], mode="bilinear", align_corners=False)
        return self.classifier(self.decoder(torch.cat([y, low], dim=1)))


class DeepLabV3(FedModel):
    """DeepLabV3 / DeepLabV3+ on MobileNetV2; see the module docstring."""

    split_head = False
    multi_scale = True

    def __init__(self, p: DeepLabV3Params | DeepLabV3PlusParams, *, num_classes: int, in_channels: int = 3):
        super().__init__()
        self.plus = isinstance(p, DeepLabV3PlusParams)
        style = "deeplabv3" if self.plus else (p.head_style or ("torchvision" if p.output_stride == 32 else "deeplabv3"))
        self.head_style = style
        rates = tuple(p.atrous_rates) if p.atrous_rates is not None else default_rates(p.output_stride)
        dropout = p.dropout if p.dropout is not None else (0.5 if style == "torchvision" else 0.1)
        self.backbone = MobileNetV2Features(
            in_channels, p.width_mult, p.output_stride, style == "torchvision", p.norm, p.group_norm_groups
        )
        self.feature_dim = self.backbone.out_channels
        self.low_level_index = STAGE_ENDS[LOW_LEVEL_STAGE]
        self.pyramid = tuple(STAGE_ENDS[s] for s in PYRAMID_STAGES)
        if self.plus:
            low_in = self.backbone.stage_channels[LOW_LEVEL_STAGE]
            self.head: nn.Module = DeepLabV3PlusHead(self.feature_dim, low_in, num_classes, p, rates, dropout)  # type: ignore[arg-type]
        else:
            self.head = DeepLabHead(
                self.feature_dim, num_classes, p.aspp_channels, rates, dropout, style == "torchvision", p.norm, p.group_norm_groups
            )
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plus:
            t = self.backbone.taps(x, (self.low_level_index,))
            out = self.head(t[-1], t[self.low_level_index])
        else:
            out = self.head(self.backbone(x))
        return F.interpolate(out, size=x.shape[-2:], mode="bilinear", align_corners=False)

    def adapt_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """An ImageNet MobileNetV2 checkpoint (torchvision's or d-li14's, converted to FedSight's names) without its
        classification-only parts: the Linear classifier (``head.weight``, ``head.bias``; no DeepLab head has those
        keys) and the final 1x1 conv (``backbone.features.18``) where this model's backbone ends before it (the
        MobileNetV2 paper's head at OS 8/16 reads the 320-channel map). Any other key is left to be checked."""
        n = len(self.backbone.features)

        def kept(k: str) -> bool:
            m = re.match(r"backbone\.features\.(\d+)\.", k)
            return k not in ("head.weight", "head.bias") and (m is None or int(m.group(1)) < n)

        return {k: v for k, v in state.items() if kept(k)}

    def feature_maps(self, x: torch.Tensor) -> list[torch.Tensor]:
        t = self.backbone.taps(x, self.pyramid)
        return [t[i] for i in self.pyramid] + [t[-1]]

    def blocks(self) -> dict[str, list[str]]:
        """The stem, each MobileNetV2 stage (its inverted residual blocks), the final 1x1 conv (when
        used), then the head's parts (ASPP; decoder or extra conv; classifier)."""
        feats = self.backbone.features
        out: dict[str, list[str]] = {"backbone.stem": state_keys(feats[0], "backbone.features.0")}
        start = 1
        for i, end in enumerate(STAGE_ENDS):
            out[f"backbone.stage{i + 1}"] = [k for j in range(start, end + 1) for k in state_keys(feats[j], f"backbone.features.{j}")]
            start = end + 1
        if len(feats) > start:
            out["backbone.last"] = state_keys(feats[start], f"backbone.features.{start}")
        for name, m in self.head.named_children():
            keys = state_keys(m, f"head.{name}")
            if keys:
                out[f"head.{name}"] = keys
        return out


def _provides(p: DeepLabV3Params | DeepLabV3PlusParams) -> frozenset[str]:
    return frozenset({"parameter_groups"}) | norm_capabilities(p.norm)


@MODELS.register(
    "deeplabv3_mobilenetv2", params=DeepLabV3Params, task="segmentation", provides=_provides,
    help="DeepLabV3 (ASPP) on a dilated MobileNetV2, output stride 8/16/32",
)
def deeplabv3_mobilenetv2(p: DeepLabV3Params, *, io: ModelIO) -> FedModel:
    return DeepLabV3(p, num_classes=io.num_outputs, in_channels=io.in_channels)


@MODELS.register(
    "deeplabv3plus_mobilenetv2", params=DeepLabV3PlusParams, task="segmentation", provides=_provides,
    help="DeepLabV3+ (ASPP + stride-4 decoder) on a dilated MobileNetV2, output stride 8/16",
)
def deeplabv3plus_mobilenetv2(p: DeepLabV3PlusParams, *, io: ModelIO) -> FedModel:
    return DeepLabV3(p, num_classes=io.num_outputs, in_channels=io.in_channels)
