"""Published checkpoints into FedSight models: read a ``.pth`` or ``.safetensors`` file safely, convert its keys
from the layout it was published in, and load it, naming every key that cannot be placed.

Reading (``read_checkpoint``): ``.safetensors`` through safetensors; anything else (``.pth``, ``.pt``, ``.bin``,
``.ckpt``) through ``torch.load(weights_only=True)``, which unpickles tensors and plain containers only, never
code: a pickle that would run code is refused with the file named. A checkpoint wrapped the usual ways is
unwrapped: a dict under ``state_dict``, ``model``, ``module``, ``params_ema``, ``params`` or ``model_state``
(FedDrive and LADD save ``model_state``; BasicSR/EDSR saves ``params`` and ``params_ema``; ``params_ema`` wins, as
BasicSR's own test scripts load it), and the ``module.`` prefix that ``DataParallel`` adds; a dict of state dicts
(``{"detail": ..., "segment": ...}``, CoinCheung's ImageNet backbone) is flattened to ``detail.<key>``, ....

Layouts (``LAYOUTS``; ``convert``):

* ``fedsight``: FedSight's own keys (a ``model.safetensors`` or checkpoint of a run).
* ``timm``: timm's ``VisionTransformer`` (``vit_small_patch16_*``, ``vit_base_patch16_*``) onto ``vit_s16`` /
  ``vit_b16`` (``backbone.<key>``, ``head`` stays); a position embedding for another image size is resampled by
  the model (``models.vit.VisionTransformer.adapt_checkpoint``).
* ``torchvision``: torchvision's classification models. ResNets (``conv1``, ``bn1``, ``layer1..4``, ``fc``) map
  onto ``resnet18_imagenet`` / ``resnet34_imagenet`` / ``resnet50_imagenet`` (``backbone.<key>``, ``fc`` ->
  ``head``); MobileNetV2 (``features.N``, ``classifier.1``) onto ``mobilenetv2`` with ``cifar_stem = false``
  (an inverted residual's ``conv`` is FedSight's ``block``; ``classifier.1`` -> ``head``).
* ``vitpose``, ``pose_resnet``: the official ViTPose release (or a plain ViT backbone) onto ``vitpose_s`` /
  ``vitpose_b``, the SimpleBaseline release onto ``simplebaseline`` (``fedsight.weights_pose``).
* ``basicsr``: BasicSR's EDSR onto ``edsr`` (``fedsight.weights_sr``), its BasicVSR onto ``basicvsr_basicsr``
  (the same names), or its standalone SPyNet
  (``basic_module.*`` -> ``spynet.*``, with ``strict = false``); SPyNet's ImageNet ``mean`` / ``std`` are dropped.
* ``edsr``, ``etc_rdsn``: EDSR as EDSR-PyTorch publishes it, onto ``edsr``; the RDSN
  authors' network onto ``rdsn_etc`` (``fedsight.weights_sr``).
* ``kair``: KAIR's / the RVRT release's RVRT (``params``) onto ``rvrt``: the same keys, the buffered constants
  (SPyNet's mean/std, the windows' relative position indices) checked and dropped (``models.rvrt.from_kair``).
* ``feddrive``, ``bisenet``, ``ladd``: the segmentation models' releases (FedDrive's and CoinCheung/BiSeNet's
  BiSeNetV2, LADD's DeepLabV3-MobileNetV2 and d-li14's ImageNet MobileNetV2); see ``fedsight.weights_seg``.

Loading (``load_checkpoint``): after conversion, keys matching an ``exclude`` pattern are dropped (``head.*`` to
keep the model's own classifier when the checkpoint's has another number of classes; matched again after the
model's own ``adapt_checkpoint``, which may rename or resample keys), every remaining key must be
a key of the model with the model's shape, and with ``strict`` every model key must be given. Any mismatch is one
``ValueError`` naming the file and the first mismatching keys (and shapes); the model is left untouched then.
"""

from __future__ import annotations

import fnmatch
import pickle
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import weights_pose
from .weights_keys import rename_keys
from .weights_sr import basicsr_edsr, edsr_pytorch, etc_rdsn
from .weights_seg import TORCHVISION_DEEPLAB, bisenet, feddrive, ladd

