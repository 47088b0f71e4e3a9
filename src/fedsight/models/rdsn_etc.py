"""The RDSN as its authors release it (``rdsn_etc``): Wang et al., "A Novel Encryption-Then-Lossy-Compression
Scheme of Color Images Using Customized Residual Dense Spatial Network" (IEEE TMM 2023), code
``tianjian1201/ETC-RDSN`` (an EDSR-PyTorch fork; the model is ``src/model/rdn.py`` with ``src/model/unet.py`` and
``src/model/unet_parts.py``, read at commit c6faf4d). PPFL-RDSN (He & Joshi) trains this network federated and
defers its architecture to Wang et al. FedSight's ``rdsn`` (``models/rdsn.py``) is a smaller reading of the
paper's text; this module is the authors' code, exact enough to load their checkpoints
(``fedsight.weights_sr``, layout ``etc_rdsn``).

The network (G0 = ``features``, D = ``blocks``, C = ``layers``, G = ``growth``; the authors run RDN's config B,
G0 = 64, D = 16, C = 8, G = 64):

* mean shift: ``x <- (x - m) r`` with m the DIV2K RGB mean and r = ``rgb_range`` (the authors train at 255:
  EDSR-PyTorch's ``MeanShift(rgb_range)`` on images in [0, 255]; FedSight's images are in [0, 1], so the scaling
  is part of the model and the output is ``y / r + m``). The mean is a non-persistent buffer, as EDSR's: a
  checkpoint's frozen ``sub_mean`` / ``add_mean`` convs are checked against it on loading, not loaded;
* shallow features ``SFENet``: two 3x3 convs, then D residual dense blocks (RDN's, the same
  ``ResidualDenseBlock`` as ``rdsn``) and global feature fusion (1x1 ``D G0 -> G0``, 3x3); **no** ``+ F_-1``
  global residual (the authors drop RDN's);
* "spatial attention": a U-Net on the mean-shifted input whose G0-channel output (a 1x1 conv, no sigmoid)
  multiplies the fused features. The U-Net (``UNetAttention``) is the authors': double 3x3 conv + ReLU stages,
  2x2 max-pooling down, ``PixelShuffle(2)`` up (their ``subpixel = True``), the upsampled map zero-padded on the
  right and bottom to the skip's size (their ``F.pad``: an odd size loses a row in pooling), concatenated after
  the skip (``[skip, up]``), widths ``w, 2w, 4w, 8w, 8w`` for ``depth`` 4 and ``w`` = 64 (``unet_width``,
  ``unet_depth``; a multiple of 4 so that ``PixelShuffle`` divides the channels). The inputs must be at least
  ``2^depth`` pixels a side (a clear error otherwise); the authors' training patches are 64 (x2);
* learned skip ("global skip connection"): a second sub-pixel upsampler on the mean-shifted input
  (``UPNet2``: ``conv(3 -> G s^2) + PixelShuffle``, x4 two x2 stages) added to the upsampled features
  (``UPNet1``) before the output conv ``G -> 3``;
* the uniform down-sampling constraint (``udc``) is FedSight's ``apply_udc`` on the output in [0, 1], as for
  ``rdsn``: the authors apply it in their test loop (``sr_insert.insert``: ``sr[x s][y s] = hr[x s][y s]``,
  offset 0), not in the network.

Choices: default PyTorch initialisation (the authors', no down-scaled output conv: the skip is learned, not an
interpolation); defaults are CPU-sized (G0 = 32, D = 4, C = 4, G = 16, U-Net width 16, depth 2) so that the
8x8 patches of the tests and demos pass the U-Net; the authors' configuration is ``features = 64, blocks = 16,
layers = 8, growth = 64, unet_width = 64, unet_depth = 4, rgb_range = 255``. ``attention = false`` and
``learned_skip = false`` are the authors' ablations (their ``noSM`` and ``noGSC`` runs).

Structure for FedSight: ``backbone`` is everything at LR resolution (shallow features, dense blocks, global
fusion and the U-Net attention; ``features(x)`` is the attended G0-channel map of the mean-shifted input),
``head`` the two upsamplers and the output conv; the forward feeds the input to both, so ``split_head = False``.
No normalisation layers (Opacus' per-example gradients work). Vectorised training uses the fused forward
(``fedsight.training.fused``): the U-Net's padding (``pad_to``) reads the maps' sizes, so it is one operation for
``torch.fx`` that the fused forward applies to all the clients' channels at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedsight.models.base import FedModel, ModelIO, state_keys
from fedsight.models.rdsn import (DIV2K_MEAN, SR_PROVIDES, ResidualDenseBlock, SubPixelUpsampler, _check_scale, _conv,
                                  adapt_mean_shift, apply_udc)
from fedsight.registry import MODELS, Params

__all__ = ["ETCRDSN", "UNetAttention"]


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    """The U-Net's stage: ``conv3x3, ReLU, conv3x3, ReLU`` (state keys ``0.*`` and ``2.*``)."""
    return nn.Sequential(_conv(cin, cout), nn.ReLU(), _conv(cout, cout), nn.ReLU())


