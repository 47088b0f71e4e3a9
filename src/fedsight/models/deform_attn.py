"""RVRT's guided deformable attention (GDA; Liang et al., "Recurrent Video Restoration Transformer with Guided
Deformable Attention", NeurIPS 2022, Sec. 3.3) in plain PyTorch, in place of the authors' CUDA extension.

Read from the reference (JingyunLiang/RVRT, the same files as cszn/KAIR): ``models/op/deform_attn.py`` (the
autograd function and ``DeformAttn``), ``models/op/deform_attn_cuda_pt110.cpp`` (``deform_attn_cuda_forward``:
how queries, sampled keys and values and offsets are laid out) and ``models/op/deform_attn_cuda_kernel.cu``
(``modulated_deformable_im2col_gpu_kernel`` and ``dmcn_im2col_bilinear``: where and how a sample is read), and
``models/network_rvrt.py`` (``GuidedDeformAttnPack``).

**The operation** (``deform_attn``). A clip of ``clip`` frames; query frame ``j`` of a clip attends, at each
pixel ``p``, to ``clip * K`` samples (``K = kh * kw``, a 3x3 window by default) of the key and value frames of
the previous clip: for the ``s``-th offset set it reads frame ``(s + j) mod clip`` at
``p - pad + (i, jj) + offset`` (the CUDA kernel's im2col positions; ``pad = kh // 2``, offsets ``(dy, dx)``), with
one offset per deformable group: the ``2C`` key-and-value channels are cut into ``groups`` equal groups, so keys
and values are sampled with different offsets (the first half of the groups holds the keys). Per head
(``C / heads`` channels), ``softmax(q . k_n * (C/heads)^-1/2)`` over the ``clip * K`` samples weighs the sampled
values.

**Plain path.** Every sample is read with ``grid_sample`` (bilinear, zeros outside, ``align_corners=False`` with
pixel ``x`` at ``(2x + 1) / W - 1``); the attention is broadcast products summed over each head's channels, a
softmax (max subtracted) and a weighted sum, in the sampled maps' memory order. It trains on any device (the
CUDA extension has no CPU path at all, not even a forward on CPU). Where it may differ from the CUDA kernel:

* *Sampling positions*: the kernel reads pixel coordinates directly; here they go through ``grid_sample``'s
  normalisation to [-1, 1] and back, which rounds (about one float32 ulp of the image side, ~1e-7 relative at
  64 pixels). Sample values differ by that times the local gradient.
* *Borders*: the same rule, reached differently. The kernel drops a sample whose position is at or beyond -1 or
  H (W) and reads zeros for corners outside the map; ``grid_sample`` with zero padding weighs the outside corners
  by zero, which gives the same value, including the partial samples in (-1, 0) and (H - 1, H). At a position
  within rounding of -1 or H the two may decide differently (a value of order 1e-7 times the feature).
* *Accumulation order*: the kernel sums each sample's four bilinear terms in the order (top-left, top-right,
  bottom-left, bottom-right), then does one ``matmul`` per batch element and ATen's softmax; here ``grid_sample``
  and the reductions choose their own order. Differences are float rounding, ~1e-6 relative in float32.
* *Gradients*: autograd through ``grid_sample`` (the derivative of the bilinear weights, one-sided at integer
  positions, as the kernel's ``get_coordinate_weight``) instead of the kernel's hand-written backward with
  atomic adds (whose order on a GPU is not deterministic).

Cost: the sampled keys and values are materialised, ``clip^2 * 2C * K`` values per pixel and clip (the kernel
keeps one batch element's at a time): at RVRT's size (C = 288 projected channels, K = 9) 20,736 values, 83 kB per
LR pixel and clip in float32, and as much again for the products' temporary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["deform_attn", "GuidedDeformAttn", "Permute", "Mlp", "ChannelsLast"]


def deform_attn(q: torch.Tensor, kv: torch.Tensor, offset: torch.Tensor, kernel: tuple[int, int], heads: int,
                groups: int) -> torch.Tensor:
    """Deformable attention of each query frame over sampled key/value frames (see the module docstring).

    ``q``: ``[B * clip, C, H, W]``; ``kv``: ``[B, clip, 2C, H, W]`` (keys, then values); ``offset``:
    ``[B * clip, clip * groups * kh * kw * 2, H, W]``, per query frame ``clip`` offset sets, each
    ``[groups, kh * kw, (dy, dx)]``. Returns ``[B * clip, C, H, W]``."""
    b, clip, c2, h, w = kv.shape
    c, (kh, kw) = c2 // 2, kernel
    k = kh * kw
    if c2 % 2 or c % heads or c2 % groups:
        raise ValueError(f"deform_attn: {c2} key+value channels do not split into 2 halves, {heads} heads "
                         f"and {groups} groups")
    if q.shape != (b * clip, c, h, w) or offset.shape != (b * clip, clip * groups * k * 2, h, w):
        raise ValueError(f"deform_attn: q {tuple(q.shape)} or offset {tuple(offset.shape)} does not fit kv "
                         f"{tuple(kv.shape)} with {groups} groups and a {kh}x{kw} window")
    # the frame read by offset set s of query frame j: (s + j) mod clip; idx[j, s]
    idx = (torch.arange(clip, device=kv.device)[:, None] + torch.arange(clip, device=kv.device)[None, :]) % clip
    frames = kv[:, idx.flatten()].reshape(b * clip * clip * groups, c2 // groups, h, w)
    off = offset.view(b * clip, clip, groups, k, 2, h, w)
    ys = torch.arange(h, dtype=q.dtype, device=q.device).view(h, 1)
    xs = torch.arange(w, dtype=q.dtype, device=q.device).view(1, w)
    ky = (torch.arange(kh, dtype=q.dtype, device=q.device) - kh // 2).repeat_interleave(kw).view(k, 1, 1)
    # (the kernel pads both sides by kh // 2: the reference passes one padding for both)
    kx = (torch.arange(kw, dtype=q.dtype, device=q.device) - kh // 2).repeat(kh).view(k, 1, 1)
    py = ys + ky + off[:, :, :, :, 0]  # [B*clip, clip, groups, K, H, W]
    px = xs + kx + off[:, :, :, :, 1]
    grid = torch.stack([(2 * px + 1) / w - 1, (2 * py + 1) / h - 1], dim=-1)
    grid = grid.reshape(b * clip * clip * groups, k * h, w, 2)
    sampled = F.grid_sample(frames, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    # [B*clip, clip, 2C, K, H, W]: channel g * (2C / groups) + i of the key-and-value maps
    sampled = sampled.view(b * clip, clip, c2, k, h, w)
    keys, values = sampled[:, :, :c], sampled[:, :, c:]
    d = c // heads
    keys = keys.reshape(b * clip, clip, heads, d, k, h, w)
    values = values.reshape(b * clip, clip, heads, d, k, h, w)
    qh = q.reshape(b * clip, 1, heads, d, 1, h, w) * d**-0.5
    # products summed over the head's channels, then a softmax over the clip * K samples (dims 1 and 3), in the
    # sampled maps' own memory order: an einsum would first permute them (a copy of the largest tensor here)
    logits = (keys * qh).sum(3)  # [B*clip, clip, heads, K, H, W]
    logits = logits - logits.amax((1, 3), keepdim=True)
    attn = logits.exp()
    attn = attn / attn.sum((1, 3), keepdim=True)
    out = (values * attn.unsqueeze(3)).sum((1, 4))  # [B*clip, heads, d, H, W]
    return out.reshape(b * clip, c, h, w)


class Permute(nn.Module):
    """``x.permute(*dims)``: moves the channel axis around a layer that wants it last (the reference's einops
    ``Rearrange``; parameter-free, kept as a module so the published ``Sequential`` indices line up)."""

    def __init__(self, *dims: int):
        super().__init__()
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(*self.dims)


class Mlp(nn.Module):
    """``fc2(GELU(fc1(x)))`` over the last axis."""

    def __init__(self, dim: int, hidden: int, out: int | None = None):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, out or dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ChannelsLast(nn.Sequential):
    """``module`` applied to ``[N, T, C, H, W]`` with the channels last (index 1 of the ``Sequential``, as the
    reference's ``Rearrange``-``Linear``-``Rearrange``)."""

    def __init__(self, module: nn.Module):
        super().__init__(Permute(0, 1, 3, 4, 2), module, Permute(0, 1, 4, 2, 3))


class GuidedDeformAttn(nn.Module):
    """GDA as RVRT's ``GuidedDeformAttnPack``: a small 3D-convolution net predicts offset residues (bounded by
    ``max_residue * tanh``) from the query clip, the previous clip's propagated features warped by the two
    optical flows, and the flows; offsets = residue + flow, one per group and window sample. Queries, keys and
    values are projected to ``2C`` channels, attended with ``deform_attn``, projected back to ``C``, and an MLP
    (``C -> 2C -> C``, residual) follows. The offset net's last convolution starts at zero, so an untrained GDA
    samples along the flows. ``clip`` is 2: the two offset sets are the two flows the propagation composes."""

    clip = 2

    def __init__(self, dim: int, window: tuple[int, int] = (3, 3), heads: int = 12, groups: int = 12,
                 max_residue: float = 10.0):
        super().__init__()
        self.dim, self.window, self.heads, self.groups = dim, tuple(window), heads, groups
        self.max_residue = max_residue
        k, clip = window[0] * window[1], self.clip
        if (2 * dim) % heads or (4 * dim) % groups:
            raise ValueError(f"GDA: {2 * dim} projected channels do not split into {heads} heads, or {4 * dim} key "
                             f"and value channels into {groups} deformable groups")
        convs: list[nn.Module] = [nn.Conv3d(dim * (1 + clip) + clip * 2, 64, 1), nn.LeakyReLU(0.1)]
        for _ in range(4):
            convs += [nn.Conv3d(64, 64, (1, 3, 3), padding=(0, 1, 1)), nn.LeakyReLU(0.1)]
        convs.append(nn.Conv3d(64, clip * groups * k * 2, 1))
        self.conv_offset = nn.Sequential(*convs)
        nn.init.zeros_(self.conv_offset[-1].weight)
        nn.init.zeros_(self.conv_offset[-1].bias)
        self.proj_q = ChannelsLast(nn.Linear(dim, 2 * dim))
        self.proj_k = ChannelsLast(nn.Linear(dim, 2 * dim))
        self.proj_v = ChannelsLast(nn.Linear(dim, 2 * dim))
        self.proj = ChannelsLast(nn.Linear(2 * dim, dim))
        self.mlp = ChannelsLast(Mlp(dim, 2 * dim, dim))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, warped: list[torch.Tensor],
                flows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q``, ``k``, ``v``, ``warped[i]``: ``[B, 2, C, H, W]``; ``flows[i]``: ``[B, 2, 2, H, W]`` (x, y).
        Returns the aligned features and the two updated flows (the mean offset of each set, (x, y))."""
        x = torch.cat([q, *warped, *flows], 2).transpose(1, 2)
        residue = self.max_residue * torch.tanh(self.conv_offset(x).transpose(1, 2))
        o1, o2 = torch.chunk(residue, 2, dim=2)
        n = o1.shape[2] // 2
        o1 = o1 + flows[0].flip(2).repeat(1, 1, n, 1, 1)
        o2 = o2 + flows[1].flip(2).repeat(1, 1, n, 1, 1)
        b, t, _, h, w = o1.shape
        offset = torch.cat([o1, o2], 2).flatten(0, 1)
        qp = self.proj_q(q).flatten(0, 1)
        kv = torch.cat([self.proj_k(k), self.proj_v(v)], 2)
        out = deform_attn(qp, kv, offset, self.window, self.heads, self.groups).view(b, t, 2 * self.dim, h, w)
        out = self.proj(out)
        out = out + self.mlp(out)
        return out, o1.view(b, t, n, 2, h, w).mean(2).flip(2), o2.view(b, t, n, 2, h, w).mean(2).flip(2)