#: keys a checkpoint's tensors are commonly wrapped under, the first found wins
WRAPPERS = ("state_dict", "model", "module", "params_ema", "params", "model_state")  # model_state: FedDrive, LADD
SHOWN = 5  # keys named in an error


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file (see the module docstring); an error names the file."""
    from .models.base import read_weights

    path = Path(path)
    if path.suffix == ".safetensors":
        return read_weights(path, "checkpoint")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic != b"PK" and magic[:1] != b"\x80":  # torch.save's zip archive, or a (legacy) pickle
        raise ValueError(f"{path}: not a torch checkpoint (neither torch.save's zip archive nor a pickle) and not "
                         ".safetensors")
    try:
        obj: Any = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # weights_only refused something: code, or a class it does not allow
        lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
        why = next((x.split("error: ", 1)[-1] for x in lines if "Unsupported" in x), lines[0] if lines else "refused")
        why = why.split(". Please use")[0]  # "Unsupported global: GLOBAL print was not an allowed global by default"
        raise ValueError(f"{path}: not a plain tensor checkpoint; torch.load(weights_only=True) refused it "
                         f"({why[:160]})") from None
    except Exception as exc:  # truncated or not a torch file at all
        raise ValueError(f"{path}: not a readable checkpoint ({type(exc).__name__}: {str(exc)[:160]})") from None
    return _tensors(_unwrap(obj), path)


def _unwrap(obj: Any) -> Any:
    while isinstance(obj, Mapping) and not _is_state(obj):
        inner = next((obj[k] for k in WRAPPERS if isinstance(obj.get(k), Mapping)), None)
        if inner is None:
            break
        obj = inner
    return obj


def _is_state(obj: Mapping) -> bool:
    return bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def _tensors(obj: Any, path: Path) -> dict[str, torch.Tensor]:
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path}: holds a {type(obj).__name__}, not a dict of tensors")
    state = {str(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not state and any(isinstance(v, Mapping) and _is_state(v) for v in obj.values()):  # {"detail": state, ...}
        state = {f"{k}.{kk}": t for k, v in obj.items() if isinstance(v, Mapping) and _is_state(v) for kk, t in v.items()}
    if not state:
        raise ValueError(f"{path}: holds no tensors (keys: {sorted(map(str, obj))[:SHOWN]})")
    if all(k.startswith("module.") for k in state):  # saved from DataParallel / DistributedDataParallel
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


# -- layouts ------------------------------------------------------------------------------------------


def _torchvision(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if any(k.startswith("layer1.") for k in state):  # a ResNet
        return rename_keys(state, [(r"^fc\.", "head."), (r"^(conv1|bn1|layer[1-4])\.", r"backbone.\1.")])
    if any(k.startswith("features.") for k in state):  # MobileNetV2
        return rename_keys(state, [(r"^classifier\.1\.", "head."), (r"^features\.(\d+)\.conv\.", r"backbone.features.\1.block."),
                               (r"^features\.", "backbone.features.")])
    if any(k.startswith("classifier.0.convs.") for k in state):  # torchvision's DeepLabV3 models
        raise ValueError(TORCHVISION_DEEPLAB)
    raise ValueError("not a torchvision ResNet or MobileNetV2 state dict (no 'layer1.*' or 'features.*' keys)")


def _timm(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not any(k.startswith("blocks.") for k in state) or "cls_token" not in state:
        raise ValueError("not a timm VisionTransformer state dict (no 'cls_token' and 'blocks.*' keys)")
    return rename_keys(state, [(r"^head\.", "head."), (r"^", "backbone.")])


def _basicsr_vsr(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BasicSR's BasicVSR (``spynet.*``, ``backward_trunk.*``: FedSight's ``basicvsr_basicsr`` keeps its names) or a
    standalone SPyNet (``basic_module.N.*``, e.g. ``spynet_sintel_final``: -> ``spynet.*``, load with
    ``strict = false``); SPyNet's ``mean`` / ``std`` buffers are checked and dropped (models.spynet)."""
    from .models.spynet import drop_constants

    if any(k.startswith("spynet.") for k in state) and any(k.startswith("backward_trunk.") for k in state):
        return drop_constants(state, "spynet.")
    if state and all(re.match(r"(basic_module\.\d+\.|mean$|std$)", k) for k in state):
        return drop_constants({f"spynet.{k}": v for k, v in state.items()}, "spynet.")
    raise ValueError("not a BasicSR BasicVSR or SPyNet state dict (no 'spynet.*' and 'backward_trunk.*' keys, and "
                     "not only 'basic_module.*' keys)")


