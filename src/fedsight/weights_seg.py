"""Key conversions for the segmentation models' published checkpoints (``fedsight.weights.LAYOUTS``): the FedDrive
authors' releases (FedDrive's BiSeNetV2, LADD's DeepLabV3-MobileNetV2 and the d-li14 ImageNet MobileNetV2 LADD
starts from) and CoinCheung/BiSeNet's BiSeNetV2 (FedDrive's model is an earlier copy of it).

Key names and shapes were read from the reference sources (read to understand; no code copied):

* ``Erosinho13/FedDrive`` ``src/modules/bisenetv2.py`` (commit 66f530b5): ``detail.S1..S3.<i>.{conv,bn}``,
  ``segment.S1S2`` (stem), ``segment.S3/S4/S5_4.<i>`` (GE layers: ``conv1.{conv,bn}``, ``dwconv.{0,1}``,
  ``dwconv1/dwconv2.{0,1}``, ``conv2.{0,1}``, ``shortcut.{0..3}``), ``segment.S5_5`` (context embedding: ``bn``,
  ``conv_gap``, ``conv_last``), ``bga.{left1,left2,right1,right2,conv}.<i>``, ``head`` / ``aux2`` / ``aux3`` /
  ``aux4`` / ``aux5_4`` (``conv.{conv,bn}``, ``conv_out.0``: a 1x1 conv to ``classes * up**2`` channels before
  ``PixelShuffle(up)``). Its checkpoints are ``{"model_state": ..., "round": ...}`` saved from a
  ``DistributedDataParallel`` model (``module.`` keys; both unwrapped by ``read_checkpoint``).
* ``CoinCheung/BiSeNet`` ``lib/models/bisenetv2.py`` (since commit c0422a1, 2021-07, the refactor that published
  ``model_final_v2_city.pth``): the same backbone keys; ``head.conv_out.1`` the 1x1 classifier; ``auxN.conv_out.0.1``
  a ``ConvBNReLU`` to ``up**2`` channels after a nearest 2x upsampling, ``auxN.conv_out.1`` the classifier. Its
  ImageNet backbone ``backbone_v2.pth`` is ``{"detail": state, "segment": state}`` (flattened on reading).
* ``Erosinho13/LADD`` ``src/modules/deeplabv3.py`` and ``src/modules/mobilenetv2.py`` (commit bbaec0f2):
  torchvision's ``DeepLabV3`` with ``DeepLabHead`` (``classifier.0`` ASPP: ``convs.0..3.{0,1}``, pooling
  ``convs.4.{1,2}``, ``project.{0,1}``; ``classifier.1`` 3x3 conv, ``.2`` BN, ``.4`` the 1x1 classifier) on
  d-li14's MobileNetV2 ``features`` traced by ``create_feature_extractor`` (``backbone.<i>.*``). d-li14's blocks
  are one flat ``conv`` Sequential (expansion 1: dw ``0``, BN ``1``, 1x1 ``3``, BN ``4``; otherwise 1x1 ``0``, BN
  ``1``, dw ``3``, BN ``4``, 1x1 ``6``, BN ``7``) where torchvision (and FedSight) nest conv+BN+ReLU6; d-li14's own
  ImageNet checkpoint (``mobilenetv2_1.0-0c6065bc.pth``, which LADD's model loads) names the last 1x1 conv
  ``conv.{0,1}`` and the Linear ``classifier``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

__all__ = ["TORCHVISION_DEEPLAB", "bisenet", "feddrive", "ladd"]

TORCHVISION_DEEPLAB = (
    "this is a torchvision DeepLabV3 segmentation checkpoint (deeplabv3_mobilenet_v3_large or deeplabv3_resnet*: a "
    "MobileNetV3-Large or ResNet backbone), which no FedSight model is; FedSight's DeepLabV3 is on MobileNetV2: load "
    "torchvision's mobilenet_v2 ImageNet weights into its backbone (layout 'torchvision', exclude ['head.*']) or a "
    "LADD checkpoint (layout 'ladd')"
)

#: BiSeNetV2's head modules, reference name -> FedSight name
_HEADS = {"head": "head.main", "aux2": "head.aux.0", "aux3": "head.aux.1", "aux4": "head.aux.2", "aux5_4": "head.aux.3"}
#: reference prefix -> FedSight prefix for the backbone (the first match wins)
_BISENET_BACKBONE = [
    ("detail.", "backbone.detail."),
    ("segment.S1S2.", "backbone.semantic.stem."),
    ("segment.S5_4.", "backbone.semantic.S5."),
    ("segment.S5_5.bn.", "backbone.semantic.ce.norm."),
    ("segment.S5_5.", "backbone.semantic.ce."),
    ("segment.", "backbone.semantic."),
    ("bga.", "backbone.bga."),
]
_CBR = re.compile(r"\.(conv|bn)\.(weight|bias|running_mean|running_var|num_batches_tracked)$")  # a ConvBNReLU's keys


def _bisenet_keys(state: Mapping[str, torch.Tensor], head_key: str, aux_refine: bool) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        new = None
        for old, rep in _BISENET_BACKBONE:
            if k.startswith(old):
                new = rep + k[len(old):]
                break
        top = k.split(".", 1)[0]
        if new is None and top in _HEADS:
            rest = k[len(top) + 1:]
            classifier = head_key if top == "head" else ("conv_out.1." if aux_refine else "conv_out.0.")
            if rest.startswith(classifier):
                rest = "classifier." + rest[len(classifier):]
            elif aux_refine and top != "head" and rest.startswith("conv_out.0.1."):
                rest = "refine." + rest[len("conv_out.0.1."):]
            new = f"{_HEADS[top]}.{rest}"
        if new is None:
            new = k  # reported as a key the model does not have
        out[_CBR.sub(lambda m: f".{0 if m.group(1) == 'conv' else 1}.{m.group(2)}", new)] = v
    return out


def _require_bisenet(state: Mapping[str, torch.Tensor], name: str) -> None:
    if not any(k.startswith("segment.S1S2.") for k in state) and not any(k.startswith("detail.S1.") for k in state):
        raise ValueError(f"not a {name} BiSeNetV2 state dict (no 'detail.*' or 'segment.*' keys)")


def feddrive(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FedDrive's BiSeNetV2 (pixel-shuffle heads: load into ``bisenetv2`` with ``head_style = "feddrive"``)."""
    _require_bisenet(state, "FedDrive")
    if "head.conv_out.1.weight" in state:
        raise ValueError("a CoinCheung/BiSeNet release checkpoint ('head.conv_out.1.*'), not FedDrive's: use layout "
                         "'bisenet' and head_style = 'bisenet'")
    return _bisenet_keys(state, "conv_out.0.", aux_refine=False)


