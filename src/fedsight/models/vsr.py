"""Video super-resolution models in plain PyTorch: a recurrent BasicVSR-family model and a
sliding-window model. Both map LR clips ``[B, T, 3, h, w]`` in [0, 1] to HR clips
``[B, T, 3, s h, s w]`` for any number of frames T >= 1 and any frame size, and are registered in
:data:`fedsight.registry.MODELS` with ``task="video_sr"`` as ``factory(params, *, io) -> FedModel``
(``io.scale`` is the upscaling factor). Their forward adds a global skip from the interpolated input, so
they are not ``head(features(x))`` (``split_head = False``): their groups are ``backbone`` (alignment,
propagation or trunk) and ``head`` (fusion and upsampler), with no normalisation layers.

Shared pieces (as in BasicSR): residual blocks without normalisation whose convolutions start at 0.1x
the Kaiming init (``ResidualBlockNoBN``), LeakyReLU(0.1), sub-pixel (pixel-shuffle) upsampling in x2 or
x3 steps, and a global skip: the output is the network's residual added to an interpolated LR frame
(bilinear, BasicVSR's choice, or PyTorch bicubic). The last convolution starts at 0.1x its default init,
so an untrained model is close to the interpolation baseline.

``basicvsr`` (Chan et al. 2021, "BasicVSR: The Search for Essential Components in Video
Super-Resolution and Beyond"): bidirectional recurrent propagation. A backward pass runs
``h_i^b = R_b(x_i, W(h_{i+1}^b, f_{i->i+1}))`` from the last frame to the first and a forward pass
``h_i^f = R_f(x_i, W(h_{i-1}^f, f_{i->i-1}))`` from the first to the last; frame i is reconstructed
from the 1x1 fusion of ``[h_i^b, h_i^f]``. Alignment ``W`` is chosen by ``align``:

* ``"flow"`` (default): a small SPyNet-like pyramid flow network (Ranjan & Black 2017), trained from
  scratch with the SR loss (there are no pretrained flow weights here). Each pyramid level refines the
  upsampled coarser flow with a residual predicted from [reference, warped neighbour, flow]; the last
  convolution of every level starts at zero, so training starts from identity warping. Features are
  warped with bilinear ``grid_sample`` (zeros outside, as BasicSR's ``flow_warp``).
* ``"none"``: flow-free propagation: the hidden state is passed unwarped and the residual trunk
  learns the (small, at LR scale) misalignment implicitly. Cheaper; a documented simplification of
  BasicVSR's flow-based alignment that is adequate for the slow camera motion of the built-in clips.

``sliding_vsr``: a sliding-window model with early fusion (VESPCN's early fusion / an EDVR without the
PCD and TSA modules): frame t is reconstructed from the channel concatenation of the ``2k+1`` LR frames
``t-k .. t+k`` (indices clamped at the clip ends, i.e. edge frames replicated), a convolution, residual
blocks and the upsampler. No explicit alignment.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedsight.models.base import FedModel, ModelIO
from fedsight.registry import MODELS, Params

__all__ = ["BasicVSR", "SlidingWindowVSR", "SpyFlow", "flow_warp", "Upsampler", "ResidualBlock"]


def _scaled_init(module: nn.Module, scale: float) -> None:
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, a=0, mode="fan_in")
            m.weight.data.mul_(scale)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class ResidualBlock(nn.Module):
    """x + conv(relu(conv(x))), no normalisation (BasicSR's ResidualBlockNoBN, init scaled by 0.1)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        _scaled_init(self, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.relu(self.conv1(x)))


class ResidualTrunk(nn.Sequential):
    """conv(in -> mid) + LeakyReLU(0.1) + ``blocks`` residual blocks."""

    def __init__(self, in_channels: int, channels: int, blocks: int):
        super().__init__(
            nn.Conv2d(in_channels, channels, 3, padding=1),
            nn.LeakyReLU(0.1, inplace=True),
            *[ResidualBlock(channels) for _ in range(blocks)],
        )


def _factors(scale: int) -> list[int]:
    out, s = [], scale
    for f in (2, 3):
        while s % f == 0:
            out.append(f)
            s //= f
    if s > 1:
        out.append(s)
    return out


class Upsampler(nn.Module):
    """Sub-pixel upsampling by ``scale``.

    ``"progressive"`` (BasicVSR/EDSR): conv(c -> c f^2) + PixelShuffle(f) + LeakyReLU for each x2/x3
    factor f of the scale (any other factor in one step), conv + LeakyReLU at HR, and a last conv to 3
    channels. ``"direct"`` (ESPCN, Shi et al. 2016): one conv(c -> 3 s^2) at LR resolution followed by
    PixelShuffle(s): no convolution runs at HR resolution, about 10x cheaper at x4, the choice for
    CPU-sized demos. The last convolution starts at 0.1x its default init in both."""

    def __init__(self, channels: int, scale: int, out_channels: int = 3, mode: str = "progressive"):
        super().__init__()
        self.mode = mode
        if mode == "progressive":
            layers: list[nn.Module] = []
            for f in _factors(scale):
                layers += [nn.Conv2d(channels, channels * f * f, 3, padding=1), nn.PixelShuffle(f), nn.LeakyReLU(0.1, inplace=True)]
            layers += [nn.Conv2d(channels, channels, 3, padding=1), nn.LeakyReLU(0.1, inplace=True)]
            self.body = nn.Sequential(*layers)
            self.last = nn.Conv2d(channels, out_channels, 3, padding=1)
            self.shuffle = nn.Identity()
        elif mode == "direct":
            self.body = nn.Identity()
            self.last = nn.Conv2d(channels, out_channels * scale * scale, 3, padding=1)
            self.shuffle = nn.PixelShuffle(scale)
        else:
            raise ValueError(f"unknown upsampler {mode!r}; use 'progressive' or 'direct'")
        with torch.no_grad():
            self.last.weight.mul_(0.1)
            self.last.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shuffle(self.last(self.body(x)))


def flow_warp(x: torch.Tensor, flow: torch.Tensor) -> torch.Tensor:
    """Warp ``x`` ``[N, C, H, W]`` by ``flow`` ``[N, 2, H, W]`` (x then y displacement in pixels):
    ``out(p) = x(p + flow(p))``, bilinear, zeros outside (BasicSR's ``flow_warp``)."""
    n, _, h, w = x.shape
    yy, xx = torch.meshgrid(
        torch.arange(h, dtype=x.dtype, device=x.device), torch.arange(w, dtype=x.dtype, device=x.device), indexing="ij"
    )
    gx = (xx + flow[:, 0]) * (2.0 / max(w - 1, 1)) - 1.0
    gy = (yy + flow[:, 1]) * (2.0 / max(h - 1, 1)) - 1.0
    grid = torch.stack([gx, gy], dim=-1)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=True)


