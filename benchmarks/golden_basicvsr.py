"""Golden fixture for ``basicvsr_basicsr``: BasicSR's own ``BasicVSR`` and ``SpyNet`` code, seeded weights, one fixed
clip and their outputs, saved as a small safetensors file that ``tests/video/test_basicvsr_basicsr.py`` checks
FedSight's model against.

BasicSR is not a dependency: point the script at a BasicSR source tree (a checkout of XPixelGroup/BasicSR, or any
folder holding its ``basicsr/archs/{basicvsr_arch,spynet_arch,arch_util,edvr_arch}.py``):

    python benchmarks/golden_basicvsr.py --basicsr-src PATH --source "XPixelGroup/BasicSR@COMMIT"

Only those four files are imported, as a package of their own, so BasicSR's ``basicsr/__init__.py`` (which imports
its data, models and metrics, with cv2 and more) is not needed. Three imports they make that BasicVSR and SPyNet do
not use are stood in for when missing: ``torchvision`` (``arch_util`` imports it for deformable convolution),
``basicsr.ops.dcn`` (EDVR's deformable convolution, compiled) and ``basicsr.utils`` (a logger and the registry
decorator). The script says which it stood in for; the code that computes the outputs is BasicSR's.

The weights are not stored (SPyNet alone is 5.8 MB): ``golden_state`` sets every entry from the key, its shape and a
seed (``benchmarks/golden_weights.py``'s ``seeded_state``, SPyNet's tensors scaled by ``SPYNET_GAIN`` so the flows
stay a few pixels and the warps act), and the test calls it again. The fixture holds the ``input`` clip
(1 x 3 frames x 3 x 34 x 33: not a multiple of 32, so SPyNet's resizing acts, and above 32, where BasicSR's SPyNet
runs), BasicSR's ``flows_backward`` (SPyNet between frames 0 and 1), the per-frame mean of the output and every
third output pixel both ways (``output_sub``, to keep the file small), with the source and versions as metadata.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from golden_weights import seeded_state  # noqa: E402

#: BasicSR's constructor arguments (the HR convolutions are BasicSR's fixed 64) and FedSight's matching params
NUM_FEAT, NUM_BLOCK = 16, 2
PARAMS = {"num_feat": NUM_FEAT, "num_block": NUM_BLOCK, "hr_feat": 64}
SPYNET_GAIN = 0.25
CLIP = (1, 3, 3, 34, 33)
STRIDE = 3  # output_sub = output[..., ::STRIDE, ::STRIDE]


def golden_state(shapes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """``seeded_state`` with SPyNet's tensors scaled by ``SPYNET_GAIN`` and its ImageNet mean/std as BasicSR sets
    them (they are buffers in BasicSR's state dict)."""
    state = seeded_state(shapes)
    for k in state:
        if k.startswith("spynet.basic_module."):
            state[k] = state[k] * SPYNET_GAIN
    if "spynet.mean" in state:
        state["spynet.mean"] = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
        state["spynet.std"] = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    return state


def golden_input() -> torch.Tensor:
    return torch.rand(CLIP, generator=torch.Generator().manual_seed(7))


def _load_basicsr(src: Path) -> tuple[type, list[str]]:
    """BasicSR's ``BasicVSR`` class from the source tree ``src``, and the modules stood in for."""
    archs = src / "basicsr" / "archs"
    if not (archs / "basicvsr_arch.py").is_file():
        raise SystemExit(f"--basicsr-src {src}: no basicsr/archs/basicvsr_arch.py there")
    stood_in = []

    def module(name: str, path: Path | None = None, **attrs) -> types.ModuleType:
        m = types.ModuleType(name)
        if path is not None:
            m.__path__ = [str(path)]
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    if importlib.util.find_spec("torchvision") is None:
        module("torchvision")
        stood_in.append("torchvision")
    module("basicsr", src / "basicsr")
    module("basicsr.archs", archs)
    registry = types.SimpleNamespace(register=lambda *a, **k: (lambda cls: cls))
    module("basicsr.utils", get_root_logger=lambda *a, **k: None)
    module("basicsr.utils.registry", ARCH_REGISTRY=registry)
    module("basicsr.ops")
    module("basicsr.ops.dcn", ModulatedDeformConvPack=torch.nn.Module, modulated_deform_conv=None)
    stood_in += ["basicsr.utils (logger, registry)", "basicsr.ops.dcn"]
    return importlib.import_module("basicsr.archs.basicvsr_arch").BasicVSR, stood_in


def main() -> None:
    from safetensors.torch import save_file

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--basicsr-src", type=Path, required=True, help="a BasicSR source tree (holding basicsr/archs)")
    ap.add_argument("--source", required=True, help="what the tree is, for the record: e.g. XPixelGroup/BasicSR@COMMIT")
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures/golden"))
    args = ap.parse_args()
    BasicVSR, stood_in = _load_basicsr(args.basicsr_src)
    torch.manual_seed(0)
    net = BasicVSR(num_feat=NUM_FEAT, num_block=NUM_BLOCK).eval()
    shapes = {k: list(v.shape) for k, v in net.state_dict().items()}
    net.load_state_dict(golden_state(shapes))
    x = golden_input()
    with torch.no_grad():
        _, flows_backward = net.get_flow(x)
        y = net(x)
    meta = {"source": args.source, "torch": torch.__version__, "model": "basicvsr_basicsr", "params": json.dumps(PARAMS),
            "scale": "4", "layout": "basicsr", "shapes": json.dumps(shapes), "stood_in": "; ".join(stood_in)}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "basicsr_basicvsr.safetensors"
    save_file({"input": x, "flows_backward": flows_backward.contiguous(), "output_mean": y.mean(dim=(2, 3, 4)),
               "output_sub": y[..., ::STRIDE, ::STRIDE].contiguous()}, str(path), metadata=meta)
    print(f"wrote {path}: BasicVSR({NUM_FEAT}, {NUM_BLOCK}) output {tuple(y.shape)}, max |flow| "
          f"{flows_backward.abs().max().item():.2f} px, from {args.source}; stood in for: {', '.join(stood_in)}")


if __name__ == "__main__":
    main()
