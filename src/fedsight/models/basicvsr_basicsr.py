"""BasicVSR (Chan et al. 2021, "BasicVSR: The Search for Essential Components in Video Super-Resolution and
Beyond") exactly as BasicSR defines it, so BasicSR's published ``BasicVSR_REDS4-543c8261.pth`` /
``BasicVSR_Vimeo90K_BIx4-2a29695a.pth`` load key for key and its ``spynet_sintel_final-3d2a1287.pth`` initialises
the flow network alone. Registered as ``basicvsr_basicsr`` (task ``video_sr``).

Read from XPixelGroup/BasicSR ``basicsr/archs/basicvsr_arch.py`` (``BasicVSR``, ``ConvResidualBlocks``) and
``basicsr/archs/arch_util.py`` (``ResidualBlockNoBN``, ``default_init_weights``); written here, not copied.
SPyNet and ``flow_warp`` live in :mod:`fedsight.models.spynet`.

Architecture (BasicSR's keys in brackets), for an LR clip ``x`` ``[B, T, 3, h, w]`` in [0, 1]:

* alignment: SPyNet (``spynet.basic_module.*``) between neighbouring frames. ``flows_backward[i]`` =
  ``spynet(x_i, x_{i+1})`` warps frame i+1's features onto frame i; ``flows_forward[i]`` = ``spynet(x_{i+1}, x_i)``
  warps frame i's onto frame i+1 (here both in one SPyNet call over the concatenated pairs, the same numbers).
* propagation: two ``ConvResidualBlocks`` (``backward_trunk.main`` / ``forward_trunk.main``): conv3x3(num_feat + 3
  -> num_feat) + LeakyReLU(0.1) (``main.0``) and ``num_block`` ``ResidualBlockNoBN`` (``main.2.{k}.conv1/conv2``:
  x + conv2(ReLU(conv1(x)))). The backward branch runs from the last frame to the first on
  ``[x_i, flow_warp(h_{i+1}, flows_backward[i])]`` from zero features; the forward branch from the first frame
  on ``[x_i, flow_warp(h_{i-1}, flows_forward[i-1])]``. ``flow_warp``: bilinear, zeros outside,
  ``align_corners=True``.
* reconstruction of each frame: ``fusion`` (1x1, 2 num_feat -> num_feat) + LeakyReLU, ``upconv1`` (num_feat ->
  4 num_feat) + PixelShuffle(2) + LeakyReLU, ``upconv2`` (num_feat -> 4 x 64) + PixelShuffle(2) + LeakyReLU,
  ``conv_hr`` (64 -> 64) + LeakyReLU, ``conv_last`` (64 -> 3), plus the LR frame upsampled x4 (bilinear,
  ``align_corners=False``). BasicSR hard-codes the 64 HR channels; ``hr_feat`` (default 64) sets them here.

BasicSR's REDS configuration is ``num_feat = 64``, ``num_block = 30`` (this model's defaults): 6,291,311 parameters
(SPyNet 1,440,300; the two trunks 4,508,672; reconstruction 342,339), the paper's "6.3M".

Choices and extensions (BasicSR's BasicVSR is x4 only):

* ``scale = 4`` is BasicSR's. ``scale = 2`` keeps one upsampling stage: ``upconv1`` (num_feat -> 4 hr_feat) +
  PixelShuffle(2), no ``upconv2``, and a x2 bilinear skip; its checkpoint is its own (a x4 checkpoint is refused,
  naming ``upconv2``). Other scales are refused.
* A clip of one frame has no neighbour: no flow is computed and both branches start from zero features (BasicSR
  would fail on the empty pair batch).
* Initialisation is BasicSR's: the residual blocks' convolutions Kaiming-normal (fan in) scaled by 0.1 with zero
  bias, every other convolution PyTorch's default; SPyNet's last convolution of each level starts at zero
  (``spynet_init = "zero_flow"``: identity warping until trained or loaded; ``"pytorch"`` is BasicSR's default
  init). BasicSR's recipe loads the pretrained SPyNet (and trains it at lr x 0.125, frozen for the first 5,000
  iterations); here SPyNet's parameters train with the rest at the same rate (FedSight has no per-module rate,
  and ``train.freeze`` names whole groups: SPyNet is in ``backbone`` with the trunks).
* ``spynet_hidden`` shrinks SPyNet's inner widths (published: 32, 64, 32, 16) for CPU tests and demos; BasicSR's
  weights then fit everything but SPyNet.
* SPyNet's ImageNet mean/std are not in the state dict; the ``basicsr`` weights layout drops BasicSR's
  ``spynet.mean`` / ``spynet.std`` after checking them.

Vectorised training: the model has no normalisation layers and draws no random numbers; every operation (conv,
interpolate, avg_pool2d, grid_sample, pixel_shuffle) has a vmap batching rule, so clients train together under
vmap (tests/test_vectorized.py checks it against sequential steps).

Which BasicVSR to pick: ``basicvsr`` is FedSight's small CPU-sized member of the family (tiny flow net from
scratch or flow-free, progressive or ESPCN upsampler); ``basicvsr_basicsr`` is the published model, for GPU runs
and BasicSR's checkpoints (docs/video_sr.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedsight.models.base import FedModel, ModelIO
from fedsight.models.spynet import PUBLISHED_HIDDEN, SpyNet, flow_warp
from fedsight.registry import MODELS, Params

__all__ = ["BasicVSRBasicSR", "ConvResidualBlocks", "ResidualBlockNoBN", "SCALES"]

SCALES = (2, 4)
HEAD = ("fusion", "upconv1", "upconv2", "conv_hr", "conv_last")


class ResidualBlockNoBN(nn.Module):
    """BasicSR's ``ResidualBlockNoBN`` with ``res_scale = 1``: x + conv2(ReLU(conv1(x))), both 3x3; init Kaiming
    normal (fan in) x 0.1, zero bias (``default_init_weights(..., 0.1)``)."""

    def __init__(self, num_feat: int):
        super().__init__()
        self.conv1 = nn.Conv2d(num_feat, num_feat, 3, 1, 1)
        self.conv2 = nn.Conv2d(num_feat, num_feat, 3, 1, 1)
        for conv in (self.conv1, self.conv2):
            nn.init.kaiming_normal_(conv.weight)
            with torch.no_grad():
                conv.weight.mul_(0.1)
            nn.init.zeros_(conv.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.relu(self.conv1(x)))


class ConvResidualBlocks(nn.Module):
    """conv3x3(in -> out) + LeakyReLU(0.1) + ``num_block`` residual blocks, as ``main`` (keys ``main.0``,
    ``main.2.{k}``)."""

    def __init__(self, num_in_ch: int, num_out_ch: int, num_block: int):
        super().__init__()
        self.main = nn.Sequential(nn.Conv2d(num_in_ch, num_out_ch, 3, 1, 1), nn.LeakyReLU(0.1, inplace=True),
                                  nn.Sequential(*[ResidualBlockNoBN(num_out_ch) for _ in range(num_block)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x)


class BasicVSRBasicSR(FedModel):
    """BasicSR's BasicVSR (see the module docstring)."""

    split_head = False
    folds_batch = True  # [B, T, ...] clips run as B T frames

    def __init__(self, scale: int = 4, num_feat: int = 64, num_block: int = 30, hr_feat: int = 64,
                 spynet_init: Literal["zero_flow", "pytorch"] = "zero_flow",
                 spynet_hidden: Sequence[int] = PUBLISHED_HIDDEN):
        super().__init__()
        if scale not in SCALES:
            raise ValueError(f"basicvsr_basicsr upscales x4 (BasicSR's) or x2, not x{scale}: set the task's scale to 4 "
                             "or 2, or use basicvsr")
        self.scale, self.num_feat = scale, num_feat
        self.spynet = SpyNet(identity_init=spynet_init == "zero_flow", hidden=tuple(spynet_hidden))
        self.backward_trunk = ConvResidualBlocks(num_feat + 3, num_feat, num_block)
        self.forward_trunk = ConvResidualBlocks(num_feat + 3, num_feat, num_block)
        self.fusion = nn.Conv2d(num_feat * 2, num_feat, 1, 1, 0)
        if scale == 4:
            self.upconv1 = nn.Conv2d(num_feat, num_feat * 4, 3, 1, 1)
            self.upconv2 = nn.Conv2d(num_feat, hr_feat * 4, 3, 1, 1)
        else:
            self.upconv1 = nn.Conv2d(num_feat, hr_feat * 4, 3, 1, 1)
            self.upconv2 = None
        self.conv_hr = nn.Conv2d(hr_feat, hr_feat, 3, 1, 1)
        self.conv_last = nn.Conv2d(hr_feat, 3, 3, 1, 1)
        self.pixel_shuffle = nn.PixelShuffle(2)
        self.lrelu = nn.LeakyReLU(0.1, inplace=True)

    def get_flow(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(flows_forward, flows_backward), each ``[B, T-1, 2, h, w]`` (BasicSR's order)."""
        b, t, c, h, w = x.shape
        x1 = x[:, :-1].reshape(-1, c, h, w)
        x2 = x[:, 1:].reshape(-1, c, h, w)
        both = self.spynet(torch.cat([x1, x2]), torch.cat([x2, x1]))
        backward, forward = both.split(x1.shape[0])
        return forward.view(b, t - 1, 2, h, w), backward.view(b, t - 1, 2, h, w)

    def _upsample(self, feat: torch.Tensor) -> torch.Tensor:
        out = self.lrelu(self.pixel_shuffle(self.upconv1(feat)))
        if self.upconv2 is not None:
            out = self.lrelu(self.pixel_shuffle(self.upconv2(out)))
        return self.conv_last(self.lrelu(self.conv_hr(out)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 5 or x.shape[2] != 3:
            raise ValueError(f"basicvsr_basicsr expects LR clips [B, T, 3, h, w], got shape {tuple(x.shape)}")
        b, t, c, h, w = x.shape
        flows_forward, flows_backward = self.get_flow(x) if t > 1 else (None, None)
        back: list[torch.Tensor] = []
        feat = x.new_zeros(b, self.num_feat, h, w)
        for i in range(t - 1, -1, -1):
            if i < t - 1:
                feat = flow_warp(feat, flows_backward[:, i].permute(0, 2, 3, 1))
            feat = self.backward_trunk(torch.cat([x[:, i], feat], dim=1))
            back.insert(0, feat)
        fused: list[torch.Tensor] = []
        feat = x.new_zeros(b, self.num_feat, h, w)
        for i in range(t):
            if i > 0:
                feat = flow_warp(feat, flows_forward[:, i - 1].permute(0, 2, 3, 1))
            feat = self.forward_trunk(torch.cat([x[:, i], feat], dim=1))
            fused.append(self.lrelu(self.fusion(torch.cat([back[i], feat], dim=1))))
        lr = x.reshape(b * t, c, h, w)
        out = self._upsample(torch.stack(fused, dim=1).reshape(b * t, self.num_feat, h, w))
        out = out + F.interpolate(lr, scale_factor=self.scale, mode="bilinear", align_corners=False)
        return out.view(b, t, c, h * self.scale, w * self.scale)

    def parameter_groups(self) -> dict[str, list[str]]:
        """``backbone``: SPyNet and the two propagation trunks; ``head``: fusion and reconstruction; ``norm``:
        none (the model has no normalisation layers)."""
        names = [n for n, _ in self.named_parameters()]
        head = [n for n in names if n.split(".")[0] in HEAD]
        return {"backbone": [n for n in names if n not in head], "head": head, "norm": []}


class BasicVSRBasicSRParams(Params):
    num_feat: int = Field(64, ge=1, description="feature channels (BasicSR: 64)")
    num_block: int = Field(30, ge=0, description="residual blocks per propagation branch (BasicSR's REDS/Vimeo "
                           "models: 30)")
    hr_feat: int = Field(64, ge=1, description="channels of the HR convolutions (BasicSR hard-codes 64)")
    spynet_init: Literal["zero_flow", "pytorch"] = Field(
        "zero_flow", description="SPyNet's start without weights: zero flow (last convs at 0) or PyTorch's init")
    spynet_hidden: list[int] = Field(list(PUBLISHED_HIDDEN), min_length=4, max_length=4, description="SPyNet's inner "
                                     "widths (published: [32, 64, 32, 16]; smaller ones load no SPyNet weights)")


@MODELS.register("basicvsr_basicsr", params=BasicVSRBasicSRParams, task="video_sr",
                 provides=frozenset({"parameter_groups"}),
                 help="BasicVSR with SPyNet as BasicSR defines it (loads BasicSR's BasicVSR and SPyNet weights)")
def build_basicvsr_basicsr(params: BasicVSRBasicSRParams, *, io: ModelIO) -> BasicVSRBasicSR:
    return BasicVSRBasicSR(io.scale, params.num_feat, params.num_block, params.hr_feat, params.spynet_init,
                           params.spynet_hidden)
