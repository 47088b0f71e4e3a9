"""Top-down 2-D human pose estimation models (task family ``"keypoints"``) in plain PyTorch: SimpleBaseline and
ViTPose with ResFormer's convolutional position embeddings, the backbone of RAF (Lim et al., "Mitigating
Resolution-Drift in Federated Learning: Case of Keypoint Detection", Sec. IV-B1).

**Contract (both).** ``forward(x)`` maps a person crop ``[B, 3, H, W]`` with values in [0, 1] to one heatmap per
joint, ``[B, J, H/4, W/4]`` (``J = io.num_outputs``), for any ``H, W`` that are multiples of the model's
``stride_multiple`` attribute, with no change to the model: the RAF ladders 256x192, 192x144, 128x96 (and the
unseen 320x240, 384x288) at patch 16, 128x96, 96x72, 64x48 at patch 8. Another size raises a ``ValueError``
naming the multiple. The ImageNet mean and standard deviation are subtracted and divided inside the backbone
(non-persistent buffers, not state). ``simplebaseline`` loads published weights, ``vitpose`` none (the official
ViTPose: ``vitpose_official``). Parameter groups: ``backbone`` (all before the heatmap head), ``head``
(deconvolutions / upsampling, final conv); ``norm`` by module type. Attributes ``stride_multiple``, ``output_stride``.

``simplebaseline``: Xiao, Wu & Wei, "Simple Baselines for Human Pose Estimation and Tracking" (ECCV 2018),
as ``microsoft/human-pose-estimation.pytorch`` ``lib/models/pose_resnet.py``:

* an ImageNet ResNet (He et al. 2016): 7x7 stride-2 stem conv (no bias) -> norm -> ReLU -> 3x3 stride-2 max-pool,
  four stages of BasicBlocks (depth 18: [2, 2, 2, 2]; 34: [3, 4, 6, 3]) or Bottlenecks (depth 50: [3, 4, 6, 3],
  expansion 4, stride on the 3x3 conv as in ``pose_resnet.py`` / torchvision v1.5) with ``width, 2 width,
  4 width, 8 width`` planes (``width`` = 64 in the paper) and 1x1 conv + norm projection shortcuts; output
  stride 32;
* the head: ``deconv_layers`` (3) x [``ConvTranspose2d(k=4, s=2, p=1, output_padding=0, bias=False)`` -> norm
  -> ReLU] with ``deconv_filters`` (256 in the paper) channels, then a 1x1 conv to J. Heatmaps at stride
  32 / 2^3 = 4.

Initialisation: convolutions Kaiming-normal (fan_out, ReLU) as torchvision's ResNet (the paper's is ImageNet:
layout ``torchvision``, ``width = 64``, excluding ``head.*``; the release's: ``pose_resnet``; docs/weights.md);
deconvolution and final-conv weights N(0, 0.001^2), final bias 0, norms 1/0, as ``PoseResNet.init_weights``.
``norm = "batch"`` is the paper's; ``"group"`` (GroupNorm with ``group_norm_groups`` groups, everywhere) has no
running statistics, for DP-SGD and recipes that must not have BatchNorm.

*Sizes that are not multiples of 32.* The paper's crops (256x192, 384x288) are multiples of 32; 192x144, 96x72
and 64x48 are not. Every stride-2 layer maps n to ceil(n/2), so the stride-32 map is ceil(H/32) x ceil(W/32)
and the deconvolutions give 8 ceil(H/32) >= H/4 rows. With ``crop = true`` (the default) the model runs on the
image as it is and keeps the top-left H/4 x W/4 of the heatmaps: heatmap pixel (i, j) still covers input pixels
4i..4i+3, 4j..4j+3, exactly as for a multiple of 32, so ``stride_multiple`` = 4. The crop is outside
``head(features(x))``, so ``split_head = False`` then (the two agree for multiples of 32). ``crop = false`` is the
original model: inputs must be multiples of 32 (``stride_multiple`` = 32) and ``split_head = True``.

``vitpose``: Xu, Zhang, Zhang & Tao, "ViTPose: Simple Vision Transformer Baselines for Human Pose Estimation"
(NeurIPS 2022; ``ViTAE-Transformer/ViTPose`` ``mmpose/models/backbones/vit.py`` and
``heads/topdown_heatmap_simple_head.py``), with the absolute position embedding replaced by ResFormer's
convolutional ones (Tian et al., "ResFormer: Scaling ViTs with Multi-Resolution Training", CVPR 2023;
``ruitian12/resformer`` ``image_classification/models.py``: ``GlobalPosEmbed`` and ``Attention.get_v``), as RAF
does:

* patch embedding ``Conv2d(3, D, P, stride=P)``: tokens on the (H/P, W/P) grid, no cls token;
* GPE (``gpe``, ResFormer's ``GlobalPosEmbed``): a fixed 2-D sine-cosine embedding of the *current* grid
  (:func:`sincos_2d`: row and column indices ``1..h`` and ``1..w`` (the cumsum of ones) scaled to (0, 2 pi] by
  ``i / (h + 1e-6) * 2 pi``, temperature 10000; the first D/2 channels encode the row, the last D/2 the column,
  each as interleaved ``sin, cos`` pairs) through a learnable depth-wise ``Conv2d(D, D, 3, padding=1,
  groups=D)``, added to the tokens. ResFormer computes it per batch on a square grid and gives the cls token a
  zero embedding; here it is computed once per forward on the (h, w) grid (broadcast over the batch);
* L pre-norm transformer blocks: ``x + drop_path(attn(LN(x)))``, ``x + drop_path(mlp(LN(x)))``; multi-head
  self-attention with qkv bias and scale ``head_dim^-0.5``; MLP ``D -> mlp_ratio D -> D`` with GELU; stochastic
  depth rates ``linspace(0, drop_path, L)`` (ViTPose's rule); LayerNorm eps 1e-6 (ViTPose, ResFormer);
* LPE (``lpe``, ResFormer's ``get_v``): in every attention, a depth-wise ``Conv2d(head_dim, head_dim, 3,
  padding=1, groups=head_dim)`` shared by the heads, applied to V reshaped to the (h, w) grid and added to
  ``attn @ v`` before the output projection; weight and bias start at zero, so a fresh model with LPE computes
  exactly what it computes without. The grid shape is passed to every block explicitly (ResFormer infers a
  square grid from the token count);
* a final LayerNorm; tokens reshaped to ``[B, D, H/P, W/P]`` (``features(x)``);
* the head, ``head = "deconv"`` (ViTPose's ``TopdownHeatmapSimpleHead``, the "classic decoder"): log2(P/4)
  x [deconv k4 s2 p1 (no bias) -> norm -> ReLU] with ``deconv_filters`` channels (2 for P = 16, as ViTPose;
  1 for P = 8), then a 1x1 conv to J; ``head = "simple"`` (ViTPose's "simple decoder"): ReLU, bilinear
  upsampling by P/4 (``align_corners=False``), a 3x3 conv to J. Head initialisation as ViTPose (std 0.001
  weights, final bias 0, norm 1/0).
* optional APE (``ape``, for the APE-vs-conv-PE comparison RAF motivates but does not run): a learned
  ``[1, D, gh, gw]`` embedding for ``ape_grid`` (or ``io.image_size / P`` square) initialised
  trunc-normal(0.02), bilinearly resized (``align_corners=False``) to any other grid and added to the tokens.

Initialisation: Linear weights ``trunc_normal_(std=0.02)`` (timm's and PyTorch's default bounds +-2 are absolute,
i.e. 100 standard deviations: practically a plain normal, as in both references), biases 0,
LayerNorm 1/0 (ViTPose and ResFormer); patch-embedding and GPE convolutions keep PyTorch's default (both
references leave convolutions to it); LPE zero.

Departures from ViTPose as published (which ``vitpose_s`` / ``vitpose_b`` are, with its weights): (1) no
pretrained weights (GPE/LPE have none); (2) no absolute position embedding by default (RAF's change) and, with
``ape``, no cls-token slot (ViTPose adds its ``pos_embed[:, :1]`` to every token); (3) no patch-embedding padding
(ViTPose's is 2: the same H/16 grid, every patch shifted by 2 pixels); (4) UDP, flip test and heatmap
post-processing are evaluation choices outside the model; (5) CPU-sized defaults (``dim=96, depth=4, heads=3,
drop_path=0, deconv_filters=64``; ViTPose-S: 384, 12, 12, 0.3, 256); (6) attention by
``scaled_dot_product_attention`` (no attention dropout, as ViTPose's configs), under vmap by matrix products.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedsight.models.base import FedModel, ModelIO, norm_capabilities, state_keys
from fedsight.models.layers import init_weights, norm_layer
from fedsight.models.resnet import BasicBlock, residual_blocks
from fedsight.registry import MODELS, Params
from fedsight.weights_pose import simplebaseline_names

__all__ = [
    "IMAGENET_MEAN", "IMAGENET_STD", "Attention", "Block", "GlobalPosEmbed", "HeatmapHead", "SimpleBaseline",
    "SimpleBaselineParams", "SimpleUpsampleHead", "ViTPose", "ViTPoseParams", "sincos_2d",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: heatmap stride of every keypoint model (the family's contract: heatmaps at H/4 x W/4)
OUTPUT_STRIDE = 4


def check_size(model_name: str, x: torch.Tensor, multiple: int, why: str) -> None:
    """A ``ValueError`` naming ``multiple`` unless ``x`` is ``[B, C, H, W]`` with H and W multiples of it."""
    if x.ndim != 4:
        raise ValueError(f"{model_name} expects images [B, C, H, W], got shape {tuple(x.shape)}")
    h, w = x.shape[-2:]
    if h % multiple or w % multiple or h == 0 or w == 0:
        raise ValueError(f"{model_name} needs an input height and width that are multiples of {multiple} ({why}), "
                         f"got {h}x{w}")


class ImageNetNorm(nn.Module):
    """``(x - mean) / std`` with the ImageNet RGB statistics as non-persistent buffers (not state)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean.to(x.dtype)) / self.std.to(x.dtype)


