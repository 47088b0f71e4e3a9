"""Vision Transformers for classification (Dosovitskiy et al. 2021) in timm's layout, so timm's published
``vit_small_patch16_224`` / ``vit_base_patch16_224`` checkpoints load.

The architecture is timm's ``VisionTransformer`` with its defaults for these models: a ``patch``-strided
convolution embeds patches (``patch_embed.proj``); a learned class token (``cls_token``) is prepended and a learned
absolute position embedding (``pos_embed``, class token included) added; ``depth`` pre-norm blocks of multi-head
self-attention (one ``qkv`` linear with bias, ``proj``) and an MLP (``fc1``, exact GELU, ``fc2``), each with a
residual, LayerNorms with eps 1e-6; a final LayerNorm (``norm``); the class token's features go to the linear
``head`` (timm's ``global_pool = "token"``). Dropout and stochastic depth are off by default (``drop_path``).

Sizes: ``vit_s16`` is ViT-S/16 (384 wide, 12 blocks, 6 heads, MLP 1536; 22.05M parameters with 1000 classes, as
timm lists), ``vit_b16`` ViT-B/16 (768, 12, 12, 3072; 86.57M). ``image_size`` sets the position embedding's grid
(``ceil(image_size / patch)`` a side, the image size of the task by default; a side that is not a multiple of the
patch is zero-padded on the right and bottom, as timm's ``dynamic_img_pad`` does); a checkpoint trained at another size has its
position embedding resampled on loading (``adapt_checkpoint``: bicubic with antialiasing over the patch grid, the
class token's entry kept, as timm's ``resample_abs_pos_embed`` does). Initialisation: timm's (truncated normal,
std 0.02, for linears and the embeddings; LayerNorm weight 1, bias 0; the patch convolution as a linear), from
torch's global generator.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedsight.models.base import FedModel, ModelIO, state_keys
from fedsight.registry import MODELS, Params

#: name -> (width, depth, heads), timm's
SIZES = {"vit_s16": (384, 12, 6), "vit_b16": (768, 12, 12)}


class ViTParams(Params):
    patch: int = Field(16, ge=1, description="patch side (the published models: 16)")
    image_size: int | None = Field(None, ge=1, description="the image side the position embedding is laid out for "
                                   "(default: the task's image size)")
    mlp_ratio: float = Field(4.0, gt=0)
    drop_path: float = Field(0.0, ge=0, lt=1, description="stochastic depth rate of the last block (linear in depth)")


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float, drop_path: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.drop_path = drop_path

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop_path == 0.0:
            return x
        keep = torch.rand(x.shape[0], 1, 1, dtype=x.dtype, device=x.device) >= self.drop_path
        return x * keep / (1.0 - self.drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._drop(self.attn(self.norm1(x)))
        return x + self._drop(self.mlp(self.norm2(x)))


class PatchEmbed(nn.Module):
    def __init__(self, patch: int, in_channels: int, dim: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class ViTBackbone(nn.Module):
    def __init__(self, dim: int, depth: int, heads: int, p: ViTParams, in_channels: int, image_size: int):
        super().__init__()
        self.patch, self.size, self.grid = p.patch, image_size, -(-image_size // p.patch)
        self.patch_embed = PatchEmbed(p.patch, in_channels, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + self.grid**2, dim))
        rates = [p.drop_path * i / max(1, depth - 1) for i in range(depth)]
        self.blocks = nn.Sequential(*[Block(dim, heads, p.mlp_ratio, r) for r in rates])
        self.norm = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        if (h, w) != (self.size, self.size):
            raise ValueError(f"vit: input {h}x{w}, but the position embedding is laid out for {self.size}x{self.size} "
                             "(model.image_size)")
        pad = self.grid * self.patch - self.size
        x = self.patch_embed(F.pad(x, (0, pad, 0, pad)) if pad else x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.norm(self.blocks(x))[:, 0]


def resample_pos_embed(pos: torch.Tensor, grid: int) -> torch.Tensor:
    """A ``[1, 1 + g*g, D]`` position embedding (class token first) on a ``grid`` x ``grid`` patch grid: the class
    token's entry kept, the patch grid resampled bicubically with antialiasing (timm's ``resample_abs_pos_embed``)."""
    old = math.isqrt(pos.shape[1] - 1)
    if old * old != pos.shape[1] - 1:
        raise ValueError(f"pos_embed {list(pos.shape)} is not a class token and a square grid")
    if old == grid:
        return pos
    cls, patches = pos[:, :1], pos[:, 1:]
    dtype = patches.dtype
    img = patches.reshape(1, old, old, -1).permute(0, 3, 1, 2).float()
    img = F.interpolate(img, size=(grid, grid), mode="bicubic", antialias=True, align_corners=False)
    return torch.cat([cls, img.permute(0, 2, 3, 1).reshape(1, grid * grid, -1).to(dtype)], dim=1)


class VisionTransformer(FedModel):
    def __init__(self, size: str, p: ViTParams, *, num_classes: int, in_channels: int, image_size: int):
        super().__init__()
        dim, depth, heads = SIZES[size]
        self.backbone = ViTBackbone(dim, depth, heads, p, in_channels, image_size)
        self.feature_dim = dim
        self.head = nn.Linear(dim, num_classes)
        self.apply(_init)
        nn.init.trunc_normal_(self.backbone.pos_embed, std=0.02)
        nn.init.normal_(self.backbone.cls_token, std=1e-6)

    def adapt_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A checkpoint's position embedding resampled to this model's patch grid (``resample_pos_embed``)."""
        key = "backbone.pos_embed"
        if key in state and state[key].shape != self.backbone.pos_embed.shape:
            state = {**state, key: resample_pos_embed(state[key], self.backbone.grid)}
        return state

    def blocks(self) -> dict[str, list[str]]:
        """The embeddings (patch, class token, position), every transformer block, the final norm, the head."""
        b = self.backbone
        out = {"backbone.embed": state_keys(b.patch_embed, "backbone.patch_embed") + ["backbone.cls_token",
                                                                                    "backbone.pos_embed"]}
        for i, block in enumerate(b.blocks):
            out[f"backbone.blocks.{i}"] = state_keys(block, f"backbone.blocks.{i}")
        out["backbone.norm"] = state_keys(b.norm, "backbone.norm")
        out["head"] = state_keys(self.head, "head")
        return out


def _init(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Conv2d):  # timm's PatchEmbed: lecun-normal-free default, trunc normal as a linear
        nn.init.trunc_normal_(m.weight.view(m.weight.shape[0], -1), std=0.02)
        nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


def _register(size: str, help: str) -> None:
    def build(p: ViTParams, *, io: ModelIO) -> FedModel:
        if not (p.image_size or io.image_size):
            raise ValueError("the task gives no image size for the position embedding: set model.image_size")
        return VisionTransformer(size, p, num_classes=io.num_outputs, in_channels=io.in_channels,
                                 image_size=p.image_size or io.image_size)

    MODELS.register(size, params=ViTParams, help=help, provides=frozenset({"parameter_groups", "linear_head",
                                                                                "norm_layers"}))(build)


_register("vit_s16", "ViT-S/16 in timm's layout (384 wide, 12 blocks; loads timm's vit_small_patch16_* weights)")
_register("vit_b16", "ViT-B/16 in timm's layout (768 wide, 12 blocks; loads timm's vit_base_patch16_* weights)")