class SpyFlow(nn.Module):
    """A small SPyNet-like coarse-to-fine flow estimator, ``flow(ref, supp)`` = displacement that warps
    ``supp`` onto ``ref`` (``flow_warp(supp, flow) ~ ref``). ``levels`` pyramid levels (2x average
    pooling, ceil sizes, so any frame size works); each level adds a residual predicted by
    conv(8 -> c) - ReLU - conv(c -> c) - ReLU - conv(c -> 2) from [ref, warped supp, upsampled flow]. The
    last convolution of each level starts at zero (identity flow)."""

    def __init__(self, channels: int = 16, levels: int = 3):
        super().__init__()
        self.levels = levels
        self.basic = nn.ModuleList()
        for _ in range(levels):
            net = nn.Sequential(
                nn.Conv2d(8, channels, 5, padding=2), nn.ReLU(inplace=True),
                nn.Conv2d(channels, channels, 5, padding=2), nn.ReLU(inplace=True),
                nn.Conv2d(channels, 2, 5, padding=2),
            )
            nn.init.zeros_(net[-1].weight)
            nn.init.zeros_(net[-1].bias)
            self.basic.append(net)

    def forward(self, ref: torch.Tensor, supp: torch.Tensor) -> torch.Tensor:
        refs, supps = [ref], [supp]
        for _ in range(self.levels - 1):
            refs.insert(0, F.avg_pool2d(refs[0], 2, 2, ceil_mode=True))
            supps.insert(0, F.avg_pool2d(supps[0], 2, 2, ceil_mode=True))
        n, _, h0, w0 = refs[0].shape
        flow = ref.new_zeros(n, 2, h0, w0)
        for level, (r, s) in enumerate(zip(refs, supps)):
            h, w = r.shape[-2:]
            if flow.shape[-2:] != (h, w):
                fh, fw = flow.shape[-2:]
                flow = F.interpolate(flow, size=(h, w), mode="bilinear", align_corners=False)
                flow = flow * torch.tensor([w / fw, h / fh], dtype=flow.dtype, device=flow.device).view(1, 2, 1, 1)
            flow = flow + self.basic[level](torch.cat([r, flow_warp(s, flow), flow], dim=1))
        return flow


