"""Published keypoint checkpoints in FedSight's names (layouts ``vitpose`` and ``pose_resnet`` of
``fedsight.weights.LAYOUTS``), and the ImageNet ResNet names onto ``simplebaseline``'s.

``vitpose`` reads two kinds of file:

* a top-down model saved by mmpose, as the official ViTPose release publishes its checkpoints
  (``ViTAE-Transformer/ViTPose``: ``state_dict`` with ``backbone.*`` and ``keypoint_head.*``): ``backbone.*``
  keeps its name (``vitpose_s`` / ``vitpose_b`` use the release's backbone names), the head's
  ``keypoint_head.deconv_layers.N`` is ``head.deconvs.N`` (the same [deconv, BN, ReLU] indices) and
  ``keypoint_head.final_layer`` is ``head.final``. mmpose's own SimpleBaseline checkpoints (``backbone.conv1``,
  ``backbone.layerN``, the same head) have this layout too and load into ``simplebaseline``.
* a plain ViT backbone, the paper's initialisation (MAE's ``mae_pretrain_vit_*.pth``, timm's or DeiT's ImageNet
  ViTs: ``patch_embed.proj``, ``pos_embed``, ``blocks.*`` at the top level): each key under ``backbone.``. The keys
  the release's loader ignores (it loads with ``strict=False`` into a backbone that has none of them) are dropped:
  ``cls_token``, ``mask_token``, the final ``norm`` and ``fc_norm`` (ViTPose's is ``last_norm``, left at its
  initialisation), the classifier ``head`` and MAE's ``decoder*``. The 14x14 position embedding is resampled to
  the model's grid by the model (``ViTPoseOfficial.adapt_checkpoint``). Such a file gives no ``last_norm`` and no
  head: load it with ``exclude = ["head.*", "backbone.last_norm.*"]``.

``pose_resnet`` reads the SimpleBaseline authors' release (``microsoft/human-pose-estimation.pytorch``,
``lib/models/pose_resnet.py``: ``conv1``, ``bn1``, ``layer1..4``, ``deconv_layers.N``, ``final_layer``) into
``simplebaseline``. Its ``_caffe`` configurations put a Bottleneck's stride on the first 1x1 convolution: the same
keys and shapes, another computation; ``simplebaseline`` is the default (PyTorch-style, stride on the 3x3), and
nothing in a file tells them apart.

``simplebaseline_names`` renames torchvision's ResNet trunk (as ``torchvision`` converts it: ``backbone.conv1``,
``backbone.bn1``, ``backbone.layerN.M.{convK,bnK,downsample}``) to ``simplebaseline``'s (``backbone.stem.0``,
``backbone.stem.1``, ``backbone.stages.N-1.M.{convK,normK,shortcut}``); the model applies it to whatever it loads
(``SimpleBaseline.adapt_checkpoint``). A BatchNorm without ``num_batches_tracked`` (files saved before PyTorch 0.4.1,
such as torchvision's original ``resnet50-19c8e357.pth`` that SimpleBaseline's configs start from, and the
SimpleBaseline release's own) gets the counter at 0, as ``torch.nn.BatchNorm2d`` gives such files on loading.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from .weights_keys import rename_keys

__all__ = ["pose_resnet", "simplebaseline_names", "vitpose"]

#: plain-ViT keys that ViTPose's backbone does not have and its loader (strict=False) therefore ignores
IGNORED_VIT_KEYS = re.compile(r"^(cls_token|mask_token|norm\.|fc_norm\.|head\.|decoder)")
_RESNET_BLOCK = re.compile(r"^backbone\.layer([1-4])\.(\d+)\.(conv\d|bn\d|downsample)\.")


def _block_key(m: re.Match) -> str:
    stage, block, part = int(m.group(1)) - 1, m.group(2), m.group(3)
    part = {"downsample": "shortcut"}.get(part, part.replace("bn", "norm"))
    return f"backbone.stages.{stage}.{block}.{part}."


def simplebaseline_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torchvision's ResNet trunk names (under ``backbone.``) as ``simplebaseline``'s; other keys unchanged; a
    missing BatchNorm ``num_batches_tracked`` filled with 0 (see the module docstring)."""
    out = {}
    for k, v in state.items():
        k = _RESNET_BLOCK.sub(_block_key, k, count=1)
        k = re.sub(r"^backbone\.conv1\.", "backbone.stem.0.", k, count=1)
        out[re.sub(r"^backbone\.bn1\.", "backbone.stem.1.", k, count=1)] = v
    for k in [k for k in out if k.endswith(".running_var")]:
        out.setdefault(k[: -len("running_var")] + "num_batches_tracked", torch.tensor(0))
    return out


def vitpose(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The official ViTPose release's checkpoints (or a plain ViT backbone) in FedSight's names."""
    if any(k.startswith(("backbone.", "keypoint_head.")) for k in state):
        return rename_keys(state, [(r"^keypoint_head\.deconv_layers\.", "head.deconvs."),
                                (r"^keypoint_head\.final_layer\.", "head.final.")])
    if "pos_embed" in state and any(k.startswith("blocks.") for k in state):
        return {f"backbone.{k}": v for k, v in state.items() if not IGNORED_VIT_KEYS.match(k)}
    raise ValueError("not a ViTPose checkpoint (no 'backbone.*' or 'keypoint_head.*' keys) nor a plain ViT backbone "
                     "(no 'pos_embed' and 'blocks.*' keys)")


def pose_resnet(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The SimpleBaseline release's ``PoseResNet`` state dict in ``simplebaseline``'s names."""
    if not any(k.startswith("layer1.") for k in state) or not any(k.startswith("final_layer.") for k in state):
        raise ValueError("not a SimpleBaseline pose_resnet state dict (no 'layer1.*' and 'final_layer.*' keys)")
    return simplebaseline_names(rename_keys(state, [(r"^deconv_layers\.", "head.deconvs."),
                                                 (r"^final_layer\.", "head.final."),
                                                 (r"^(conv1|bn1|layer[1-4])\.", r"backbone.\1.")]))