def pad_to(up: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """``up`` zero-padded on the right and bottom to ``skip``'s spatial size (it is 0 or 1 smaller: the authors'
    ``F.pad(x1, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])`` for those differences)."""
    dy, dx = skip.shape[-2] - up.shape[-2], skip.shape[-1] - up.shape[-1]
    return F.pad(up, (0, dx, 0, dy)) if dx or dy else up


# one operation for torch.fx (it reads shapes): the vectorised engine's fused forward pads all the clients' channels at
# once (``fedsight.training.fused``), as it applies ``apply_udc``
torch.fx.wrap("pad_to")
torch.fx.wrap("apply_udc")  # (torch.fx patches a name in the module that wraps it: this module's import too)


class UNetAttention(nn.Module):
    """The authors' U-Net (``UNet(n_colors, G0, subpixel=True)``) at width ``w`` and ``depth`` poolings: encoder
    ``enc.0`` (the authors' ``inc``) and ``enc.i`` (``down{i}``, after a 2x2 max-pool), widths ``w 2^i`` capped
    at ``w 2^(depth-1)``; decoder ``dec.k`` (``up{k+1}``): ``PixelShuffle(2)`` of the deeper map (a quarter of its
    channels), padded to the skip's size, ``[skip, up]`` through a double conv; ``out`` a 1x1 conv to
    ``out_channels``. Depth 4, width 64: ``64, 128, 256, 512, 512`` down, ``640 -> 256, 320 -> 128, 160 -> 64,
    80 -> 64`` up, as the authors'."""

    def __init__(self, in_channels: int, out_channels: int, width: int = 64, depth: int = 4):
        super().__init__()
        if width % 4 or width < 4 or depth < 1:
            raise ValueError(f"unet_width must be a positive multiple of 4 and unet_depth >= 1, got {width}, {depth}")
        self.depth = depth
        widths = [width * 2 ** i for i in range(depth)]
        widths.append(widths[-1])
        self.enc = nn.ModuleList([_double_conv(in_channels, width)]
                                 + [_double_conv(widths[i - 1], widths[i]) for i in range(1, depth + 1)])
        dec, deeper = [], widths[depth]
        for k in range(1, depth + 1):
            out = widths[depth - k - 1] if k < depth else width
            dec.append(_double_conv(deeper // 4 + widths[depth - k], out))
            deeper = out
        self.dec = nn.ModuleList(dec)
        self.pool = nn.MaxPool2d(2)
        self.shuffle = nn.PixelShuffle(2)
        self.out = _conv(width, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        h = self.enc[0](x)
        for stage in self.enc[1:]:
            skips.append(h)
            h = stage(self.pool(h))
        for stage in self.dec:
            skip = skips.pop()
            h = stage(torch.cat([skip, pad_to(self.shuffle(h), skip)], dim=1))
        return self.out(h)


class ETCTrunk(nn.Module):
    """Shallow features, dense blocks, global feature fusion, times the U-Net attention (no global residual)."""

    def __init__(self, in_channels: int, features: int, blocks: int, layers: int, growth: int, attention: bool,
                 unet_width: int, unet_depth: int):
        super().__init__()
        self.sfe = nn.Sequential(_conv(in_channels, features), _conv(features, features))
        self.rdbs = nn.ModuleList(ResidualDenseBlock(features, growth, layers) for _ in range(blocks))
        self.gff = nn.Sequential(_conv(blocks * features, features, 1), _conv(features, features))
        self.attention = UNetAttention(in_channels, features, unet_width, unet_depth) if attention else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.sfe(x)
        outs = []
        for rdb in self.rdbs:
            h = rdb(h)
            outs.append(h)
        fused = self.gff(torch.cat(outs, dim=1))
        return fused if self.attention is None else fused * self.attention(x)


class ETCHead(nn.Module):
    """The features' sub-pixel upsampler (``UPNet1``), the learned skip's (``UPNet2``) and the output conv."""

    def __init__(self, features: int, growth: int, scale: int, in_channels: int, out_channels: int, learned_skip: bool):
        super().__init__()
        self.up = SubPixelUpsampler(features, growth, scale)
        self.skip = SubPixelUpsampler(in_channels, growth, scale) if learned_skip else None
        self.out = _conv(growth, out_channels)

    def forward(self, features: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = self.up(features)
        return self.out(h if self.skip is None else h + self.skip(x))


class ETCRDSN(FedModel):
    """The RDSN authors' network; see the module docstring."""

    split_head = False

    def __init__(self, scale: int, features: int = 32, blocks: int = 4, layers: int = 4, growth: int = 16,
                 attention: bool = True, unet_width: int = 16, unet_depth: int = 2, learned_skip: bool = True,
                 mean_shift: bool = True, rgb_range: float = 1.0, udc: bool = False, udc_offset: int = 0,
                 in_channels: int = 3, out_channels: int = 3):
        super().__init__()
        _check_scale(scale)
        if udc and not 0 <= udc_offset < scale:
            raise ValueError(f"udc_offset must be in [0, scale) = [0, {scale}), got {udc_offset}")
        if udc and in_channels != out_channels:
            raise ValueError("the UDC needs as many output channels as input channels")
        if mean_shift and (in_channels, out_channels) != (3, 3):
            raise ValueError("the DIV2K mean shift is defined for RGB (3-channel) images")
        self.scale, self.udc, self.udc_offset = scale, udc, udc_offset
        self.mean_shift, self.rgb_range = mean_shift, float(rgb_range)
        self.min_side = 2 ** unet_depth if attention else 1
        self.feature_dim = features
        self.backbone = ETCTrunk(in_channels, features, blocks, layers, growth, attention, unet_width, unet_depth)
        self.head = ETCHead(features, growth, scale, in_channels, out_channels, learned_skip)
        self.register_buffer("rgb_mean", torch.tensor(DIV2K_MEAN).view(1, 3, 1, 1), persistent=False)

    def _shift(self, x: torch.Tensor) -> torch.Tensor:
        if self.mean_shift:
            x = x - self.rgb_mean.to(x.dtype)
        return x * self.rgb_range if self.rgb_range != 1 else x

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(self._shift(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and x.ndim != 4:  # (not while torch.fx traces the forward: a Proxy)
            raise ValueError(f"rdsn_etc expects LR images [B, C, h, w], got shape {tuple(x.shape)}")
        if isinstance(x, torch.Tensor) and min(x.shape[-2:]) < self.min_side:
            raise ValueError(f"rdsn_etc's U-Net attention pools {self.min_side.bit_length() - 1} times: LR inputs "
                             f"need at least {self.min_side} pixels a side, got {tuple(x.shape[-2:])}")
        shifted = self._shift(x)
        out = self.head(self.backbone(shifted), shifted)
        if self.rgb_range != 1:
            out = out * (1.0 / self.rgb_range)
        if self.mean_shift:
            out = out + self.rgb_mean.to(out.dtype)
        if self.udc:
            out = apply_udc(out, x, self.scale, self.udc_offset)
        return out

    def adapt_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A checkpoint's frozen mean-shift convs (``sub_mean``, ``add_mean``) checked against the model's mean
        shift and ``rgb_range``, then dropped (``rdsn.adapt_mean_shift``)."""
        return adapt_mean_shift(state, self.mean_shift, self.rgb_range)

    def blocks(self) -> dict[str, list[str]]:
        """Shallow features, one block per RDB, global fusion, the U-Net attention (if any), head."""
        bb = self.backbone
        out = {"backbone.sfe": state_keys(bb.sfe, "backbone.sfe")}
        for i, rdb in enumerate(bb.rdbs):
            out[f"backbone.rdbs.{i}"] = state_keys(rdb, f"backbone.rdbs.{i}")
        out["backbone.gff"] = state_keys(bb.gff, "backbone.gff")
        if bb.attention is not None:
            out["backbone.attention"] = state_keys(bb.attention, "backbone.attention")
        out["head"] = state_keys(self.head, "head")
        return out


class ETCRDSNParams(Params):
    features: int = Field(32, ge=1, description="G0, feature channels (authors: 64)")
    blocks: int = Field(4, ge=1, description="D, residual dense blocks (authors: 16)")
    layers: int = Field(4, ge=1, description="C, conv layers per dense block (authors: 8)")
    growth: int = Field(16, ge=1, description="G, growth rate and channels after the upsamplers (authors: 64)")
    attention: bool = Field(True, description="multiply the fused features by the U-Net's output")
    unet_width: int = Field(16, ge=4, multiple_of=4, description="the U-Net's first width w (authors: 64)")
    unet_depth: int = Field(2, ge=1, le=6, description="the U-Net's poolings (authors: 4); inputs >= 2^depth a side")
    learned_skip: bool = Field(True, description="add a sub-pixel upsampling of the input before the output conv")
    mean_shift: bool = Field(True, description="subtract the DIV2K RGB mean before and add it after the network")
    rgb_range: float = Field(1.0, gt=0, description="the network's value range; [0, 1] inputs scaled by it (authors: 255)")
    udc: bool = Field(False, description="uniform down-sampling constraint: output pixels (o+s i, o+s j) are the input pixels")
    udc_offset: int = Field(0, ge=0, le=3, description="o, the kept pixels' offset in each s x s cell (< scale)")


@MODELS.register("rdsn_etc", params=ETCRDSNParams, task="image_sr", provides=SR_PROVIDES,
                 help="the RDSN authors' network (RDN, U-Net attention, learned sub-pixel skip; ETC-RDSN)")
def build_rdsn_etc(params: ETCRDSNParams, *, io: ModelIO) -> ETCRDSN:
    return ETCRDSN(io.scale, params.features, params.blocks, params.layers, params.growth, params.attention,
                   params.unet_width, params.unet_depth, params.learned_skip, params.mean_shift, params.rgb_range,
                   params.udc, params.udc_offset, in_channels=io.in_channels, out_channels=io.num_outputs or 3)
