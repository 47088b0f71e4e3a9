"""BiSeNetV2 (Yu et al., "BiSeNet V2: Bilateral Network with Guided Aggregation for Real-time Semantic
Segmentation", IJCV 2021), in plain PyTorch, following the CoinCheung/BiSeNet reference implementation
(which FedDrive uses) where the paper leaves details open.

Architecture (channels at ``width=1``; every conv is conv -> norm -> ReLU unless stated):

* **Detail branch** (spatial path, 1/8): S1 ``3x3/2 64, 3x3 64``; S2 ``3x3/2 64, 3x3 64, 3x3 64``;
  S3 ``3x3/2 128, 3x3 128, 3x3 128``.
* **Semantic branch** (1/32): stem block (``3x3/2 16``, then ``[1x1 8, 3x3/2 16]`` beside a 3x3/2
  max-pool, concatenated, ``3x3 16``; 1/4); stage 3 ``GE/2 32, GE 32`` (1/8); stage 4 ``GE/2 64, GE 64``
  (1/16); stage 5 ``GE/2 128, GE 128 x3`` (1/32) and the context embedding block (global average pool
  -> norm -> ``1x1 128`` -> added to the input -> ``3x3 128``). A gather-and-expansion layer ``GE`` (expansion
  6) is ``3x3 C_in``, depthwise ``3x3`` expanding to ``6 C_in`` (with ReLU), ``1x1 C_out`` (norm, no ReLU),
  added to the input, ReLU; the stride-2 ``GE/2`` has two depthwise convs (``3x3/2`` expanding, then
  ``3x3``) and a shortcut ``depthwise 3x3/2 + norm, 1x1 C_out + norm``.
* **Bilateral guided aggregation** (BGA): detail ``d`` (1/8) and semantic ``s`` (1/32):
  ``d1 = dw3x3+norm, 1x1`` and ``d2 = 3x3/2+norm, avgpool 3x3/2`` of ``d``; ``s1 = 3x3+norm`` and
  ``s2 = dw3x3+norm, 1x1`` of ``s``; out = ``3x3 128`` of ``d1 * sigmoid(up(s1)) + up(d2 * sigmoid(s2))``
  (``up``: bilinear to the detail map's size, so any input size works).
* **Segmentation head**: ``3x3 head_channels`` (1024 in the reference main head), dropout, ``1x1 C`` (with
  bias), bilinear upsampling to the input size.
* **Auxiliary heads** (the paper's "booster" training strategy): the same head with ``aux_channels``
  (128) on the semantic stem (1/4) and stages 3, 4 and 5 (before the context embedding), used only in
  training. They are part of the ``head`` parameter group (``head.aux.*``).

**The references' heads** (``head_style``; compared with ``Erosinho13/FedDrive`` ``src/modules/bisenetv2.py`` and
``CoinCheung/BiSeNet`` ``lib/models/bisenetv2.py``: detail branch, stem, GE layers, context embedding, BGA
convolutions, dropout 0.1 and initialisation are the same in all three; only the heads and BGA's upsampling
differ). ``"paper"`` (the default, above) is the paper's head. ``"feddrive"`` is FedDrive's variant of CoinCheung's
late-2020 code (whose auxiliary heads had an extra conv that FedDrive's lack): each head's ``1x1`` conv outputs
``C*up**2`` channels, rearranged by ``PixelShuffle(up)`` (``up`` = 8 for the main head, 4/8/16/32 for the auxiliary
ones; 8,196,416 parameters at 19 classes, 4,585,552 without the auxiliary heads), and BGA upsamples bilinearly with
``align_corners=True``. ``"bisenet"`` is CoinCheung's code since its 2021-07 refactor, which published
``model_final_v2_city.pth``: the main head is the paper's; each auxiliary head upsamples 2x (nearest) and applies
``3x3 conv -> norm -> ReLU`` to ``up**2`` channels before its ``1x1`` classifier (5,231,487 parameters at 19
classes), and BGA upsamples with nearest neighbours. ``bga_upsample`` overrides the style's BGA mode. The
references upsample by fixed factors (4 in BGA, ``up`` in the heads); FedSight resizes to the detail map's and the
input's size, the same for inputs whose sides are multiples of 32 (Cityscapes' 512x1024, FedDrive's 512x928 crops),
and any input size still works. Their checkpoints load with the ``feddrive`` and ``bisenet`` layouts
(``fedsight.weights_seg``).

``width`` scales every backbone channel count, rounded to a multiple of 8 (at least 8), so the
depthwise/grouped convolutions (groups = input channels, outputs = 6x inputs) stay valid;
``head_channels``/``aux_channels`` are absolute. As in the reference, convolutions are Kaiming-normal
(fan_out) and the last norm of every GE layer's residual branch starts at zero (``zero_init_residual``).

**Output contract.** ``forward(x)`` on ``[B, 3, H, W]`` returns class logits ``[B, C, H, W]`` at the input
resolution (bilinear, ``align_corners=False``) for any H, W. In training mode (``self.training``) with
auxiliary heads it returns the tuple ``(main, aux_stem, aux_s3, aux_s4, aux_s5)`` of five such logits (the
booster loss sums a loss over all five); in eval mode (or with ``aux_heads=False``) only ``main``. Like
the reference, the context embedding block's BatchNorm on the pooled ``[B, C, 1, 1]`` vector needs a
batch of at least 2 in training mode. ``features(x)`` is the aggregated BGA map (1/8, the head's input);
``feature_maps(x)`` the semantic branch's pyramid: stem (1/4), stage 3 (1/8), stage 4 (1/16) and stage 5
after context embedding (1/32); strides are ``ceil`` divisions (every stride-2 layer maps n to ceil(n/2)).

Parameters at ``width=1``, 19 classes: detail 519,232 + semantic 1,159,504 + BGA 478,720 + main head
1,201,171 = 3,358,627 (the reference's inference model, published as ~3.4M), plus 287,308 for the four
auxiliary heads (3,645,935 in all).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedsight.models.base import FedModel, ModelIO, norm_capabilities, state_keys
from fedsight.models.layers import init_weights, norm_layer
from fedsight.registry import MODELS, Params

__all__ = ["BiSeNetV2", "BiSeNetV2Params", "BilateralGuidedAggregation", "ContextEmbedding", "GatherExpand"]

#: channels at width 1
DETAIL = (64, 64, 128)
STEM, STEM_MID = 16, 8
SEMANTIC = (32, 64, 128)
#: GE layers per semantic stage (the first is the stride-2 variant)
SEMANTIC_DEPTH = (2, 2, 4)
EXPANSION = 6


def scaled(channels: int, width: float, divisor: int = 8) -> int:
    """``channels * width`` rounded to the nearest multiple of ``divisor`` (at least ``divisor``), never
    more than 10% below the exact value."""
    v = channels * width
    out = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return out + divisor if out < 0.9 * v else out


#: how each style upsamples inside the BGA layer (``bga_upsample``'s default)
BGA_UPSAMPLE = {"paper": "bilinear", "feddrive": "bilinear_corners", "bisenet": "nearest"}
#: the output stride of the main head's input and of each auxiliary head's (stem, S3, S4, S5)
MAIN_STRIDE, AUX_STRIDES = 8, (4, 8, 16, 32)


class BiSeNetV2Params(Params):
    width: float = Field(1.0, gt=0, description="backbone channel multiplier (0.25 for tests and CPU demos)")
    head_channels: int = Field(1024, ge=1, description="hidden channels of the main segmentation head (reference: 1024)")
    aux_channels: int = Field(128, ge=1, description="hidden channels of each auxiliary head (reference: 128)")
    aux_heads: bool = Field(True, description="the four auxiliary (booster) heads used in training")
    dropout: float = Field(0.1, ge=0, lt=1, description="dropout before each head's classifier")
    norm: Literal["batch", "group"] = "batch"
    group_norm_groups: int = Field(2, gt=0)
    zero_init_residual: bool = Field(True, description="start the last norm of each GE residual branch at zero")
    head_style: Literal["paper", "feddrive", "bisenet"] = Field(
        "paper", description="heads: 'paper' 1x1 to classes + bilinear; 'feddrive' pixel shuffle (FedDrive's "
        "checkpoints); 'bisenet' CoinCheung's release (its model_final_v2_city.pth)",
    )
    bga_upsample: Literal["bilinear", "bilinear_corners", "nearest"] | None = Field(
        None, description="BGA's 4x upsampling; default by head_style: paper bilinear, feddrive bilinear "
        "align_corners=True, bisenet nearest",
    )


def conv_norm_act(cin: int, cout: int, k: int, stride: int, norm: str, g: int, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, groups=groups, bias=False),
        norm_layer(norm, cout, g),
        nn.ReLU(inplace=True),
    )


def conv_norm(cin: int, cout: int, k: int, stride: int, norm: str, g: int, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, groups=groups, bias=False), norm_layer(norm, cout, g)
    )


class DetailBranch(nn.Module):
    def __init__(self, in_channels: int, ch: tuple[int, int, int], norm: str, g: int):
        super().__init__()
        c1, c2, c3 = ch
        self.S1 = nn.Sequential(conv_norm_act(in_channels, c1, 3, 2, norm, g), conv_norm_act(c1, c1, 3, 1, norm, g))
        self.S2 = nn.Sequential(
            conv_norm_act(c1, c2, 3, 2, norm, g), conv_norm_act(c2, c2, 3, 1, norm, g), conv_norm_act(c2, c2, 3, 1, norm, g)
        )
        self.S3 = nn.Sequential(
            conv_norm_act(c2, c3, 3, 2, norm, g), conv_norm_act(c3, c3, 3, 1, norm, g), conv_norm_act(c3, c3, 3, 1, norm, g)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.S3(self.S2(self.S1(x)))


class StemBlock(nn.Module):
    def __init__(self, in_channels: int, c: int, mid: int, norm: str, g: int):
        super().__init__()
        self.conv = conv_norm_act(in_channels, c, 3, 2, norm, g)
        self.left = nn.Sequential(conv_norm_act(c, mid, 1, 1, norm, g), conv_norm_act(mid, c, 3, 2, norm, g))
        self.right = nn.MaxPool2d(3, stride=2, padding=1)
        self.fuse = conv_norm_act(2 * c, c, 3, 1, norm, g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        return self.fuse(torch.cat([self.left(x), self.right(x)], dim=1))


class GatherExpand(nn.Module):
    """Gather-and-expansion layer; ``stride=2`` is the downsampling variant with a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int, norm: str, g: int, expand: int = EXPANSION):
        super().__init__()
        mid = cin * expand
        self.stride = stride
        self.conv1 = conv_norm_act(cin, cin, 3, 1, norm, g)
        if stride == 1:
            if cin != cout:
                raise ValueError("a stride-1 GE layer keeps its channel count")
            self.dwconv = conv_norm_act(cin, mid, 3, 1, norm, g, groups=cin)
        else:
            self.dwconv1 = conv_norm(cin, mid, 3, stride, norm, g, groups=cin)
            self.dwconv2 = conv_norm_act(mid, mid, 3, 1, norm, g, groups=mid)
        self.conv2 = conv_norm(mid, cout, 1, 1, norm, g)
        if stride != 1:
            self.shortcut = nn.Sequential(
                *conv_norm(cin, cin, 3, stride, norm, g, groups=cin), *conv_norm(cin, cout, 1, 1, norm, g)
            )

    @property
    def last_norm(self) -> nn.Module:
        return self.conv2[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv1(x)
        y = self.dwconv(y) if self.stride == 1 else self.dwconv2(self.dwconv1(y))
        y = self.conv2(y)
        return F.relu(y + (x if self.stride == 1 else self.shortcut(x)))


class ContextEmbedding(nn.Module):
    def __init__(self, c: int, norm: str, g: int):
        super().__init__()
        self.norm = norm_layer(norm, c, g)
        self.conv_gap = conv_norm_act(c, c, 1, 1, norm, g)
        self.conv_last = conv_norm_act(c, c, 3, 1, norm, g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = self.conv_gap(self.norm(x.mean(dim=(2, 3), keepdim=True)))
        return self.conv_last(x + ctx)


class SemanticBranch(nn.Module):
    def __init__(self, in_channels: int, width: float, norm: str, g: int):
        super().__init__()
        stem = scaled(STEM, width)
        self.stem = StemBlock(in_channels, stem, scaled(STEM_MID, width), norm, g)
        prev = stem
        stages = []
        for c, depth in zip(SEMANTIC, SEMANTIC_DEPTH):
            out = scaled(c, width)
            stages.append(nn.Sequential(*[GatherExpand(prev if i == 0 else out, out, 2 if i == 0 else 1, norm, g) for i in range(depth)]))
            prev = out
        self.S3, self.S4, self.S5 = stages
        self.ce = ContextEmbedding(prev, norm, g)
        self.channels = (stem, *[scaled(c, width) for c in SEMANTIC])

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``[stem, S3, S4, S5 (before context embedding), context-embedded S5]``."""
        f2 = self.stem(x)
        f3 = self.S3(f2)
        f4 = self.S4(f3)
        f5 = self.S5(f4)
        return [f2, f3, f4, f5, self.ce(f5)]


def _resize(x: torch.Tensor, size: torch.Size | tuple[int, int], mode: str = "bilinear") -> torch.Tensor:
    """``x`` resized to ``size`` (``mode``: ``bilinear`` with ``align_corners=False``, ``bilinear_corners`` with
    ``align_corners=True``, or ``nearest``); as it is when it has that size (where interpolation is the identity,
    values and gradients: while torch.fx traces the forward, a Proxy's size is unknown, and it interpolates)."""
    if isinstance(x, torch.Tensor) and x.shape[-2:] == size:
        return x
    if mode == "nearest":
        return F.interpolate(x, size=size, mode="nearest")
    return F.interpolate(x, size=size, mode="bilinear", align_corners=mode == "bilinear_corners")


class BilateralGuidedAggregation(nn.Module):
    """``upsample``: how the 1/32 semantic maps reach the detail map's size (see ``_resize``)."""

    def __init__(self, c: int, norm: str, g: int, upsample: str = "bilinear"):
        super().__init__()
        self.upsample = upsample
        self.left1 = nn.Sequential(*conv_norm(c, c, 3, 1, norm, g, groups=c), nn.Conv2d(c, c, 1, bias=False))
        self.left2 = nn.Sequential(*conv_norm(c, c, 3, 2, norm, g), nn.AvgPool2d(3, stride=2, padding=1))
        self.right1 = conv_norm(c, c, 3, 1, norm, g)
        self.right2 = nn.Sequential(*conv_norm(c, c, 3, 1, norm, g, groups=c), nn.Conv2d(c, c, 1, bias=False))
        self.conv = conv_norm_act(c, c, 3, 1, norm, g)

    def forward(self, detail: torch.Tensor, semantic: torch.Tensor) -> torch.Tensor:
        size = detail.shape[-2:]
        left = self.left1(detail) * torch.sigmoid(_resize(self.right1(semantic), size, self.upsample))
        right = _resize(self.left2(detail) * torch.sigmoid(self.right2(semantic)), size, self.upsample)
        return self.conv(left + right)


class SegmentHead(nn.Module):
    """``3x3 conv -> norm -> ReLU``, dropout, then by ``style`` (``up``: the stride of the head's input):

    * ``paper``: a ``1x1`` classifier (with bias); upsampled (bilinear) by the caller.
    * ``feddrive``: a ``1x1`` conv to ``num_classes * up * up`` channels (with bias) and ``PixelShuffle(up)``
      (FedDrive's ``SegmentHead.conv_out``: the logits come out at ``up`` times the input's size).
    * ``bisenet`` (``refine``, CoinCheung's auxiliary heads since its 2021-07 refactor): nearest 2x upsampling,
      ``3x3 conv -> norm -> ReLU`` to ``up * up`` channels, then the ``1x1`` classifier; bilinear by the caller.
      Its main head (``refine=False``) is the ``paper`` head.
    """

    def __init__(self, cin: int, mid: int, num_classes: int, dropout: float, norm: str, g: int,
                 style: str = "paper", up: int = 1, refine: bool = False):
        super().__init__()
        self.conv = conv_norm_act(cin, mid, 3, 1, norm, g)
        self.drop = nn.Dropout(dropout)
        self.refine = conv_norm_act(mid, up * up, 3, 1, norm, g) if style == "bisenet" and refine else None
        cls_in = up * up if self.refine is not None else mid
        self.classifier = nn.Conv2d(cls_in, num_classes * up * up if style == "feddrive" else num_classes, 1)
        self.shuffle = nn.PixelShuffle(up) if style == "feddrive" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(self.conv(x))
        if self.refine is not None:
            y = self.refine(F.interpolate(y, scale_factor=2.0, mode="nearest"))
        y = self.classifier(y)
        return self.shuffle(y) if self.shuffle is not None else y


class BiSeNetV2Backbone(nn.Module):
    def __init__(self, p: BiSeNetV2Params, in_channels: int):
        super().__init__()
        detail = tuple(scaled(c, p.width) for c in DETAIL)
        self.detail = DetailBranch(in_channels, detail, p.norm, p.group_norm_groups)  # type: ignore[arg-type]
        self.semantic = SemanticBranch(in_channels, p.width, p.norm, p.group_norm_groups)
        if detail[-1] != self.semantic.channels[-1]:  # both are scaled(128, width)
            raise AssertionError("detail and semantic branches must end with the same channel count")
        self.bga = BilateralGuidedAggregation(detail[-1], p.norm, p.group_norm_groups,
                                              p.bga_upsample or BGA_UPSAMPLE[p.head_style])
        self.out_channels = detail[-1]

    def forward_all(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The aggregated map and the semantic branch's maps (stem, S3, S4, S5, context-embedded S5)."""
        sem = self.semantic(x)
        return self.bga(self.detail(x), sem[-1]), sem

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_all(x)[0]


class BiSeNetV2Heads(nn.Module):
    def __init__(self, p: BiSeNetV2Params, in_channels: int, aux_in: tuple[int, ...], num_classes: int):
        super().__init__()
        norm, g = p.norm, p.group_norm_groups
        style = p.head_style
        self.main = SegmentHead(in_channels, p.head_channels, num_classes, p.dropout, norm, g, style, MAIN_STRIDE)
        self.aux = nn.ModuleList(
            [SegmentHead(c, p.aux_channels, num_classes, p.dropout, norm, g, style, up, refine=True)
             for c, up in zip(aux_in, AUX_STRIDES)] if p.aux_heads else []
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x)


class BiSeNetV2(FedModel):
    """BiSeNetV2; see the module docstring for the architecture and the output contract."""

    split_head = False
    multi_scale = True

    def __init__(self, p: BiSeNetV2Params, *, num_classes: int, in_channels: int = 3):
        super().__init__()
        self.backbone = BiSeNetV2Backbone(p, in_channels)
        self.feature_dim = self.backbone.out_channels
        self.head = BiSeNetV2Heads(p, self.feature_dim, self.backbone.semantic.channels, num_classes)
        self.num_classes, self.head_style = num_classes, p.head_style
        init_weights(self)
        if p.zero_init_residual:
            for m in self.modules():
                if isinstance(m, GatherExpand):
                    nn.init.zeros_(m.last_norm.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        size = x.shape[-2:]
        feat, sem = self.backbone.forward_all(x)
        main = _resize(self.head.main(feat), size)
        if not (self.training and len(self.head.aux)):
            return main
        # aux heads on the stem, S3, S4 and S5 before the context embedding (sem[:4])
        return (main, *[_resize(h(f), size) for h, f in zip(self.head.aux, sem[:4])])

    def checkpoint_hint(self, state: dict[str, torch.Tensor]) -> str | None:
        """Which ``head_style`` (and number of classes) a checkpoint that does not fit was saved with, where that is
        not this model's, read off its heads: CoinCheung's auxiliary heads have ``refine`` convs; FedDrive's main
        classifier has 4x the outputs of the first auxiliary one (``C*8**2`` against ``C*4**2``) or, without
        auxiliary heads, ``64 C`` for this model's ``C`` (``fedsight.weights.load_checkpoint`` adds it to its error)."""
        w, a = state.get("head.main.classifier.weight"), state.get("head.aux.0.classifier.weight")
        if w is None:
            return None
        n = w.shape[0]
        if any(k.startswith("head.aux.") and ".refine." in k for k in state):
            style, classes = "bisenet", n
        elif n % MAIN_STRIDE**2 == 0 and (n == 4 * a.shape[0] if a is not None else n == self.num_classes * MAIN_STRIDE**2):
            style, classes = "feddrive", n // MAIN_STRIDE**2
        elif a is None or n == a.shape[0]:
            style, classes = "paper", n
        else:
            return None
        if style == self.head_style and classes == self.num_classes:
            return None
        fix = f'model.head_style = "{style}"' if style != self.head_style else ""
        if classes != self.num_classes:
            fix += (" and " if fix else "") + f"{classes} classes (or exclude = [\"head.*.classifier.*\"])"
        return f"its heads are head_style '{style}' heads for {classes} classes: build the model with {fix}"

    def feature_maps(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Semantic branch: stem (1/4), stage 3 (1/8), stage 4 (1/16), context-embedded stage 5 (1/32)."""
        sem = self.backbone.semantic(x)
        return [sem[0], sem[1], sem[2], sem[4]]

    def blocks(self) -> dict[str, list[str]]:
        """Detail stages S1-S3, semantic stem, stages 3-5 and context embedding, the BGA layer, the main
        head and (if present) the auxiliary heads."""
        units = [f"backbone.detail.{s}" for s in ("S1", "S2", "S3")]
        units += [f"backbone.semantic.{s}" for s in ("stem", "S3", "S4", "S5", "ce")]
        units += ["backbone.bga", "head.main"] + (["head.aux"] if len(self.head.aux) else [])
        return {u: state_keys(self.get_submodule(u), u) for u in units}


def _provides(p: BiSeNetV2Params) -> frozenset[str]:
    return frozenset({"parameter_groups"}) | norm_capabilities(p.norm)


@MODELS.register(
    "bisenetv2", params=BiSeNetV2Params, task="segmentation", provides=_provides,
    help="BiSeNetV2 real-time segmentation (detail + semantic branches, BGA, 4 auxiliary booster heads)",
)
def bisenetv2(p: BiSeNetV2Params, *, io: ModelIO) -> FedModel:
    return BiSeNetV2(p, num_classes=io.num_outputs, in_channels=io.in_channels)