def _check_io(io: ModelIO) -> None:
    if io.num_outputs < 1:
        raise ValueError(f"keypoint models need io.num_outputs = the number of joints (>= 1), got {io.num_outputs}")
    if io.in_channels != 3:
        raise ValueError(f"keypoint models normalise RGB inputs with the ImageNet mean/std: in_channels must be 3, "
                         f"got {io.in_channels}")


# -- heads ---------------------------------------------------------------------------------------------------


class HeatmapHead(nn.Module):
    """SimpleBaseline's / ViTPose's ``TopdownHeatmapSimpleHead``: ``num_deconv`` x [ConvTranspose2d(k4, s2, p1,
    no bias) -> norm -> ReLU] with ``filters`` channels (each doubles H and W exactly), then a ``final_kernel``
    conv (with bias) to ``joints``. Init: deconv and final weights N(0, 0.001^2), final bias 0, norm 1/0."""

    def __init__(self, cin: int, joints: int, num_deconv: int, filters: int, norm: str, groups: int = 2,
                 final_kernel: int = 1):
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(num_deconv):
            layers += [nn.ConvTranspose2d(cin, filters, 4, stride=2, padding=1, output_padding=0, bias=False),
                       norm_layer(norm, filters, groups), nn.ReLU(inplace=True)]
            cin = filters
        self.deconvs = nn.Sequential(*layers)
        self.final = nn.Conv2d(cin, joints, final_kernel, padding=final_kernel // 2)
        for m in self.modules():
            if isinstance(m, nn.ConvTranspose2d):
                nn.init.normal_(m.weight, std=0.001)
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.final.weight, std=0.001)
        nn.init.zeros_(self.final.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.final(self.deconvs(x))


class SimpleUpsampleHead(nn.Module):
    """ViTPose's simple decoder (``upsample=4, num_deconv_layers=0, final_conv_kernel=3``): ReLU, bilinear
    upsampling by ``scale`` (``align_corners=False``), a 3x3 conv to ``joints`` (init N(0, 0.001^2), bias 0)."""

    def __init__(self, cin: int, joints: int, scale: int):
        super().__init__()
        self.scale = scale
        self.final = nn.Conv2d(cin, joints, 3, padding=1)
        nn.init.normal_(self.final.weight, std=0.001)
        nn.init.zeros_(self.final.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(x)
        if self.scale != 1:
            x = F.interpolate(x, scale_factor=self.scale, mode="bilinear", align_corners=False)
        return self.final(x)


# -- SimpleBaseline ------------------------------------------------------------------------------------------


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck (stride on the 3x3 conv, as ``pose_resnet.py``): 1x1 -> 3x3 -> 1x1 (x4), norm after
    each, ReLU after the first two and after the residual sum; 1x1 conv + norm projection shortcut when the
    shape changes."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int, norm: str, groups: int):
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.norm1 = norm_layer(norm, planes, groups)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.norm2 = norm_layer(norm, planes, groups)
        self.conv3 = nn.Conv2d(planes, cout, 1, bias=False)
        self.norm3 = norm_layer(norm, cout, groups)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                          norm_layer(norm, cout, groups))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.relu(self.norm2(self.conv2(out)))
        out = self.norm3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


#: depth -> (block, blocks per stage)
RESNET_LAYOUTS: dict[int, tuple[str, list[int]]] = {18: ("basic", [2, 2, 2, 2]), 34: ("basic", [3, 4, 6, 3]),
                                                    50: ("bottleneck", [3, 4, 6, 3])}


class PoseResNetBackbone(nn.Module):
    """ImageNet ResNet trunk (stem, max-pool, four stages; no pooling or classifier) with the input normalisation
    and the size check; output ``[B, 8 width e, ceil(H/32), ceil(W/32)]`` (e = 1 basic, 4 bottleneck)."""

    def __init__(self, depth: int, width: int, norm: str, groups: int, stride_multiple: int, in_channels: int = 3):
        super().__init__()
        kind, counts = RESNET_LAYOUTS[depth]
        self.stride_multiple = stride_multiple
        self.normalize = ImageNetNorm()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False), norm_layer(norm, width, groups),
            nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages: list[nn.Module] = []
        prev = width
        for i, n in enumerate(counts):
            planes = width * 2**i
            blocks: list[nn.Module] = []
            for j in range(n):
                stride = 2 if i > 0 and j == 0 else 1
                if kind == "basic":
                    blocks.append(BasicBlock(prev, planes, stride, norm, groups))
                    prev = planes
                else:
                    blocks.append(Bottleneck(prev, planes, stride, norm, groups))
                    prev = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.out_channels = prev

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        why = "heatmaps at H/4 cropped from the stride-32 map" if self.stride_multiple == OUTPUT_STRIDE else \
            "output stride 32 without cropping"
        check_size("simplebaseline", x, self.stride_multiple, why)
        return self.stages(self.stem(self.normalize(x)))