def _basicsr(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BasicSR's checkpoints, told apart by their keys: EDSR (``conv_first``, ``conv_after_body``) or BasicVSR /
    SPyNet."""
    if "conv_first.weight" in state and "conv_after_body.weight" in state:
        return basicsr_edsr(state)
    try:
        return _basicsr_vsr(state)
    except ValueError as exc:  # (a BasicVSR whose SPyNet constants are wrong says so)
        if not str(exc).startswith("not a BasicSR"):
            raise
        raise ValueError("not a BasicSR EDSR, BasicVSR or SPyNet state dict (no 'conv_first.*' and "
                         "'conv_after_body.*' keys, no 'spynet.*' and 'backward_trunk.*' keys, and not only "
                         "'basic_module.*' keys)") from None
def _kair(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from .models.rvrt import from_kair

    return from_kair(state)


#: layout name -> key conversion into FedSight's names
LAYOUTS: dict[str, Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]] = {
    "fedsight": dict,
    "torchvision": _torchvision,
    "timm": _timm,
    "vitpose": weights_pose.vitpose,
    "pose_resnet": weights_pose.pose_resnet,
    "basicsr": _basicsr,
    "edsr": edsr_pytorch,
    "etc_rdsn": etc_rdsn,
    "kair": _kair,
    "feddrive": feddrive,  # FedDrive's BiSeNetV2 (weights_seg.py)
    "bisenet": bisenet,  # CoinCheung/BiSeNet's BiSeNetV2 release
    "ladd": ladd,  # LADD's DeepLabV3-MobileNetV2 and d-li14's ImageNet MobileNetV2
}


def convert(state: Mapping[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """``state`` (in ``layout``'s names) in FedSight's names."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown weights layout {layout!r}; choose one of: {', '.join(LAYOUTS)}")
    return LAYOUTS[layout](state)


def _shown(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:SHOWN]) + (f" (+{len(keys) - SHOWN} more)" if len(keys) > SHOWN else "")


def fit_problems(model: nn.Module, state: Mapping[str, torch.Tensor], required: Iterable[str] = ()) -> list[str]:
    """Why ``state`` (FedSight names) does not load into ``model``: keys it cannot place, shapes or dtypes that do
    not fit, and the ``required`` model keys it does not give; empty when it loads."""
    own = model.state_dict()
    problems = []
    unplaced = [k for k in state if k not in own]
    if unplaced:
        problems.append(f"{len(unplaced)} keys the model does not have: {_shown(unplaced)}")
    shapes = [f"{k} {list(state[k].shape)} vs the model's {list(own[k].shape)}" for k in sorted(state)
              if k in own and tuple(state[k].shape) != tuple(own[k].shape)]
    if shapes:
        problems.append(f"{len(shapes)} shapes do not fit: {'; '.join(shapes[:SHOWN])}")
    kinds = [f"{k} {state[k].dtype} vs the model's {own[k].dtype}" for k in sorted(state)
             if k in own and state[k].is_floating_point() != own[k].is_floating_point()]
    if kinds:
        problems.append(f"{len(kinds)} dtypes do not fit: {'; '.join(kinds[:SHOWN])}")
    missing = [k for k in required if k not in state]
    if missing:
        problems.append(f"{len(missing)} model keys it does not give: {_shown(missing)}")
    return problems


def load_checkpoint(model: nn.Module, path: str | Path, layout: str = "fedsight", *, strict: bool = True,
                    exclude: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """Load the checkpoint at ``path`` (published in ``layout``) into ``model``; ``exclude``: fnmatch patterns of
    FedSight keys left out (the model keeps its own values for them). With ``strict`` every other model key must
    be given. Returns what was loaded. Nothing is loaded unless everything fits (one ``ValueError`` naming the
    file and what does not fit); floating-point values are cast to the model's dtype."""
    patterns = list(exclude)
    kept = lambda k: not any(fnmatch.fnmatchcase(k, p) for p in patterns)  # noqa: E731
    try:
        state = convert(read_checkpoint(path), layout)
    except ValueError as exc:
        raise ValueError(str(exc) if str(exc).startswith(str(path)) else f"{path}: {exc}") from None
    state = {k: v for k, v in state.items() if kept(k)}
    if hasattr(model, "adapt_checkpoint"):  # e.g. a ViT's position embedding resampled to the model's patch grid
        try:
            state = {k: v for k, v in model.adapt_checkpoint(state).items() if kept(k)}  # (patterns: its names too)
        except ValueError as exc:
            raise ValueError(f"{path} ({layout} layout) does not fit the model: {exc}") from None
    own = model.state_dict()
    problems = fit_problems(model, state, [k for k in own if kept(k)] if strict else ())
    if problems and (hint := getattr(model, "checkpoint_hint", lambda s: None)(state)):  # e.g. BiSeNetV2's head_style
        problems.append(hint)
    if problems:
        raise ValueError(f"{path} ({layout} layout) does not fit the model: {'; '.join(problems)}")
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v.to(own[k].dtype))
    return state


def convert_file(src: str | Path, dst: str | Path, layout: str) -> int:
    """Convert the checkpoint ``src`` (``layout``) once into FedSight's safetensors ``dst`` (written atomically);
    its tensor count."""
    from safetensors.torch import save

    from .safe_write import atomic_write_bytes

    try:
        state = convert(read_checkpoint(src), layout)
    except ValueError as exc:  # a layout mismatch names the file, as load_checkpoint's errors do
        raise ValueError(str(exc) if str(exc).startswith(str(src)) else f"{src}: {exc}") from None
    atomic_write_bytes(dst, save({k: v.detach().contiguous() for k, v in state.items()}))
    return len(state)
