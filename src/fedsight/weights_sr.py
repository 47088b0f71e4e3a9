"""Image-SR checkpoint layouts (``fedsight.weights.LAYOUTS``): EDSR as EDSR-PyTorch and BasicSR publish it, and the
RDSN authors' network (an EDSR-PyTorch fork). Each function renames a published state dict's keys into FedSight's
and refuses (``ValueError``) a state dict that is not of its family. Key names read from:

* ``edsr``: sanghyun-son/EDSR-PyTorch ``src/model/edsr.py`` and ``src/model/common.py`` (``head.0`` the first conv;
  ``body.N.body.0`` / ``body.N.body.2`` a ``ResBlock``'s convs (``body.N.body.1`` is its ReLU); ``body.B`` the
  conv after the B blocks; ``tail.0`` the ``Upsampler``: ``tail.0.0`` (x2, x3) or ``tail.0.0`` and ``tail.0.2``
  (x4, two conv + PixelShuffle(2) stages); ``tail.1`` the output conv; ``sub_mean`` / ``add_mean`` the frozen
  ``MeanShift`` convs) -> ``edsr`` with ``rgb_range = 255``;
* ``basicsr`` (EDSR; ``weights._basicsr`` picks it by its keys): XPixelGroup/BasicSR ``basicsr/archs/edsr_arch.py`` and ``arch_util.py`` (``conv_first``,
  ``body.N.conv1/conv2``, ``conv_after_body``, ``upsample.0`` (and ``upsample.2`` at x4), ``conv_last``; the
  mean is a plain tensor attribute, not state; checkpoints wrap under ``params`` / ``params_ema``, which
  ``read_checkpoint`` unwraps) -> ``edsr`` with ``rgb_range = 255`` (BasicSR's ``img_range``);
* ``etc_rdsn``: tianjian1201/ETC-RDSN ``src/model/rdn.py``, ``unet.py``, ``unet_parts.py`` (``SFENet.0/1``,
  ``RDBs.i.convs.c.conv.0``, ``RDBs.i.LFF``, ``GFF.0/1``, ``unet.inc.double_conv.{0,2}``,
  ``unet.down{i}.maxpool_conv.1.double_conv.{0,2}``, ``unet.up{k}.conv.double_conv.{0,2}``, ``unet.outc.conv``,
  ``UPNet1.{0,2}``, ``UPNet2.{0,2}``, ``final_conv``, ``sub_mean`` / ``add_mean``) -> ``rdsn_etc`` with
  ``features = 64, blocks = 16, layers = 8, growth = 64, unet_width = 64, unet_depth = 4, rgb_range = 255``.

The mean-shift convs keep their names: the model's ``adapt_checkpoint`` checks them against its own fixed mean
shift and ``rgb_range`` and drops them (``models.rdsn.adapt_mean_shift``), so a checkpoint for another value range
is refused by name instead of loading into a model that would compute something else.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from .weights_keys import rename_keys

__all__ = ["basicsr_edsr", "edsr_pytorch", "etc_rdsn"]


def edsr_pytorch(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """EDSR-PyTorch's ``EDSR`` into FedSight's ``edsr``."""
    if "head.0.weight" not in state or not any(re.match(r"body\.\d+\.body\.0\.", k) for k in state):
        raise ValueError("not an EDSR-PyTorch EDSR state dict (no 'head.0.*' and 'body.N.body.0.*' keys)")
    return rename_keys(state, [
        (r"^head\.0\.", "backbone.conv_first."),
        (r"^body\.(\d+)\.body\.0\.", r"backbone.body.\1.conv1."),
        (r"^body\.(\d+)\.body\.2\.", r"backbone.body.\1.conv2."),
        (r"^body\.\d+\.(weight|bias)$", r"backbone.conv_body.\1"),  # the conv after the blocks: body.B
        (r"^tail\.0\.", "head.up."),
        (r"^tail\.1\.", "head.out."),
    ])


def basicsr_edsr(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BasicSR's ``EDSR`` into FedSight's ``edsr``."""
    if "conv_first.weight" not in state or "conv_after_body.weight" not in state:
        raise ValueError("not a BasicSR EDSR state dict (no 'conv_first.*' and 'conv_after_body.*' keys)")
    return rename_keys(state, [
        (r"^conv_first\.", "backbone.conv_first."),
        (r"^body\.(\d+)\.conv([12])\.", r"backbone.body.\1.conv\2."),
        (r"^conv_after_body\.", "backbone.conv_body."),
        (r"^upsample\.", "head.up."),
        (r"^conv_last\.", "head.out."),
    ])


def etc_rdsn(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The RDSN authors' ``RDN`` (ETC-RDSN) into FedSight's ``rdsn_etc``; their U-Net's ``up{k}`` (1-based) is
    ``dec.{k-1}``."""
    if "SFENet.0.weight" not in state or not any(k.startswith("RDBs.") for k in state):
        raise ValueError("not an ETC-RDSN (RDN) state dict (no 'SFENet.0.*' and 'RDBs.*' keys)")
    return rename_keys(state, [
        (r"^SFENet\.", "backbone.sfe."),
        (r"^RDBs\.(\d+)\.convs\.(\d+)\.conv\.0\.", r"backbone.rdbs.\1.layers.\2."),
        (r"^RDBs\.(\d+)\.LFF\.", r"backbone.rdbs.\1.fusion."),
        (r"^GFF\.", "backbone.gff."),
        (r"^unet\.inc\.double_conv\.", "backbone.attention.enc.0."),
        (r"^unet\.down(\d+)\.maxpool_conv\.1\.double_conv\.", r"backbone.attention.enc.\1."),
        (r"^unet\.up(\d+)\.conv\.double_conv\.", lambda m: f"backbone.attention.dec.{int(m.group(1)) - 1}."),
        (r"^unet\.outc\.conv\.", "backbone.attention.out."),
        (r"^UPNet1\.", "head.up."),
        (r"^UPNet2\.", "head.skip."),
        (r"^final_conv\.", "head.out."),
    ])