class SimpleBaseline(FedModel):
    """SimpleBaseline (ResNet + deconvolution head); see the module docstring."""

    def __init__(self, joints: int, depth: int = 18, width: int = 16, deconv_layers: int = 3, deconv_filters: int = 64,
                 norm: str = "batch", group_norm_groups: int = 2, crop: bool = True):
        super().__init__()
        if depth not in RESNET_LAYOUTS:
            raise ValueError(f"simplebaseline depth must be one of {sorted(RESNET_LAYOUTS)}, got {depth}")
        self.output_stride = 32 // 2**deconv_layers
        self.crop = crop
        self.stride_multiple = self.output_stride if crop else 32
        #: with the crop, forward(x) is head(features(x)) cut to H/4 x W/4
        self.split_head = not crop
        self.backbone = PoseResNetBackbone(depth, width, norm, group_norm_groups, self.stride_multiple)
        self.feature_dim = self.backbone.out_channels
        init_weights(self.backbone)
        self.head = HeatmapHead(self.feature_dim, joints, deconv_layers, deconv_filters, norm, group_norm_groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(self.features(x))
        h, w = x.shape[-2] // self.output_stride, x.shape[-1] // self.output_stride
        if out.shape[-2:] != (h, w):
            out = out[..., :h, :w]
        return out

    def adapt_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """torchvision's ResNet names as this model's (``fedsight.weights_pose.simplebaseline_names``)."""
        return simplebaseline_names(state)

    def blocks(self) -> dict[str, list[str]]:
        """The stem, every residual block, the head."""
        return residual_blocks(self)


class SimpleBaselineParams(Params):
    depth: Literal[18, 34, 50] = Field(
        18, description="ResNet depth: BasicBlocks for 18/34, Bottlenecks for 50 (the paper: 50, 101, 152)")
    width: int = Field(16, ge=1, description="base channels of the first stage, doubled per stage (the paper: 64)")
    deconv_layers: int = Field(
        3, ge=1, le=3, description="deconvolution layers of the head; 3 (the paper) gives heatmaps at H/4, the "
        "keypoint task's contract (1, 2: H/16, H/8, the paper's ablation)")
    deconv_filters: int = Field(64, ge=1, description="channels of every deconvolution (the paper: 256)")
    norm: Literal["batch", "group"] = Field(
        "batch", description="BatchNorm (the paper) or GroupNorm, in backbone and head")
    group_norm_groups: int = Field(2, gt=0, description="GroupNorm groups (norm = 'group')")
    crop: bool = Field(True, description="accept any H, W that are multiples of 4 and crop the heatmaps to H/4 x W/4 "
                       "(false: H, W must be multiples of 32, the original model)")


def _simplebaseline_provides(p: SimpleBaselineParams) -> frozenset[str]:
    return frozenset({"parameter_groups"}) | norm_capabilities(p.norm)


@MODELS.register(
    "simplebaseline", params=SimpleBaselineParams, task="keypoints", provides=_simplebaseline_provides,
    help="SimpleBaseline pose model (Xiao et al. 2018): ImageNet ResNet + 3 deconvolutions, heatmaps at H/4",
)
def build_simplebaseline(p: SimpleBaselineParams, *, io: ModelIO) -> SimpleBaseline:
    _check_io(io)
    return SimpleBaseline(io.num_outputs, p.depth, p.width, p.deconv_layers, p.deconv_filters, p.norm,
                          p.group_norm_groups, p.crop)


# -- ViTPose with GPE / LPE ----------------------------------------------------------------------------------


def sincos_2d(h: int, w: int, dim: int, temperature: float = 10000.0,
              device: torch.device | None = None) -> torch.Tensor:
    """ResFormer's (DETR's) 2-D sine-cosine embedding of an h x w grid, ``[dim, h, w]`` (float32).

    With ``half = dim / 2``, ``y_i = i / (h + 1e-6) * 2 pi`` (i = 1..h, the cumsum of ones), ``x_j`` likewise
    over w, and ``f_k = temperature^(2 floor(k/2) / half)``: channel ``k < half`` is ``sin(y_i / f_k)`` for
    even k and ``cos(y_i / f_k)`` for odd k; channel ``half + k`` the same of ``x_j``."""
    if dim % 4:
        raise ValueError(f"the sine-cosine embedding needs a dimension divisible by 4, got {dim}")
    half, eps, scale = dim // 2, 1e-6, 2 * math.pi
    y = torch.arange(1, h + 1, dtype=torch.float32, device=device) / (h + eps) * scale
    x = torch.arange(1, w + 1, dtype=torch.float32, device=device) / (w + eps) * scale
    k = torch.arange(half, dtype=torch.float32, device=device)
    freq = temperature ** (2 * torch.div(k, 2, rounding_mode="floor") / half)

    def encode(t: torch.Tensor) -> torch.Tensor:  # [n] -> [n, half], interleaved sin, cos
        a = t[:, None] / freq
        return torch.stack((a[:, 0::2].sin(), a[:, 1::2].cos()), dim=2).flatten(1)

    pos_y = encode(y)[:, None, :].expand(h, w, half)
    pos_x = encode(x)[None, :, :].expand(h, w, half)
    return torch.cat((pos_y, pos_x), dim=2).permute(2, 0, 1).contiguous()


class GlobalPosEmbed(nn.Module):
    """ResFormer's GPE: ``dwconv3x3(sincos_2d(h, w))``, ``[1, D, h, w]``, to be added to the tokens."""

    def __init__(self, dim: int, temperature: float = 10000.0):
        super().__init__()
        self.dim, self.temperature = dim, temperature
        self.conv = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)

    def forward(self, h: int, w: int) -> torch.Tensor:
        pos = sincos_2d(h, w, self.dim, self.temperature, device=self.conv.weight.device)
        return self.conv(pos.to(self.conv.weight.dtype)[None])


