"""SPyNet optical flow (Ranjan & Black 2017, "Optical Flow Estimation using a Spatial Pyramid Network") as BasicSR
and KAIR define it, so their published ``spynet_sintel_final-3d2a1287.pth`` and the ``spynet.*`` part of their
BasicVSR / VRT / RVRT checkpoints load key for key.

Read from XPixelGroup/BasicSR ``basicsr/archs/spynet_arch.py`` and ``basicsr/archs/arch_util.py`` (``flow_warp``)
and cszn/KAIR ``models/network_rvrt.py`` (its ``SpyNet`` adds ``return_levels``); written here, not copied.

Layout (parameter keys, the published ones): ``basic_module.{0..5}.basic_module.{0,2,4,6,8}.{weight,bias}``,
six pyramid levels, coarsest first, each five 7x7 convolutions 8 -> 32 -> 64 -> 32 -> 16 -> 2 (ReLU between,
none after the last): 240,050 parameters a level, 1,440,300 in all.

Forward (``flow(ref, supp)``; ``SpyNet()(ref, supp)`` is the same): both frames ``[N, 3, H, W]`` in [0, 1] RGB
are

1. resized (bilinear, ``align_corners=False``) to the next multiples of 32 ``(H', W')`` (an already divisible
   size is left as it is, the interpolation then being the identity);
2. normalised with ImageNet's mean (0.485, 0.456, 0.406) and std (0.229, 0.224, 0.225);
3. average-pooled 2x2 five times into a six-level pyramid (``count_include_pad=False``);
4. from a zero flow, each level upsamples the coarser level's flow x2 (bilinear, ``align_corners=True``) and
   doubles it, pads it by one replicated row/column if the level is odd-sized (never the case after step 1, kept
   as the reference has it), warps ``supp`` with it (``flow_warp``, bilinear, ``padding_mode="border"``) and adds
   the level's module output on ``[ref, warped supp, upsampled flow]``. The reference starts from a zero flow at
   half the coarsest level's size and upsamples it too; that is a zero flow at the coarsest size, which this
   module starts from directly, because for frames of at most 32 pixels a side the half size is 0 and current
   PyTorch refuses to interpolate an empty tensor (the same numbers wherever the reference runs);
5. the finest flow is resized back to ``(H, W)`` (bilinear, ``align_corners=False``) and its x and y
   components scaled by ``W / W'`` and ``H / H'``.

The flow is in pixels, x then y displacement, channel-first ``[N, 2, H, W]``, and maps ``supp`` onto ``ref``:
``flow_warp(supp, flow.permute(0, 2, 3, 1)) ~ ref``. ``pyramid(ref, supp, levels)`` returns the flows of several
levels (KAIR's ``return_levels``: level 5 is full size, level ``l`` is ``(H // 2**(5-l), W // 2**(5-l))``), finest
first, each resized and scaled as in step 5.

Choices made here:

* ``mean`` and ``std`` are non-persistent buffers: they are constants, so they stay out of FedSight's state dict
  (nothing to aggregate or send). BasicSR's and KAIR's checkpoints of whole models hold them (``spynet.mean``,
  ``spynet.std``); a weights layout drops them after checking they are ImageNet's (``drop_constants``).
* ``identity_init=True`` starts each level's last convolution at zero, so an untrained SPyNet predicts zero flow
  (identity warping) instead of PyTorch's random-init flow; BasicSR uses PyTorch's default init everywhere and
  always loads pretrained SPyNet weights in its recipes. Loading weights overwrites either.
* ``hidden`` (default the published ``(32, 64, 32, 16)``) sets the inner widths of every level, for a SPyNet
  small enough to train in tests; the published checkpoints fit the default only.
* Inputs whose size is not a multiple of 32 are resized with ``F.interpolate``; with vmap that works (it has a
  batching rule); the in-place component scaling of the reference is done out of place here (the same numbers).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SpyNet", "SpyNetBasicModule", "flow_warp", "drop_constants", "IMAGENET_MEAN", "IMAGENET_STD",
           "SPYNET_LEVELS", "PUBLISHED_HIDDEN"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SPYNET_LEVELS = 6
#: the inner widths of a level's convolutions in the published SPyNet (8 -> 32 -> 64 -> 32 -> 16 -> 2)
PUBLISHED_HIDDEN = (32, 64, 32, 16)


def flow_warp(x: torch.Tensor, flow: torch.Tensor, interp_mode: str = "bilinear", padding_mode: str = "zeros",
              align_corners: bool = True) -> torch.Tensor:
    """Warp ``x`` ``[N, C, H, W]`` by ``flow`` ``[N, H, W, 2]`` (channel-last, x then y displacement in pixels, as
    BasicSR's and KAIR's ``flow_warp`` take it): ``out(p) = x(p + flow(p))`` by ``grid_sample`` with BasicSR's
    defaults (bilinear, zeros outside, ``align_corners=True``; pixel centres at ``-1 + 2 i / (size - 1)``)."""
    n, _, h, w = x.shape
    if flow.shape[1:3] != (h, w) or flow.shape[-1] != 2:
        raise ValueError(f"flow_warp: flow of shape {tuple(flow.shape)} does not fit features {tuple(x.shape)} "
                         f"(expected [N, {h}, {w}, 2])")
    gy, gx = torch.meshgrid(torch.arange(h, dtype=x.dtype, device=x.device),
                            torch.arange(w, dtype=x.dtype, device=x.device), indexing="ij")
    vx = (gx + flow[..., 0]) * (2.0 / max(w - 1, 1)) - 1.0
    vy = (gy + flow[..., 1]) * (2.0 / max(h - 1, 1)) - 1.0
    return F.grid_sample(x, torch.stack((vx, vy), dim=3), mode=interp_mode, padding_mode=padding_mode,
                         align_corners=align_corners)


class SpyNetBasicModule(nn.Module):
    """One pyramid level: five 7x7 convolutions 8 -> 32 -> 64 -> 32 -> 16 -> 2 with ReLU between them, as
    ``basic_module`` (a Sequential, so the published keys ``basic_module.{0,2,4,6,8}`` fit). ``hidden`` replaces
    the four inner widths (32, 64, 32, 16) for a smaller SPyNet (tests, CPU demos); no published weights fit then."""

    def __init__(self, identity_init: bool = True, hidden: Sequence[int] = PUBLISHED_HIDDEN):
        super().__init__()
        if len(hidden) != 4 or min(hidden) < 1:
            raise ValueError(f"SPyNet's hidden widths are four positive numbers (published: {list(PUBLISHED_HIDDEN)}), "
                             f"got {list(hidden)}")
        widths = (8, *hidden, 2)
        layers: list[nn.Module] = []
        for i, (cin, cout) in enumerate(zip(widths[:-1], widths[1:])):
            layers.append(nn.Conv2d(cin, cout, 7, stride=1, padding=3))
            if i < len(widths) - 2:
                layers.append(nn.ReLU(inplace=False))
        self.basic_module = nn.Sequential(*layers)
        if identity_init:
            nn.init.zeros_(self.basic_module[-1].weight)
            nn.init.zeros_(self.basic_module[-1].bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.basic_module(x)


class SpyNet(nn.Module):
    """BasicSR's / KAIR's SPyNet (see the module docstring): ``forward(ref, supp)`` is the flow ``[N, 2, H, W]``
    that warps ``supp`` onto ``ref``."""

    def __init__(self, identity_init: bool = True, hidden: Sequence[int] = PUBLISHED_HIDDEN):
        super().__init__()
        self.basic_module = nn.ModuleList([SpyNetBasicModule(identity_init, hidden) for _ in range(SPYNET_LEVELS)])
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)

    def _process(self, ref: torch.Tensor, supp: torch.Tensor, levels: Sequence[int]) -> dict[int, torch.Tensor]:
        """The flows at ``levels`` for frames already sized to multiples of 32 (steps 2-4)."""
        refs = [(ref - self.mean) / self.std]
        supps = [(supp - self.mean) / self.std]
        for _ in range(SPYNET_LEVELS - 1):
            refs.insert(0, F.avg_pool2d(refs[0], kernel_size=2, stride=2, count_include_pad=False))
            supps.insert(0, F.avg_pool2d(supps[0], kernel_size=2, stride=2, count_include_pad=False))
        n, _, h0, w0 = refs[0].shape
        flow = refs[0].new_zeros(n, 2, h0, w0)  # the reference's zero flow at half this size, upsampled and padded
        out: dict[int, torch.Tensor] = {}
        for level, (r, s) in enumerate(zip(refs, supps)):
            up = flow
            if level > 0:
                up = F.interpolate(flow, scale_factor=2, mode="bilinear", align_corners=True) * 2.0
                if up.shape[2] != r.shape[2]:
                    up = F.pad(up, [0, 0, 0, 1], mode="replicate")
                if up.shape[3] != r.shape[3]:
                    up = F.pad(up, [0, 1, 0, 0], mode="replicate")
            warped = flow_warp(s, up.permute(0, 2, 3, 1), interp_mode="bilinear", padding_mode="border")
            flow = self.basic_module[level](torch.cat([r, warped, up], dim=1)) + up
            if level in levels:
                out[level] = flow
        return out

    def pyramid(self, ref: torch.Tensor, supp: torch.Tensor, levels: Iterable[int] = (5,)) -> list[torch.Tensor]:
        """Flows of ``levels`` (0 coarsest .. 5 full size), finest first, each at ``(H // 2**(5-l), W // 2**(5-l))``
        and scaled to that size (KAIR's ``return_levels``)."""
        if ref.shape != supp.shape or ref.ndim != 4 or ref.shape[1] != 3:
            raise ValueError(f"SpyNet expects two frames [N, 3, H, W] of one shape, got {tuple(ref.shape)} and "
                             f"{tuple(supp.shape)}")
        levels = sorted(set(levels), reverse=True)
        if not levels or levels[-1] < 0 or levels[0] >= SPYNET_LEVELS:
            raise ValueError(f"SpyNet levels must be in 0..{SPYNET_LEVELS - 1}, got {levels}")
        h, w = ref.shape[-2:]
        h32, w32 = math.ceil(h / 32.0) * 32, math.ceil(w / 32.0) * 32
        ref = F.interpolate(ref, size=(h32, w32), mode="bilinear", align_corners=False)
        supp = F.interpolate(supp, size=(h32, w32), mode="bilinear", align_corners=False)
        flows = self._process(ref, supp, levels)
        out = []
        for level in levels:
            k = 2 ** (SPYNET_LEVELS - 1 - level)
            f = F.interpolate(flows[level], size=(h // k, w // k), mode="bilinear", align_corners=False)
            gain = torch.tensor([(w // k) / (w32 // k), (h // k) / (h32 // k)], dtype=f.dtype, device=f.device)
            out.append(f * gain.view(1, 2, 1, 1))
        return out

    def forward(self, ref: torch.Tensor, supp: torch.Tensor) -> torch.Tensor:
        return self.pyramid(ref, supp, (SPYNET_LEVELS - 1,))[0]


def drop_constants(state: Mapping[str, torch.Tensor], prefix: str = "spynet.") -> dict[str, torch.Tensor]:
    """``state`` without ``{prefix}mean`` / ``{prefix}std``, the normalisation constants BasicSR's and KAIR's
    whole-model checkpoints hold as buffers (FedSight's SpyNet keeps them out of its state dict). A checkpoint whose
    constants are not ImageNet's raises ``ValueError`` naming the key, since this SpyNet could not reproduce it."""
    out = dict(state)
    for name, ref in (("mean", IMAGENET_MEAN), ("std", IMAGENET_STD)):
        key = f"{prefix}{name}"
        if key in out:
            value = out.pop(key)
            if value.numel() != 3 or not torch.allclose(value.float().flatten(), torch.tensor(ref), atol=1e-6):
                raise ValueError(f"{key} is {value.flatten().tolist()}, not ImageNet's {list(ref)}: this SPyNet "
                                 "normalises with ImageNet's constants only")
    return out
