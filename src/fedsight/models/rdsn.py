"""Single-image super-resolution models in plain PyTorch: an RDSN-style residual dense network (the model of
issue 13, PPFL-RDSN) and the EDSR baseline. Both map LR images ``[B, 3, h, w]`` in [0, 1] to HR images
``[B, 3, s h, s w]`` for any input size, and are registered in :data:`fedsight.registry.MODELS` with
``task="image_sr"`` as ``factory(params, *, io) -> FedModel`` (``io.scale`` in {2, 3, 4}).

Structure (both): ``self.backbone`` is everything that runs at LR resolution before the upsampler (its
output is ``features(x)``, ``[B, G0, h, w]``), ``self.head`` is the sub-pixel upsampler and the output
convolution. The forward adds things outside ``head(features(x))`` (RDSN: the interpolated-input skip
and the UDC; EDSR: the mean shift), so ``split_head = False``. Parameter groups: ``backbone`` = the
parameters under ``backbone``, ``head`` = those under ``head``, ``norm`` = none (there are no
normalisation layers, so both work with Opacus' per-sample gradients). The only buffer, EDSR's DIV2K
mean, is a non-persistent constant: it is not state and is never aggregated.

``rdsn``: an RDN (Zhang et al. 2018, "Residual Dense Network for Image Super-Resolution") with the RDSN
additions of Wang et al. (IEEE TMM 2023) as the PPFL-RDSN paper (He & Joshi, §2.1) names them:

* shallow feature extraction: two 3x3 convs, ``F_-1 = conv(x)``, ``F_0 = conv(F_-1)``;
* D residual dense blocks (RDB): C layers ``conv3x3 + ReLU`` with growth rate G, each fed the
  concatenation of the block input and every earlier layer's output (``G0 + c G`` channels into layer c),
  local feature fusion (1x1 conv, ``G0 + C G -> G0``) and a local residual;
* global feature fusion: 1x1 conv over the concatenated D block outputs (``D G0 -> G0``), then a 3x3 conv;
* spatial attention (SAM, ``attention = true``). The paper names SAM but does not specify it; here it is
  CBAM's spatial attention (Woo et al. 2018): ``g = sigmoid(conv_k([mean_c(F), max_c(F)]))``,
  ``F <- F * g`` with a k x k conv (k = 7) over the channel-wise mean and max, applied to the global
  feature fusion output;
* global residual learning (RDN): ``F_GF + F_-1``;
* sub-pixel upsampling (``Y = PS(W * I)``) as RDN: x2/x3 one ``conv(G0 -> G s^2) + PixelShuffle(s)``,
  x4 two x2 stages (``G0 -> 4G``, ``G -> 4G``), then a 3x3 output conv ``G -> 3``;
* global skip connection (GSC, ``global_skip = true``): ``I_out = F(I_in) + up(I_in)`` with ``up`` the
  ``interp`` interpolation (``F.interpolate(..., mode="bicubic", align_corners=False)`` by default). The
  output conv starts at 0.1x its default init, so an untrained model is close to the interpolation;
* uniform down-sampling constraint (UDC, ``udc = true``): the LR image is taken to be the HR pixels at
  ``(o + s i, o + s j)`` (``o = udc_offset``, 0 as in the RDSN authors' code, which keeps ``hr[x s][y s]``),
  so those output pixels are replaced by the input pixels exactly. Vectorised (``torch.where`` with a
  fixed mask) and differentiable: the kept pixels pass gradient to the input only, the others to the
  model. Note that the bicubic skip with ``align_corners=False`` centres LR pixel i at ``s i + (s-1)/2``,
  not at ``s i + o``; the residual learns that shift.

What follows the paper text and what does not. The paper (§2.1) gives residual learning, dense
connectivity, sub-pixel convolution, GSC as ``I_out = F(I_in; θ) + I_in`` and UDC as
``I_UD = Downsample(I_in, s)``, and no hyper-parameters. The RDB / GFF / upsampler layout is RDN's as
published (EDSR-PyTorch ``src/model/rdn.py``). The RDSN authors' code (``tianjian1201/ETC-RDSN``,
``src/model/rdn.py``) differs: its "spatial attention" is a full U-Net on the mean-shifted input whose
G0-channel output (no sigmoid) multiplies the GFF output (the paper's "improved U-net"), it drops RDN's
``+ F_-1`` global residual, and its "global skip" is a second learned sub-pixel branch on the input added
before the output conv, not an interpolation. Those choices are not reproduced here: CBAM attention is
about 100 parameters where the U-Net has millions, and the interpolated skip is the paper's formula with
the resolution mismatch resolved. The authors' network itself is ``rdsn_etc`` (``models/rdsn_etc.py``), which
loads their checkpoints.

Configurations (``features`` = G0, ``blocks`` = D, ``layers`` = C, ``growth`` = G):

=====================  ====  ===  ===  ===
config                  G0    D    C    G
=====================  ====  ===  ===  ===
RDN A (EDSR-PyTorch)     64   20    6   32
RDN B (RDN paper)        64   16    8   64
default (CPU demos)      32    4    4   16
=====================  ====  ===  ===  ===

Parameter count (3x3 convs, biases everywhere; ``[a]`` is 1 if a is true, else 0)::

    P_rdsn = (27 G0 + G0) + (9 G0^2 + G0)                                  shallow features
           + D [ C (9 G0 G + G) + 9 G^2 C (C - 1) / 2 + (G0 + C G) G0 + G0 ]  dense blocks
           + (D G0^2 + G0) + (9 G0^2 + G0)                                 global fusion
           + [attention] (2 k^2 + 1)                                       SAM, k = 7
           + up(s) + (27 G + 3)                                            upsampler, output conv
    up(2), up(3) = 9 G0 G s^2 + G s^2;   up(4) = (36 G0 G + 4 G) + (36 G^2 + 4 G)

``edsr``: the EDSR baseline (Lim et al. 2017, "Enhanced Deep Residual Networks for Single Image
Super-Resolution"; EDSR-PyTorch ``src/model/edsr.py``): subtract the DIV2K RGB mean
(0.4488, 0.4371, 0.4040) (EDSR's ``MeanShift`` for ``rgb_range = 1``; a fixed buffer, not trained), a 3x3
conv to F features, B residual blocks without normalisation (``x + res_scale * conv(relu(conv(x)))``), a
3x3 conv and the long skip over the body, the sub-pixel upsampler (x2/x3 ``conv(F -> F s^2) +
PixelShuffle(s)``, x4 two x2 stages), a 3x3 output conv, and the mean added back. EDSR-baseline:
F = 64, B = 16, res_scale = 1; EDSR (large): F = 256, B = 32, res_scale = 0.1; default here (CPU demos):
F = 32, B = 4. Default PyTorch init, as EDSR-PyTorch. ``rgb_range`` r: the network works on
``(x - mean) r`` and its output is ``y / r + mean`` for images x in [0, 1]; EDSR-PyTorch (``MeanShift(rgb_range)``
on [0, 255] images) and BasicSR (``img_range``) train at r = 255, so their checkpoints need ``rgb_range = 255``
(both layouts in ``fedsight.weights_sr``; EDSR-PyTorch's frozen ``sub_mean`` / ``add_mean`` convs are checked
against the model's mean shift and r by ``adapt_checkpoint``, not loaded). The key names map one to one:
``conv_first`` is EDSR-PyTorch's ``head.0`` (BasicSR's ``conv_first``), ``body.N.conv1/2`` its
``body.N.body.0/2`` (BasicSR's ``body.N.conv1/2``), ``conv_body`` its last body conv ``body.B``
(``conv_after_body``), ``head.up`` its ``tail.0`` (``upsample``), ``head.out`` its ``tail.1`` (``conv_last``).
Parameter count (EDSR-baseline x2: 1,369,859; EDSR x2: 40,729,603, as EDSR-PyTorch's README gives them)::

    P_edsr = (27 F + F) + B 2 (9 F^2 + F) + (9 F^2 + F) + up(s) + (27 F + 3)
    up(2) = 36 F^2 + 4 F;   up(3) = 81 F^2 + 9 F;   up(4) = 2 (36 F^2 + 4 F)
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedsight.models.base import FedModel, ModelIO, state_keys
from fedsight.registry import MODELS, Params

__all__ = ["RDSN", "EDSR", "ResidualDenseBlock", "SpatialAttention", "SubPixelUpsampler", "apply_udc", "DIV2K_MEAN"]

#: DIV2K training-set RGB mean in [0, 1] (EDSR-PyTorch ``MeanShift``)
DIV2K_MEAN = (0.4488, 0.4371, 0.4040)
SCALES = (2, 3, 4)


def _conv(cin: int, cout: int, k: int = 3) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, k, padding=k // 2)


def _check_scale(scale: int) -> None:
    if scale not in SCALES:
        raise ValueError(f"image SR models support scale 2, 3 or 4, got {scale}")


class ResidualDenseBlock(nn.Module):
    """RDN's residual dense block: ``x + LFF([x, y_1, ..., y_C])`` with ``y_c = relu(conv([x, y_1..y_{c-1}]))``
    (``G0 + (c-1) G`` channels into layer c, G out), ``LFF`` a 1x1 conv ``G0 + C G -> G0``."""

    def __init__(self, features: int, growth: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(_conv(features + c * growth, growth) for c in range(layers))
        self.fusion = _conv(features + layers * growth, features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = [x]
        for conv in self.layers:
            feats.append(F.relu(conv(torch.cat(feats, dim=1))))
        return x + self.fusion(torch.cat(feats, dim=1))


class SpatialAttention(nn.Module):
    """CBAM spatial attention: ``x * sigmoid(conv_k([mean over channels, max over channels]))``."""

    def __init__(self, kernel: int = 7):
        super().__init__()
        self.conv = _conv(2, 1, kernel)

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        pooled = torch.cat([x.mean(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)], dim=1)
        return torch.sigmoid(self.conv(pooled))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(x)


class SubPixelUpsampler(nn.Sequential):
    """RDN/EDSR sub-pixel upsampling: x2/x3 ``conv(cin -> mid s^2) + PixelShuffle(s)``, x4 two x2 stages
    (``cin -> 4 mid``, ``mid -> 4 mid``); no activation; output ``mid`` channels at HR."""

    def __init__(self, cin: int, mid: int, scale: int):
        _check_scale(scale)
        stages = [(cin, scale)] if scale in (2, 3) else [(cin, 2), (mid, 2)]
        layers: list[nn.Module] = []
        for c, f in stages:
            layers += [_conv(c, mid * f * f), nn.PixelShuffle(f)]
        super().__init__(*layers)


class SRHead(nn.Module):
    """The upsampler and the output conv (``mid -> out_channels``)."""

    def __init__(self, cin: int, mid: int, scale: int, out_channels: int = 3):
        super().__init__()
        self.up = SubPixelUpsampler(cin, mid, scale)
        self.out = _conv(mid, out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.up(x))


def apply_udc(out: torch.Tensor, lr: torch.Tensor, scale: int, offset: int = 0) -> torch.Tensor:
    """Uniform down-sampling constraint: ``out`` with the pixels at ``(offset + scale i, offset + scale j)``
    replaced by ``lr[i, j]`` exactly. Out of place (``torch.where``): gradient of a kept pixel goes to
    ``lr``, of every other pixel to ``out``."""
    if not 0 <= offset < scale:
        raise ValueError(f"udc_offset must be in [0, scale), got {offset} for scale {scale}")
    h, w = lr.shape[-2:]
    if out.shape[-2:] != (scale * h, scale * w):
        raise ValueError(f"UDC: output {tuple(out.shape[-2:])} is not {scale}x the input {(h, w)}")
    rows = torch.arange(scale * h, device=out.device) % scale == offset
    cols = torch.arange(scale * w, device=out.device) % scale == offset
    mask = rows[:, None] & cols[None, :]
    kept = lr.repeat_interleave(scale, dim=-2).repeat_interleave(scale, dim=-1)  # kept[.., s i + o, ..] = lr[.., i, ..]
    return torch.where(mask, kept.to(out.dtype), out)


#: EDSR-PyTorch's ``MeanShift`` convs as a checkpoint holds them (frozen ``nn.Conv2d(3, 3, 1)``: weight the identity
#: over ``rgb_std`` (1 in EDSR and the RDSN authors' code), bias ``-+ rgb_range * rgb_mean``)
MEAN_SHIFT_KEYS = ("sub_mean.weight", "sub_mean.bias", "add_mean.weight", "add_mean.bias")


def adapt_mean_shift(state: dict[str, torch.Tensor], mean_shift: bool, rgb_range: float) -> dict[str, torch.Tensor]:
    """``state`` without EDSR-PyTorch's mean-shift convs, after checking them against the model's fixed mean shift
    (the DIV2K mean, ``rgb_range``): the model keeps its mean as a non-persistent buffer, so a checkpoint for
    another value range or without a mean shift would load every weight and compute something else; that is one
    ``ValueError`` saying which ``rgb_range`` (or ``mean_shift``) the checkpoint needs. A state without those keys
    (a FedSight or BasicSR checkpoint) is returned as it is."""
    given = {k: state[k] for k in MEAN_SHIFT_KEYS if k in state}
    if not given:
        return state
    if len(given) != len(MEAN_SHIFT_KEYS):
        raise ValueError(f"the checkpoint's mean shift is incomplete: it has {', '.join(given)} of "
                         f"{', '.join(MEAN_SHIFT_KEYS)}")
    if not mean_shift:
        raise ValueError("the checkpoint has a mean shift (sub_mean, add_mean) and the model has mean_shift = false")
    eye = torch.eye(3).view(3, 3, 1, 1)
    for k in ("sub_mean.weight", "add_mean.weight"):
        if tuple(given[k].shape) != (3, 3, 1, 1) or not torch.allclose(given[k].float(), eye, atol=1e-6):
            raise ValueError(f"{k} is not the identity [3, 3, 1, 1] (a mean shift with rgb_std != 1, which the model "
                             "does not have)")
    mean = torch.tensor(DIV2K_MEAN)
    for k, sign in (("sub_mean.bias", -1), ("add_mean.bias", 1)):
        ratio = sign * given[k].float().reshape(-1) / mean if given[k].numel() == 3 else torch.full((3,), float("nan"))
        if not torch.allclose(ratio, ratio[0].expand(3), rtol=1e-4):
            raise ValueError(f"{k} = {given[k].reshape(-1).tolist()} is not {'-' if sign < 0 else '+'}rgb_range x the "
                             f"DIV2K mean {list(DIV2K_MEAN)}")
        found = float(ratio[0])
        if abs(found - rgb_range) > 1e-4 * max(1.0, rgb_range):
            raise ValueError(f"the checkpoint works in [0, {found:g}] ({k} = {'-' if sign < 0 else '+'}{found:g} x the "
                             f"DIV2K mean) and the model has rgb_range = {rgb_range:g}: set the model's rgb_range = "
                             f"{found:g}")
    return {k: v for k, v in state.items() if k not in given}


# one operation for torch.fx (its checks read shapes): the vectorised engine's fused forward applies it to all the
# clients' channels at once (``fedsight.training.fused``)
torch.fx.wrap("apply_udc")


def interpolate(x: torch.Tensor, scale: int, mode: str) -> torch.Tensor:
    """``x`` upsampled by ``scale`` (``align_corners=False`` for the modes that take it)."""
    corners = None if mode == "nearest" else False
    return F.interpolate(x, scale_factor=scale, mode=mode, align_corners=corners)


class RDSNTrunk(nn.Module):
    """Shallow features, residual dense blocks, global feature fusion, SAM and the global residual."""

    def __init__(self, in_channels: int, features: int, blocks: int, layers: int, growth: int, attention: bool,
                 attention_kernel: int = 7):
        super().__init__()
        self.sfe1 = _conv(in_channels, features)
        self.sfe2 = _conv(features, features)
        self.rdbs = nn.ModuleList(ResidualDenseBlock(features, growth, layers) for _ in range(blocks))
        self.gff = nn.Sequential(_conv(blocks * features, features, 1), _conv(features, features))
        self.sam = SpatialAttention(attention_kernel) if attention else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f1 = self.sfe1(x)
        h = self.sfe2(f1)
        outs = []
        for rdb in self.rdbs:
            h = rdb(h)
            outs.append(h)
        return self.sam(self.gff(torch.cat(outs, dim=1))) + f1


class RDSN(FedModel):
    """Residual dense spatial network (RDN + SAM + GSC + UDC); see the module docstring."""

    split_head = False

    def __init__(
        self,
        scale: int,
        features: int = 32,
        blocks: int = 4,
        layers: int = 4,
        growth: int = 16,
        attention: bool = True,
        global_skip: bool = True,
        interp: Literal["bicubic", "bilinear", "nearest"] = "bicubic",
        udc: bool = False,
        udc_offset: int = 0,
        in_channels: int = 3,
        out_channels: int = 3,
    ):
        super().__init__()
        _check_scale(scale)
        if udc and not 0 <= udc_offset < scale:
            raise ValueError(f"udc_offset must be in [0, scale) = [0, {scale}), got {udc_offset}")
        if (global_skip or udc) and in_channels != out_channels:
            raise ValueError("the global skip and the UDC need as many output channels as input channels")
        self.scale, self.global_skip, self.interp = scale, global_skip, interp
        self.udc, self.udc_offset = udc, udc_offset
        self.feature_dim = features
        self.backbone = RDSNTrunk(in_channels, features, blocks, layers, growth, attention)
        self.head = SRHead(features, growth, scale, out_channels)
        if global_skip:  # start close to the interpolation baseline
            with torch.no_grad():
                self.head.out.weight.mul_(0.1)
                self.head.out.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and x.ndim != 4:  # (not while torch.fx traces the forward: a Proxy)
            raise ValueError(f"RDSN expects LR images [B, C, h, w], got shape {tuple(x.shape)}")
        out = self.head(self.backbone(x))
        if self.global_skip:
            out = out + interpolate(x, self.scale, self.interp)
        if self.udc:
            out = apply_udc(out, x, self.scale, self.udc_offset)
        return out

    def blocks(self) -> dict[str, list[str]]:
        """Shallow features, one block per RDB, global fusion (with SAM), head."""
        bb = self.backbone
        out = {"backbone.sfe": state_keys(bb.sfe1, "backbone.sfe1") + state_keys(bb.sfe2, "backbone.sfe2")}
        for i, rdb in enumerate(bb.rdbs):
            out[f"backbone.rdbs.{i}"] = state_keys(rdb, f"backbone.rdbs.{i}")
        out["backbone.fusion"] = state_keys(bb.gff, "backbone.gff") + state_keys(bb.sam, "backbone.sam")
        out["head"] = state_keys(self.head, "head")
        return out


class ResBlock(nn.Module):
    """EDSR residual block: ``x + res_scale * conv(relu(conv(x)))``, no normalisation."""

    def __init__(self, features: int, res_scale: float = 1.0):
        super().__init__()
        self.conv1 = _conv(features, features)
        self.conv2 = _conv(features, features)
        self.res_scale = res_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.res_scale * self.conv2(F.relu(self.conv1(x)))


class EDSRTrunk(nn.Module):
    """EDSR's head conv and body (residual blocks + conv) with the long skip."""

    def __init__(self, in_channels: int, features: int, blocks: int, res_scale: float):
        super().__init__()
        self.conv_first = _conv(in_channels, features)
        self.body = nn.Sequential(*[ResBlock(features, res_scale) for _ in range(blocks)])
        self.conv_body = _conv(features, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_first(x)
        return h + self.conv_body(self.body(h))


class EDSR(FedModel):
    """EDSR baseline with the DIV2K mean shift; see the module docstring."""

    split_head = False

    def __init__(self, scale: int, features: int = 32, blocks: int = 4, res_scale: float = 1.0, mean_shift: bool = True,
                 in_channels: int = 3, out_channels: int = 3, rgb_range: float = 1.0):
        super().__init__()
        _check_scale(scale)
        if mean_shift and (in_channels, out_channels) != (3, 3):
            raise ValueError("the DIV2K mean shift is defined for RGB (3-channel) images")
        self.scale, self.mean_shift, self.rgb_range = scale, mean_shift, float(rgb_range)
        self.feature_dim = features
        self.backbone = EDSRTrunk(in_channels, features, blocks, res_scale)
        self.head = SRHead(features, features, scale, out_channels)
        self.register_buffer("rgb_mean", torch.tensor(DIV2K_MEAN).view(1, 3, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and x.ndim != 4:  # (not while torch.fx traces the forward: a Proxy)
            raise ValueError(f"EDSR expects LR images [B, C, h, w], got shape {tuple(x.shape)}")
        if self.mean_shift:
            x = x - self.rgb_mean.to(x.dtype)
        if self.rgb_range != 1:  # (EDSR-PyTorch's and BasicSR's weights work in [0, 255])
            out = self.head(self.backbone(x * self.rgb_range)) * (1.0 / self.rgb_range)
        else:
            out = self.head(self.backbone(x))
        return out + self.rgb_mean.to(out.dtype) if self.mean_shift else out

    def adapt_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """EDSR-PyTorch's frozen mean-shift convs (``sub_mean``, ``add_mean``) checked against the model's mean
        shift and ``rgb_range``, then dropped (``adapt_mean_shift``)."""
        return adapt_mean_shift(state, self.mean_shift, self.rgb_range)

    def blocks(self) -> dict[str, list[str]]:
        """Head conv, one block per residual block, body conv, head (upsampler and output conv)."""
        bb = self.backbone
        out = {"backbone.conv_first": state_keys(bb.conv_first, "backbone.conv_first")}
        for i, blk in enumerate(bb.body):
            out[f"backbone.body.{i}"] = state_keys(blk, f"backbone.body.{i}")
        out["backbone.conv_body"] = state_keys(bb.conv_body, "backbone.conv_body")
        out["head"] = state_keys(self.head, "head")
        return out


class RDSNParams(Params):
    features: int = Field(32, ge=1, description="G0, feature channels (RDN: 64)")
    blocks: int = Field(4, ge=1, description="D, residual dense blocks (RDN A: 20, B: 16)")
    layers: int = Field(4, ge=1, description="C, conv layers per dense block (RDN A: 6, B: 8)")
    growth: int = Field(16, ge=1, description="G, growth rate; also the channels after the upsampler (RDN A: 32, B: 64)")
    attention: bool = Field(True, description="CBAM-style spatial attention on the global fusion output (the paper's SAM)")
    global_skip: bool = Field(True, description="GSC: add the interpolated input to the output")
    interp: Literal["bicubic", "bilinear", "nearest"] = Field("bicubic", description="interpolation of the global skip")
    udc: bool = Field(False, description="uniform down-sampling constraint: output pixels (o+s i, o+s j) are the input pixels")
    udc_offset: int = Field(0, ge=0, le=3, description="o, the kept pixels' offset in each s x s cell (< scale)")


class EDSRParams(Params):
    features: int = Field(32, ge=1, description="F, feature channels (EDSR-baseline: 64, EDSR: 256)")
    blocks: int = Field(4, ge=0, description="B, residual blocks (EDSR-baseline: 16, EDSR: 32)")
    res_scale: float = Field(1.0, gt=0, description="residual scaling (EDSR-baseline: 1, EDSR: 0.1)")
    mean_shift: bool = Field(True, description="subtract the DIV2K RGB mean before and add it after the network")
    rgb_range: float = Field(1.0, gt=0, description="the network's value range; [0, 1] inputs scaled by it (published: 255)")


SR_PROVIDES = frozenset({"parameter_groups"})


@MODELS.register("rdsn", params=RDSNParams, help="residual dense spatial network (RDN + spatial attention + global skip + UDC)",
                 task="image_sr", provides=SR_PROVIDES)
def build_rdsn(params: RDSNParams, *, io: ModelIO) -> RDSN:
    return RDSN(
        io.scale, params.features, params.blocks, params.layers, params.growth, params.attention, params.global_skip,
        params.interp, params.udc, params.udc_offset, in_channels=io.in_channels, out_channels=io.num_outputs or 3,
    )


@MODELS.register("edsr", params=EDSRParams, task="image_sr", provides=SR_PROVIDES,
                 help="EDSR (residual blocks without BN, DIV2K mean shift; loads EDSR-PyTorch, BasicSR weights)")
def build_edsr(params: EDSRParams, *, io: ModelIO) -> EDSR:
    return EDSR(io.scale, params.features, params.blocks, params.res_scale, params.mean_shift,
                in_channels=io.in_channels, out_channels=io.num_outputs or 3, rgb_range=params.rgb_range)