#: whether a tensor is one of torch.func's (vmap, grad) wrappers (a private torch function; absent: never)
_under_functorch = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", lambda t: False)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v by matrix products: under vmap (vectorised training) batched products for all the
    clients, where fused attention kernels without a batching rule (the CPU's, the backwards) run client by client."""
    return torch.softmax((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1), dim=-1) @ v


class DropPath(nn.Module):
    """Stochastic depth (per sample): zero the residual branch with probability p, scale survivors by 1/(1-p).
    Vectorised training draws each client's masks as this forward does (``drops_examples``:
    ``fedsight.training.vector_batches.dropout_modules``)."""

    drops_examples = True

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1.0 - self.p
        return x * x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep).div_(keep)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class Attention(nn.Module):
    """Multi-head self-attention with qkv bias and, with ``lpe``, ResFormer's local position embedding: a
    zero-initialised depth-wise 3x3 conv over V on the (h, w) token grid, shared by the heads, added to
    ``attn @ v``."""

    def __init__(self, dim: int, heads: int, lpe: bool):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim)
        self.lpe: nn.Conv2d | None = None
        if lpe:
            self.lpe = nn.Conv2d(self.head_dim, self.head_dim, 3, padding=1, groups=self.head_dim)
            nn.init.zeros_(self.lpe.weight)
            nn.init.zeros_(self.lpe.bias)

    def local_pos_embed(self, v: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        b, heads, n, c = v.shape
        grid = v.transpose(-2, -1).reshape(b * heads, c, *hw)
        return self.lpe(grid).reshape(b, heads, c, n).transpose(-2, -1)

    def forward(self, x: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if _under_functorch(q):  # (vmapped clients: see ``attention``)
            out = attention(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        if self.lpe is not None:
            out = out + self.local_pos_embed(v, hw)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Sequential):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + dp(attn(LN(x), hw))``, ``x + dp(mlp(LN(x)))``."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, drop_path: float, lpe: bool):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads, lpe)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x), hw))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class ViTBackbone(nn.Module):
    """Normalisation, patch embedding, GPE / APE, transformer blocks, final LayerNorm; ``[B, D, H/P, W/P]``."""

    def __init__(self, patch: int, dim: int, depth: int, heads: int, mlp_ratio: float, drop_path: float, gpe: bool,
                 lpe: bool, ape_grid: tuple[int, int] | None, in_channels: int = 3):
        super().__init__()
        self.patch, self.dim = patch, dim
        self.normalize = ImageNetNorm()
        self.patch_embed = nn.Conv2d(in_channels, dim, patch, stride=patch)
        self.gpe = GlobalPosEmbed(dim) if gpe else None
        self.ape: nn.Parameter | None = None
        if ape_grid is not None:
            self.ape = nn.Parameter(torch.zeros(1, dim, *ape_grid))
            nn.init.trunc_normal_(self.ape, std=0.02)
        rates = [drop_path * i / max(depth - 1, 1) for i in range(depth)]  # linspace(0, drop_path, depth), meta-safe
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio, r, lpe) for r in rates)
        self.norm = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_size("vitpose", x, self.patch, f"the patch size {self.patch}")
        t = self.patch_embed(self.normalize(x))
        b, d, h, w = t.shape
        if self.gpe is not None:
            t = t + self.gpe(h, w)
        if self.ape is not None:
            ape = self.ape if self.ape.shape[-2:] == (h, w) else \
                F.interpolate(self.ape, size=(h, w), mode="bilinear", align_corners=False)
            t = t + ape
        tokens = t.flatten(2).transpose(1, 2)
        for blk in self.blocks:
            tokens = blk(tokens, (h, w))
        return self.norm(tokens).transpose(1, 2).reshape(b, d, h, w)


