"""Golden fixtures for ``tests/models/test_golden_weights.py``: reference models built by torchvision and timm
themselves, one fixed input and their outputs, saved as small safetensors files.

Run it once where torchvision and timm import (not with this project's CPU torch wheel: a GPU machine's image has it):

    python benchmarks/golden_weights.py --out tests/fixtures/golden

The weights are not stored (a ResNet-18 alone is 45 MB): every entry of the reference model's state dict is set
by ``seeded_state``, a function of the key, its shape and a seed that the test calls again without torchvision
(torch's CPU generator gives the same numbers on every machine). Each fixture ``NAME.safetensors`` holds ``input``
(2 x 3 x 64 x 64, seeded) and ``output`` (the eval-mode logits, float32 on the CPU), with metadata: the reference's
keys and shapes in its own layout, torchvision's version, and the FedSight model and params it must match. Commit
the files; the test loads the same weights into FedSight's model through ``fedsight.weights`` and checks the
outputs to float tolerance.
"""

from __future__ import annotations

import argparse
import json
import math
import zlib
from pathlib import Path

import torch

#: fixture -> (library (its layout), its builder, FedSight model, its params, classes)
CASES = {
    "tv_resnet18": ("torchvision", "resnet18", "resnet18_imagenet", {}, 10),
    "tv_resnet50": ("torchvision", "resnet50", "resnet50_imagenet", {}, 10),
    "tv_mobilenet_v2": ("torchvision", "mobilenet_v2", "mobilenetv2", {"cifar_stem": False}, 10),
    "timm_vit_s16": ("timm", "vit_small_patch16_224", "vit_s16", {}, 10),
}
SIDE = 64  # the fixed input's side (timm's ViT is built for it: a 4 x 4 patch grid)


def reference(library: str, builder: str, classes: int):
    """The reference model, randomly initialised (nothing downloaded), in eval mode."""
    if library == "timm":
        import timm

        return timm.create_model(builder, pretrained=False, num_classes=classes, img_size=SIDE).eval()
    import torchvision

    return getattr(torchvision.models, builder)(weights=None, num_classes=classes).eval()


def seeded_state(shapes: dict[str, list[int]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic weights for the keys and shapes of a state dict (torchvision's names): He-scaled normal
    weights of rank >= 2, norm weights near 1, small biases and means, variances in [0.5, 1.5], step counts 0.
    Each key has its own generator (seed + CRC32 of the key), so the values do not depend on key order."""
    out: dict[str, torch.Tensor] = {}
    for key, shape in shapes.items():
        g = torch.Generator().manual_seed(seed + zlib.crc32(key.encode()))
        if key.endswith("num_batches_tracked"):
            out[key] = torch.zeros(shape, dtype=torch.int64)
        elif key.endswith("running_var"):
            out[key] = torch.rand(shape, generator=g) + 0.5
        elif len(shape) >= 2:
            fan_in = math.prod(shape[1:])
            out[key] = torch.randn(shape, generator=g) * math.sqrt(2.0 / fan_in)
        elif key.endswith("weight"):  # a norm layer's scale
            out[key] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:  # biases, running means
            out[key] = 0.1 * torch.randn(shape, generator=g)
    return out


def main() -> None:
    from importlib.metadata import version

    from safetensors.torch import save_file

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures/golden"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, (library, builder, model, params, classes) in CASES.items():
        net = reference(library, builder, classes)
        shapes = {k: list(v.shape) for k, v in net.state_dict().items()}
        net.load_state_dict(seeded_state(shapes))
        x = torch.randn(2, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            y = net(x)
        meta = {library: version(library), "torch": torch.__version__, "model": model, "params": json.dumps(params),
                "classes": str(classes), "layout": library, "shapes": json.dumps(shapes)}
        save_file({"input": x, "output": y.contiguous()}, str(args.out / f"{name}.safetensors"), metadata=meta)
        print(f"wrote {args.out / name}.safetensors: {name} {tuple(y.shape)} from {library} {version(library)}")


if __name__ == "__main__":
    main()
