"""ViTPose-S and ViTPose-B as the official ViTPose release defines them, so its published checkpoints load
(``vitpose_s``, ``vitpose_b``; task family ``"keypoints"``).

Read from ``ViTAE-Transformer/ViTPose``: ``mmpose/models/backbones/vit.py`` (``ViT``, ``PatchEmbed``, ``Block``,
``Attention``, ``Mlp``), ``mmpose/models/heads/topdown_heatmap_simple_head.py`` (``TopdownHeatmapSimpleHead``),
``configs/body/2d_kpt_sview_rgb_img/topdown_heatmap/coco/ViTPose_{small,base}[_simple]_coco_256x192.py`` and
``mmcv_custom/checkpoint.py`` (``load_checkpoint``: how a position embedding of another grid is resampled).

**Contract** (the keypoint family's, see ``fedsight.models.pose``): ``forward(x)`` maps ``[B, 3, H, W]`` in [0, 1]
to ``[B, J, H/4, W/4]`` heatmaps for any H, W that are multiples of 16 (``stride_multiple``); another size is a
``ValueError`` naming 16. The ImageNet mean/std normalisation is inside (non-persistent buffers, not state).

**Backbone** (``ViT`` with the configs' ``patch_size=16, ratio=1, mlp_ratio=4, qkv_bias=True``):

* ``patch_embed.proj``: ``Conv2d(3, D, 16, stride=16, padding=2)``; the release's padding ``4 + 2 (ratio // 2 - 1)``
  is 2 at ratio 1. For a multiple of 16 it gives the same H/16 x W/16 grid as an unpadded convolution, every
  patch window shifted up and left by 2 pixels: the first row and column of windows reach into the zero padding, and
  the image's last 2 rows and columns fall in no window.
* ``pos_embed``: a learned ``[1, 1 + h w, D]`` embedding for the grid of ``image_size`` (256x192: 16x12, the
  configs' ``img_size``), initialised trunc-normal(0.02). Its first entry is the class-token slot that the
  release keeps "since the pretraining model has class token"; there is no class token, and the release adds
  that slot to every patch token: ``x + pos_embed[:, 1:] + pos_embed[:, :1]`` (the same sum here).
* ``blocks``: ``depth`` pre-norm blocks (``fedsight.models.pose.Block`` without LPE: LayerNorm eps 1e-6,
  multi-head attention with qkv bias and scale ``head_dim^-0.5``, MLP ``D -> 4D -> D`` with exact GELU),
  stochastic depth ``linspace(0, drop_path, depth)``; no dropout (the configs' ``drop_rate = attn_drop_rate = 0``).
* ``last_norm``: LayerNorm eps 1e-6; the tokens back on the grid, ``[B, D, H/16, W/16]``.

**Heads** (``TopdownHeatmapSimpleHead``): ``head = "deconv"``, the classic decoder (the configs without
``_simple``): 2 x [``ConvTranspose2d(D, 256, 4, stride 2, padding 1, no bias)``, BatchNorm, ReLU] and a 1x1 conv to
J (``fedsight.models.pose.HeatmapHead``); ``head = "simple"`` (``ViTPose_base_simple``: ``num_deconv_layers=0,
upsample=4, final_conv_kernel=3``): ReLU, bilinear upsampling x4 (``align_corners=False``), a 3x3 conv to J
(``SimpleUpsampleHead``). Initialisation as the release: backbone Linear trunc-normal(0.02) with bias 0, LayerNorm
1/0, patch convolution PyTorch's default; head deconvolution and final weights N(0, 0.001^2), final bias 0,
BatchNorm 1/0.

**Sizes.** ``vitpose_s``: D = 384, 12 blocks, 12 heads (``ViTPose_small``); ``vitpose_b``: D = 768, 12 blocks,
12 heads (``ViTPose_base``); ``drop_path`` 0.3 (both classic configs; ``ViTPose_small_simple`` uses 0.1).
``dim``, ``depth``, ``heads`` and ``deconv_filters`` can be lowered for CPU runs and tests (the published weights
need the defaults). The backbones have timm's ViT-S/16 and ViT-B/16 parameter counts less the classifier, the
class token and 4 position slots (196 + 1 at 224x224 against 192 + 1 at 256x192): 21,663,744 and 85,794,816.

**Other input sizes** (choice made here). The release adds ``pos_embed`` as it is, so its model runs at
``img_size`` only; to run at another size it builds the model for that size and its ``load_checkpoint`` resamples
the checkpoint's embedding bicubically (``align_corners=False``, no antialiasing), the class-token slot kept. This
model does the same in both places: a checkpoint whose embedding has another grid is resampled on loading
(``adapt_checkpoint``), and an input whose grid differs from ``image_size``'s has the embedding resampled for that
forward pass (the same function; training at several resolutions, as RAF does, trains one embedding). The
release's loader assumes a square checkpoint grid (MAE's 14x14), which a 256x192 ViTPose checkpoint (192
positions) is not; here the checkpoint's grid is a square when its position count is a square, otherwise the
grid with the model's aspect ratio (192 -> 16x12 for a 4:3 model); a count that is neither is refused with one
line saying to build the model at the checkpoint's ``image_size``.

**Departures**: attention by ``scaled_dot_product_attention`` (under vmap by matrix products: the same
softmax(q k^T / sqrt(d)) v); flip test, UDP and heatmap post-processing are evaluation choices outside the model;
``norm = "group"`` (GroupNorm in the classic head) exists for recipes without BatchNorm and loads no published head.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedsight.models.base import FedModel, ModelIO, norm_capabilities, state_keys
from fedsight.models.pose import (OUTPUT_STRIDE, Block, HeatmapHead, ImageNetNorm, SimpleUpsampleHead, _check_io,
                                  _init_vit, check_size)
from fedsight.registry import MODELS, Params

__all__ = ["PATCH", "ViTPoseOfficial", "checkpoint_grid", "resample_pos_embed"]

#: the configs' patch size (ratio 1)
PATCH = 16
#: PatchEmbed's ``padding = 4 + 2 * (ratio // 2 - 1)`` at ratio 1
PATCH_PADDING = 2


def resample_pos_embed(pos: torch.Tensor, old: tuple[int, int], new: tuple[int, int]) -> torch.Tensor:
    """A ``[1, 1 + h w, D]`` embedding on the ``old`` (h, w) grid resampled to ``new``: the class-token slot kept,
    the grid bicubically with ``align_corners=False`` and no antialiasing (ViTPose's ``load_checkpoint``)."""
    if tuple(old) == tuple(new):
        return pos
    cls, grid = pos[:, :1], pos[:, 1:]
    img = grid.reshape(grid.shape[0], old[0], old[1], grid.shape[-1]).permute(0, 3, 1, 2)
    img = F.interpolate(img, size=tuple(new), mode="bicubic", align_corners=False)
    return torch.cat([cls, img.permute(0, 2, 3, 1).flatten(1, 2)], dim=1)


def checkpoint_grid(positions: int, model_grid: tuple[int, int]) -> tuple[int, int]:
    """The (h, w) grid of a checkpoint's ``positions`` patch positions: a square when ``positions`` is one (MAE's,
    ImageNet's), otherwise the factorisation with ``model_grid``'s aspect ratio; a ``ValueError`` otherwise."""
    side = math.isqrt(positions)
    if side * side == positions:
        return side, side
    gh, gw = model_grid
    g = math.gcd(gh, gw)
    a, b = gh // g, gw // g
    k = math.isqrt(positions // (a * b)) if positions % (a * b) == 0 else 0
    if k and a * b * k * k == positions:
        return a * k, b * k
    raise ValueError(f"backbone.pos_embed has {positions} patch positions: neither a square grid nor one of the "
                     f"model's {gh}:{gw} aspect ratio (its grid is {gh}x{gw}); build the model with model.image_size "
                     "set to the [H, W] the checkpoint was trained at")


class PatchEmbed(nn.Module):
    """``proj``: ``Conv2d(3, D, 16, stride=16, padding=2)``, ViTPose's ``PatchEmbed`` at ratio 1."""

    def __init__(self, dim: int, in_channels: int = 3):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, PATCH, stride=PATCH, padding=PATCH_PADDING)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class ViTPoseBackbone(nn.Module):
    """Normalisation, padded patch embedding, absolute position embedding (class-token slot added to every token),
    pre-norm blocks, ``last_norm``; ``[B, D, H/16, W/16]``."""

    def __init__(self, dim: int, depth: int, heads: int, drop_path: float, grid: tuple[int, int], name: str):
        super().__init__()
        self.name, self.grid = name, tuple(grid)
        self.normalize = ImageNetNorm()
        self.patch_embed = PatchEmbed(dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + grid[0] * grid[1], dim))
        rates = [drop_path * i / max(depth - 1, 1) for i in range(depth)]  # linspace(0, drop_path, depth), meta-safe
        self.blocks = nn.ModuleList(Block(dim, heads, 4.0, r, lpe=False) for r in rates)
        self.last_norm = nn.LayerNorm(dim, eps=1e-6)

    def position(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The patch positions ``[1, h w, D]`` and the class-token slot ``[1, 1, D]`` for an h x w grid."""
        pos = resample_pos_embed(self.pos_embed, self.grid, (h, w))
        return pos[:, 1:], pos[:, :1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_size(self.name, x, PATCH, f"the patch size {PATCH}")
        t = self.patch_embed(self.normalize(x))
        b, d, h, w = t.shape
        patches, cls_slot = self.position(h, w)
        tokens = t.flatten(2).transpose(1, 2) + patches + cls_slot
        for blk in self.blocks:
            tokens = blk(tokens, (h, w))
        return self.last_norm(tokens).transpose(1, 2).reshape(b, d, h, w)


class ViTPoseOfficial(FedModel):
    """ViTPose (backbone + classic or simple decoder) in the release's layout; see the module docstring."""

    def __init__(self, name: str, joints: int, dim: int, depth: int, heads: int, drop_path: float,
                 image_size: tuple[int, int], head: str, deconv_filters: int, norm: str, group_norm_groups: int):
        super().__init__()
        self.stride_multiple, self.output_stride, self.feature_dim = PATCH, OUTPUT_STRIDE, dim
        self.image_size = tuple(image_size)
        grid = (image_size[0] // PATCH, image_size[1] // PATCH)
        self.backbone = ViTPoseBackbone(dim, depth, heads, drop_path, grid, name)
        _init_vit(self.backbone)
        nn.init.trunc_normal_(self.backbone.pos_embed, std=0.02)
        if head == "deconv":
            self.head = HeatmapHead(dim, joints, 2, deconv_filters, norm, group_norm_groups)
        else:
            self.head = SimpleUpsampleHead(dim, joints, PATCH // OUTPUT_STRIDE)

    def adapt_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A checkpoint's ``backbone.pos_embed`` for another grid resampled to this model's (``checkpoint_grid``,
        ``resample_pos_embed``); one of another width or rank is left for the loader to report."""
        key, own = "backbone.pos_embed", self.backbone.pos_embed
        pos = state.get(key)
        if pos is None or pos.shape == own.shape or pos.ndim != 3 or pos.shape[0] != 1 or pos.shape[2] != own.shape[2]:
            return state
        old = checkpoint_grid(pos.shape[1] - 1, self.backbone.grid)
        resampled = resample_pos_embed(pos.float(), old, self.backbone.grid).to(pos.dtype)
        return {**state, key: resampled}

    def blocks(self) -> dict[str, list[str]]:
        """The embedding (patch convolution, position embedding), every transformer block, the last norm, the head."""
        bb = self.backbone
        out = {"backbone.embed": state_keys(bb.patch_embed, "backbone.patch_embed") + ["backbone.pos_embed"]}
        for i, blk in enumerate(bb.blocks):
            out[f"backbone.blocks.{i}"] = state_keys(blk, f"backbone.blocks.{i}")
        out["backbone.last_norm"] = state_keys(bb.last_norm, "backbone.last_norm")
        out["head"] = state_keys(self.head, "head")
        return out


class _ViTPoseParams(Params):
    dim: int = Field(384, ge=1, description="embedding width (ViT-S: 384, ViT-B: 768)")
    depth: int = Field(12, ge=1, description="transformer blocks (the release: 12)")
    heads: int = Field(12, ge=1, description="attention heads; must divide dim (the release: 12)")
    drop_path: float = Field(0.3, ge=0, lt=1, description="stochastic depth of the last block, linear from 0 "
                             "(the classic configs: 0.3)")
    image_size: tuple[int, int] = Field((256, 192), description="[H, W] the position embedding is laid out for "
                                        "(the release: 256x192); other sizes resample it")
    head: Literal["deconv", "simple"] = Field("deconv", description="'deconv' (classic): 2 deconvolutions + 1x1 conv; "
                                               "'simple': ReLU, bilinear x4, 3x3 conv")
    deconv_filters: int = Field(256, ge=1, description="channels of the deconvolutions (the release: 256)")
    norm: Literal["batch", "group"] = Field("batch", description="norm of the deconv head (the release: batch)")
    group_norm_groups: int = Field(2, gt=0, description="GroupNorm groups (norm = 'group')")


class ViTPoseSParams(_ViTPoseParams):
    dim: int = Field(384, ge=1, description="embedding width (ViT-S: 384)")


class ViTPoseBParams(_ViTPoseParams):
    dim: int = Field(768, ge=1, description="embedding width (ViT-B: 768)")


def _provides(p: _ViTPoseParams) -> frozenset[str]:
    out = frozenset({"parameter_groups", "norm_layers"})  # LayerNorms in every block
    return out | norm_capabilities(p.norm) if p.head == "deconv" else out


def _register(name: str, params: type[_ViTPoseParams], help: str) -> None:
    def build(p: _ViTPoseParams, *, io: ModelIO) -> ViTPoseOfficial:
        _check_io(io)
        if p.dim % p.heads:
            raise ValueError(f"{name}: model.dim {p.dim} is not divisible by model.heads {p.heads}")
        if any(s % PATCH or s < PATCH for s in p.image_size):
            raise ValueError(f"{name}: model.image_size must be multiples of the patch size {PATCH}, got "
                             f"{list(p.image_size)}")
        return ViTPoseOfficial(name, io.num_outputs, p.dim, p.depth, p.heads, p.drop_path, p.image_size, p.head,
                               p.deconv_filters, p.norm, p.group_norm_groups)

    MODELS.register(name, params=params, task="keypoints", provides=_provides, help=help)(build)


_register("vitpose_s", ViTPoseSParams, "ViTPose-S as the official release defines it (ViT-S/16, 384 wide), heatmaps "
          "at H/4; loads its checkpoints")
_register("vitpose_b", ViTPoseBParams, "ViTPose-B as the official release defines it (ViT-B/16, 768 wide), heatmaps "
          "at H/4; loads its checkpoints")
