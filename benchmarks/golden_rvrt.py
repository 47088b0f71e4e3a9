"""Golden fixture for RVRT (``tests/video/test_rvrt.py``): the authors' own ``models/network_rvrt.py`` (a checkout of
JingyunLiang/RVRT or cszn/KAIR, not part of FedSight), at a small size with seeded weights, its output on a fixed
clip, saved as a small safetensors file.

    python benchmarks/golden_rvrt.py --reference /path/to/RVRT --out tests/fixtures/golden

The reference imports its CUDA extension (``models/op/deform_attn.py`` compiles it at import) and einops; here the
extension's ``deform_attn`` is FedSight's plain-PyTorch one (``fedsight.models.deform_attn``, itself checked against
a transcription of the CUDA kernel's sampling rule in the test), bound into the reference's own op module, whose
classes (``DeformAttn``, ``DeformAttnPack``) are used as written; einops' ``Rearrange`` / ``rearrange`` (only axis
permutations occur) and the unused ``torchvision`` import are replaced by minimal stand-ins. So the fixture checks
everything RVRT does around the deformable attention kernel: SPyNet, the clip propagation with its flips and
composed flows, the guided offsets, the (shifted) window attention, reconstruction and upsampling.

Weights: ``seeded_state`` (``benchmarks/golden_weights.py``) for every parameter, including the layers RVRT starts
at zero (so offsets and flows are not trivial); the buffers (SPyNet's mean/std, the relative position indices)
stay the reference's. Float64 throughout (the reference runs in float64 on the CPU as written). The fixture holds
``input`` ``[1, 4, 3, 36, 36]``, ``output``: the output ``[1, 4, 3, 144, 144]`` at every 4th pixel from (0, 0)
(one pixel per LR pixel; 120 kB instead of 2 MB), and ``sums``: the whole output summed per frame and channel;
with metadata: the parameters' keys and shapes, FedSight's ``rvrt`` params and the reference commit if given.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import types
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from golden_weights import seeded_state  # noqa: E402

#: the reference's RVRT arguments and FedSight's ``rvrt`` params for the same model (upscale 4)
REFERENCE_ARGS = dict(upscale=4, clip_size=2, img_size=[2, 36, 36], window_size=[2, 8, 8], num_blocks=[1, 1, 1],
                      depths=[2, 2, 2], embed_dims=[12, 12, 12], num_heads=[2, 2, 2], inputconv_groups=[1, 1, 1, 1, 1, 1],
                      deformable_groups=4, attention_heads=4, attention_window=[3, 3])
PARAMS = {"embed_dims": [12, 12, 12], "depths": [2, 2, 2], "num_blocks": [1, 1, 1], "num_heads": [2, 2, 2],
          "window_size": [2, 8, 8], "deformable_groups": 4, "attention_heads": 4}
#: two clips of two frames; larger than 32 pixels a side (the reference's SPyNet fails on current PyTorch below)
#: and not a multiple of the 8-pixel window (padding and shifted windows both run)
INPUT_SHAPE = (1, 4, 3, 36, 36)
NAME = "kair_rvrt_small"


def _einops_stand_in() -> types.ModuleType:
    def perm(pattern: str) -> list[int]:
        left, right = (side.split() for side in pattern.split("->"))
        return [left.index(a) for a in right]

    class Rearrange(nn.Module):
        def __init__(self, pattern: str):
            super().__init__()
            self.dims = perm(pattern)

        def forward(self, x):
            return x.permute(*self.dims)

    einops = types.ModuleType("einops")
    einops.rearrange = lambda x, pattern: x.permute(*perm(pattern))
    layers = types.ModuleType("einops.layers")
    layers_torch = types.ModuleType("einops.layers.torch")
    layers_torch.Rearrange = Rearrange
    einops.layers, layers.torch = layers, layers_torch
    return einops


def load_reference(root: Path):
    """The reference's ``models.network_rvrt`` with the stand-ins above (see the module docstring)."""
    from torch.utils import cpp_extension

    from fedsight.models.deform_attn import deform_attn as plain

    einops = _einops_stand_in()
    sys.modules.update({"einops": einops, "einops.layers": einops.layers, "einops.layers.torch": einops.layers.torch,
                        "torchvision": types.ModuleType("torchvision")})
    package = types.ModuleType("models")
    package.__path__ = [str(root / "models")]
    op_package = types.ModuleType("models.op")
    op_package.__path__ = [str(root / "models" / "op")]
    sys.modules.update({"models": package, "models.op": op_package})
    compile_extension, cpp_extension.load = cpp_extension.load, lambda *a, **k: None  # no CUDA build
    try:
        spec = importlib.util.spec_from_file_location("models.op.deform_attn", root / "models" / "op" / "deform_attn.py")
        op = importlib.util.module_from_spec(spec)
        sys.modules["models.op.deform_attn"] = op
        spec.loader.exec_module(op)
    finally:
        cpp_extension.load = compile_extension

    def deform_attn(q, kv, offset, kernel_h, kernel_w, stride, padding, dilation, heads, groups, clip_size):
        assert (stride, padding, dilation, clip_size) == (1, kernel_h // 2, 1, 2)
        return plain(q[:, 0], kv, offset, (kernel_h, kernel_w), heads, groups).unsqueeze(1)

    op.deform_attn = deform_attn
    spec = importlib.util.spec_from_file_location("models.network_rvrt", root / "models" / "network_rvrt.py")
    net = importlib.util.module_from_spec(spec)
    sys.modules["models.network_rvrt"] = net
    spec.loader.exec_module(net)
    return net


def main() -> None:
    from safetensors.torch import save_file

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", type=Path, required=True, help="a checkout of JingyunLiang/RVRT or cszn/KAIR")
    ap.add_argument("--commit", default="", help="the reference's commit, recorded in the fixture")
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures/golden"))
    args = ap.parse_args()
    torch.manual_seed(0)
    model = load_reference(args.reference).RVRT(**REFERENCE_ARGS).double().eval()
    own = model.state_dict()
    shapes = {k: list(v.shape) for k, v in model.named_parameters()}
    model.load_state_dict({**own, **{k: v.double() for k, v in seeded_state(shapes).items()}})
    x = torch.rand(INPUT_SHAPE, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        y = model(x)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"reference": "JingyunLiang/RVRT models/network_rvrt.py", "commit": args.commit, "torch": torch.__version__,
            "deform_attn": "fedsight.models.deform_attn.deform_attn (plain PyTorch)", "params": json.dumps(PARAMS),
            "shapes": json.dumps(shapes)}
    path = args.out / f"{NAME}.safetensors"
    save_file({"input": x, "output": y[..., ::4, ::4].contiguous(), "sums": y.sum((-2, -1))}, str(path), metadata=meta)
    print(f"wrote {path}: output {tuple(y.shape)}, |output| mean {y.abs().mean():.4f}")


if __name__ == "__main__":
    main()