def bisenet(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CoinCheung/BiSeNet's BiSeNetV2 release (``model_final_v2_*.pth``: ``bisenetv2`` with ``head_style =
    "bisenet"``) or its ImageNet backbone ``backbone_v2.pth`` (detail and semantic branches only)."""
    _require_bisenet(state, "CoinCheung/BiSeNet")
    if "head.conv_out.0.weight" in state:
        raise ValueError("a FedDrive checkpoint ('head.conv_out.0.*': pixel-shuffle heads), not CoinCheung's "
                         "release: use layout 'feddrive' and head_style = 'feddrive'")
    return _bisenet_keys(state, "conv_out.1.", aux_refine=True)


#: d-li14's flat InvertedResidual ``conv`` indices -> FedSight's (torchvision's) nested ones, by expansion
_DLI14_BLOCK = {
    False: {"0": "0.0", "1": "0.1", "3": "1", "4": "2"},  # expansion 1: dw, BN, 1x1, BN
    True: {"0": "0.0", "1": "0.1", "3": "1.0", "4": "1.1", "6": "2", "7": "3"},  # 1x1, BN, dw, BN, 1x1, BN
}
#: torchvision's DeepLabHead (LADD's ``classifier``) -> FedSight's DeepLabHead
_LADD_HEAD = [
    (r"^classifier\.0\.convs\.4\.([12])\.", lambda m: f"head.aspp.branches.4.conv.{int(m.group(1)) - 1}."),
    (r"^classifier\.0\.convs\.(\d)\.", lambda m: f"head.aspp.branches.{m.group(1)}."),
    (r"^classifier\.0\.project\.", lambda m: "head.aspp.project."),
    (r"^classifier\.([12])\.", lambda m: f"head.conv.{int(m.group(1)) - 1}."),
    (r"^classifier\.4\.", lambda m: "head.classifier."),
]


def ladd(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LADD's DeepLabV3-MobileNetV2 (``backbone.<i>``, ``classifier.*``: ``deeplabv3_mobilenetv2`` with
    ``output_stride = 32``), or d-li14's ImageNet MobileNetV2 (``features.<i>``, ``conv``, ``classifier``: the
    ``mobilenetv2`` classifier with ``cifar_stem = false``, or a DeepLab backbone)."""
    if any(".block." in k or k.startswith("backbone.layer1.") for k in state):
        raise ValueError(TORCHVISION_DEEPLAB)
    dli14 = any(k.startswith("features.") for k in state)
    if not dli14 and not any(k.startswith("backbone.0.") for k in state):
        raise ValueError("not a LADD DeepLabV3-MobileNetV2 or d-li14 MobileNetV2 state dict (no 'backbone.<i>.*' or "
                         "'features.<i>.*' keys)")
    trunk = "features." if dli14 else "backbone."
    expands = {m.group(1) for k in state if (m := re.match(re.escape(trunk) + r"(\d+)\.conv\.6\.", k))}
    out = {}
    for k, v in state.items():
        new = k
        if dli14 and re.match(r"^conv\.[01]\.", k):  # d-li14's last 1x1 conv (LADD renames it features.18)
            new = f"backbone.features.18.{k[len('conv.'):]}"
        elif dli14 and k.startswith("classifier."):
            new = "head." + k[len("classifier."):]
        elif k.startswith(trunk):
            idx, rest = k[len(trunk):].split(".", 1)
            if rest.startswith("conv."):
                j, tail = rest[len("conv."):].split(".", 1)
                rest = f"block.{_DLI14_BLOCK[idx in expands].get(j, j)}.{tail}"
            new = f"backbone.features.{idx}.{rest}"
        else:
            for pat, rep in _LADD_HEAD:
                if re.match(pat, k):
                    new = re.sub(pat, rep, k, count=1)
                    break
        out[new] = v
    return out