def _skip(lr: torch.Tensor, scale: int, mode: str) -> torch.Tensor:
    return F.interpolate(lr, scale_factor=scale, mode=mode, align_corners=False)


class BasicVSR(FedModel):
    """Bidirectional recurrent VSR (BasicVSR family); see the module docstring."""

    split_head = False
    folds_batch = True  # [B, T, ...] clips run as B T frames

    def __init__(
        self,
        scale: int,
        channels: int = 32,
        blocks: int = 4,
        align: Literal["flow", "none"] = "flow",
        flow_channels: int = 16,
        flow_levels: int = 3,
        skip: Literal["bilinear", "bicubic"] = "bilinear",
        upsampler: Literal["progressive", "direct"] = "progressive",
    ):
        super().__init__()
        self.scale, self.channels, self.align, self.skip = scale, channels, align, skip
        self.flow = SpyFlow(flow_channels, flow_levels) if align == "flow" else None
        self.backward_trunk = ResidualTrunk(3 + channels, channels, blocks)
        self.forward_trunk = ResidualTrunk(3 + channels, channels, blocks)
        self.fusion = nn.Conv2d(2 * channels, channels, 1)
        self.upsampler = Upsampler(channels, scale, mode=upsampler)

    def _flows(self, lrs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.flow is None or lrs.shape[1] < 2:
            return None
        b, t, c, h, w = lrs.shape
        cur = lrs[:, :-1].reshape(-1, c, h, w)
        nxt = lrs[:, 1:].reshape(-1, c, h, w)
        both = self.flow(torch.cat([cur, nxt]), torch.cat([nxt, cur]))
        backward, forward = both.split(cur.shape[0])
        # backward[:, i]: warps frame i+1 onto i; forward[:, i]: warps frame i onto i+1
        return backward.view(b, t - 1, 2, h, w), forward.view(b, t - 1, 2, h, w)

    def forward(self, lrs: torch.Tensor) -> torch.Tensor:
        if lrs.ndim != 5:
            raise ValueError(f"BasicVSR expects LR clips [B, T, 3, h, w], got shape {tuple(lrs.shape)}")
        b, t, c, h, w = lrs.shape
        flows = self._flows(lrs)
        feat = lrs.new_zeros(b, self.channels, h, w)
        back: list[torch.Tensor] = [feat] * t
        for i in range(t - 1, -1, -1):
            if flows is not None and i < t - 1:
                feat = flow_warp(feat, flows[0][:, i])
            feat = self.backward_trunk(torch.cat([lrs[:, i], feat], dim=1))
            back[i] = feat
        feat = lrs.new_zeros(b, self.channels, h, w)
        fused: list[torch.Tensor] = []
        for i in range(t):
            if flows is not None and i > 0:
                feat = flow_warp(feat, flows[1][:, i - 1])
            feat = self.forward_trunk(torch.cat([lrs[:, i], feat], dim=1))
            fused.append(F.leaky_relu(self.fusion(torch.cat([back[i], feat], dim=1)), 0.1))
        x = torch.stack(fused, dim=1).reshape(b * t, self.channels, h, w)
        out = self.upsampler(x) + _skip(lrs.reshape(b * t, c, h, w), self.scale, self.skip)
        return out.view(b, t, c, h * self.scale, w * self.scale)

    def parameter_groups(self) -> dict[str, list[str]]:
        """``backbone`` (alignment and propagation), ``head`` (fusion and upsampler), ``norm`` (none)."""
        head = {f"{m}.{n}" for m in ("fusion", "upsampler") for n, _ in getattr(self, m).named_parameters()}
        names = [n for n, _ in self.named_parameters()]
        return {"backbone": [n for n in names if n not in head], "head": [n for n in names if n in head], "norm": []}


class SlidingWindowVSR(FedModel):
    """Early-fusion sliding-window VSR over 2k+1 frames; see the module docstring."""

    split_head = False
    folds_batch = True  # [B, T, ...] clips run as B T frames

    def __init__(
        self,
        scale: int,
        channels: int = 32,
        blocks: int = 4,
        radius: int = 1,
        skip: Literal["bilinear", "bicubic"] = "bilinear",
        upsampler: Literal["progressive", "direct"] = "progressive",
    ):
        super().__init__()
        self.scale, self.channels, self.radius, self.skip = scale, channels, radius, skip
        self.trunk = ResidualTrunk(3 * (2 * radius + 1), channels, blocks)
        self.upsampler = Upsampler(channels, scale, mode=upsampler)

    def forward(self, lrs: torch.Tensor) -> torch.Tensor:
        if lrs.ndim != 5:
            raise ValueError(f"SlidingWindowVSR expects LR clips [B, T, 3, h, w], got shape {tuple(lrs.shape)}")
        b, t, c, h, w = lrs.shape
        k = self.radius
        idx = (torch.arange(t)[:, None] + torch.arange(-k, k + 1)[None, :]).clamp(0, t - 1)  # [T, 2k+1]
        windows = lrs[:, idx].reshape(b * t, (2 * k + 1) * c, h, w)
        out = self.upsampler(self.trunk(windows)) + _skip(lrs.reshape(b * t, c, h, w), self.scale, self.skip)
        return out.view(b, t, c, h * self.scale, w * self.scale)

    def parameter_groups(self) -> dict[str, list[str]]:
        names = [n for n, _ in self.named_parameters()]
        return {"backbone": [n for n in names if n.startswith("trunk.")], "head": [n for n in names if n.startswith("upsampler.")], "norm": []}


class BasicVSRParams(Params):
    channels: int = Field(32, ge=1, description="feature channels (BasicVSR: 64)")
    blocks: int = Field(4, ge=0, description="residual blocks per propagation branch (BasicVSR: 30)")
    align: Literal["flow", "none"] = Field("flow", description="'flow': SPyNet-like flow net trained from scratch; 'none': flow-free")
    flow_channels: int = Field(16, ge=1, description="channels of the flow network's convolutions")
    flow_levels: int = Field(3, ge=1, le=6, description="pyramid levels of the flow network")
    skip: Literal["bilinear", "bicubic"] = Field("bilinear", description="interpolation of the global LR skip")
    upsampler: Literal["progressive", "direct"] = Field(
        "progressive", description="'progressive': x2 pixel-shuffle stages + HR conv (BasicVSR); 'direct': one LR conv + PixelShuffle(s) (ESPCN)"
    )


class SlidingParams(Params):
    channels: int = Field(32, ge=1, description="feature channels")
    blocks: int = Field(4, ge=0, description="residual blocks")
    radius: int = Field(1, ge=0, description="temporal radius k: windows of 2k+1 frames")
    skip: Literal["bilinear", "bicubic"] = Field("bilinear", description="interpolation of the global LR skip")
    upsampler: Literal["progressive", "direct"] = Field(
        "progressive", description="'progressive': x2 pixel-shuffle stages + HR conv; 'direct': one LR conv + PixelShuffle(s) (ESPCN)"
    )


VSR_PROVIDES = frozenset({"parameter_groups"})


@MODELS.register("basicvsr", params=BasicVSRParams, help="bidirectional recurrent VSR (BasicVSR family), flow or flow-free",
                 task="video_sr", provides=VSR_PROVIDES)
def build_basicvsr(params: BasicVSRParams, *, io: ModelIO) -> BasicVSR:
    return BasicVSR(
        io.scale, params.channels, params.blocks, params.align, params.flow_channels, params.flow_levels, params.skip, params.upsampler
    )


@MODELS.register("sliding_vsr", params=SlidingParams, help="sliding-window VSR with early fusion of 2k+1 frames",
                 task="video_sr", provides=VSR_PROVIDES)
def build_sliding_vsr(params: SlidingParams, *, io: ModelIO) -> SlidingWindowVSR:
    return SlidingWindowVSR(io.scale, params.channels, params.blocks, params.radius, params.skip, params.upsampler)