def _init_vit(module: nn.Module) -> None:
    """ViTPose / ResFormer: Linear trunc-normal(0.02) with zero bias, LayerNorm 1/0 (convolutions untouched)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class ViTPose(FedModel):
    """ViTPose with ResFormer's GPE/LPE (RAF's backbone); see the module docstring."""

    def __init__(self, joints: int, patch: int = 16, dim: int = 96, depth: int = 4, heads: int = 3,
                 mlp_ratio: float = 4.0, drop_path: float = 0.0, gpe: bool = True, lpe: bool = True,
                 ape_grid: tuple[int, int] | None = None, head: str = "deconv", deconv_filters: int = 64,
                 norm: str = "batch", group_norm_groups: int = 2):
        super().__init__()
        if patch < OUTPUT_STRIDE or patch & (patch - 1):
            raise ValueError(f"vitpose patch must be a power of two >= {OUTPUT_STRIDE} (heatmaps at H/4), got {patch}")
        if dim % heads:
            raise ValueError(f"vitpose dim {dim} is not divisible by heads {heads}")
        if gpe and dim % 4:
            raise ValueError(f"vitpose with gpe needs dim divisible by 4 (sine and cosine of rows and columns), "
                             f"got {dim}")
        self.patch = patch
        self.stride_multiple = patch
        self.output_stride = OUTPUT_STRIDE
        self.feature_dim = dim
        self.backbone = ViTBackbone(patch, dim, depth, heads, mlp_ratio, drop_path, gpe, lpe, ape_grid)
        _init_vit(self.backbone)
        up = patch // OUTPUT_STRIDE
        if head == "deconv":
            self.head = HeatmapHead(dim, joints, up.bit_length() - 1, deconv_filters, norm, group_norm_groups)
        elif head == "simple":
            self.head = SimpleUpsampleHead(dim, joints, up)
        else:
            raise ValueError(f"unknown vitpose head {head!r} (expected 'deconv' or 'simple')")

    def blocks(self) -> dict[str, list[str]]:
        """The embedding (patch embedding, GPE, APE), every transformer block, the final norm, the head."""
        bb = self.backbone
        embed = state_keys(bb.patch_embed, "backbone.patch_embed")
        if bb.gpe is not None:
            embed += state_keys(bb.gpe, "backbone.gpe")
        if bb.ape is not None:
            embed.append("backbone.ape")
        out = {"backbone.embed": embed}
        for i, blk in enumerate(bb.blocks):
            out[f"backbone.blocks.{i}"] = state_keys(blk, f"backbone.blocks.{i}")
        out["backbone.norm"] = state_keys(bb.norm, "backbone.norm")
        out["head"] = state_keys(self.head, "head")
        return out


class ViTPoseParams(Params):
    patch: Literal[4, 8, 16, 32] = Field(
        16, description="patch size P; inputs must be multiples of P (ViTPose: 16; 8 for the CPU ladder 128x96, "
        "96x72, 64x48)")
    dim: int = Field(96, ge=4, description="embedding dimension D (ViT-S: 384, ViT-B: 768)")
    depth: int = Field(4, ge=0, description="transformer blocks L (ViT-S/B: 12)")
    heads: int = Field(3, ge=1, description="attention heads; must divide dim (ViTPose-S: 12)")
    mlp_ratio: float = Field(4.0, gt=0, description="MLP hidden size / D")
    drop_path: float = Field(0.0, ge=0, lt=1, description="stochastic depth rate of the last block, linear from 0 "
                             "(ViTPose-S MPII: 0.3)")
    gpe: bool = Field(
        True, description="ResFormer global position embedding: depth-wise 3x3 conv of a sine-cosine grid")
    lpe: bool = Field(
        True, description="ResFormer local position embedding: zero-initialised depth-wise 3x3 conv on V")
    ape: bool = Field(False, description="learned absolute position embedding on ape_grid, bilinearly resized to other "
                      "grids (ViT's APE, for comparison)")
    ape_grid: tuple[int, int] | None = Field(None, description="[h, w] token grid of the APE; default io.image_size / "
                                             "patch (square)")
    head: Literal["deconv", "simple"] = Field("deconv", description="'deconv': ViTPose's classic decoder, log2(P/4) "
                                              "deconvolutions + 1x1 conv; 'simple': ReLU, bilinear x P/4, 3x3 conv")
    deconv_filters: int = Field(64, ge=1, description="channels of the head's deconvolutions (ViTPose: 256)")
    norm: Literal["batch", "group"] = Field("batch", description="normalisation of the head's deconvolutions")
    group_norm_groups: int = Field(2, gt=0, description="GroupNorm groups (norm = 'group')")


def _vitpose_deconvs(p: ViTPoseParams) -> int:
    return (p.patch // OUTPUT_STRIDE).bit_length() - 1 if p.head == "deconv" else 0


def _vitpose_provides(p: ViTPoseParams) -> frozenset[str]:
    out = {"parameter_groups", "norm_layers"}  # LayerNorms in every block
    if _vitpose_deconvs(p):
        out |= norm_capabilities(p.norm)
    return frozenset(out)


@MODELS.register("vitpose", params=ViTPoseParams, task="keypoints", provides=_vitpose_provides,
                 help="ViTPose (Xu et al. 2022) with ResFormer GPE/LPE conv position embeddings (RAF), heatmaps at H/4")
def build_vitpose(p: ViTPoseParams, *, io: ModelIO) -> ViTPose:
    _check_io(io)
    ape_grid = None
    if p.ape:
        if p.ape_grid is not None:
            ape_grid = p.ape_grid
        elif io.image_size is not None and io.image_size % p.patch == 0:
            ape_grid = (io.image_size // p.patch,) * 2
        else:
            raise ValueError(f"vitpose with ape = true needs ape_grid or an io.image_size that is a multiple of the "
                             f"patch size {p.patch} (got image_size {io.image_size})")
        if min(ape_grid) < 1:
            raise ValueError(f"vitpose ape_grid must be positive, got {list(ape_grid)}")
    return ViTPose(io.num_outputs, p.patch, p.dim, p.depth, p.heads, p.mlp_ratio, p.drop_path, p.gpe, p.lpe, ape_grid,
                   p.head, p.deconv_filters, p.norm, p.group_norm_groups)
