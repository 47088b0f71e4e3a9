"""Numerical equivalence with the reference implementations: golden fixtures written by
``benchmarks/golden_weights.py`` where torchvision imports (a fixed input and torchvision's outputs for weights
``seeded_state`` regenerates here) are checked against FedSight's models loaded through ``fedsight.weights``: the
same keys and shapes after conversion, and the same outputs to float tolerance. A fixture not yet produced is a
skip saying how to produce it (this project's CPU torch wheel has no torchvision)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fedsight.models import build_model
from fedsight.weights import convert, fit_problems

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from golden_weights import CASES, seeded_state  # noqa: E402

GOLDEN = ROOT / "tests" / "fixtures" / "golden"


def check_fixture(path: Path) -> None:
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        x, want = f.get_tensor("input"), f.get_tensor("output")
    torch.manual_seed(0)
    model = build_model(meta["model"], json.loads(meta["params"]), num_classes=int(meta["classes"]), in_channels=3,
                        image_size=x.shape[-1]).eval()
    state = convert(seeded_state(json.loads(meta["shapes"])), meta["layout"])
    assert fit_problems(model, state, list(model.state_dict())) == []  # every key, every shape
    model.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_fedsight_model_with_reference_weights_gives_the_reference_outputs(name) -> None:
    path = GOLDEN / f"{name}.safetensors"
    if not path.is_file():
        pytest.skip(f"no golden fixture {path.relative_to(ROOT)}: run `python benchmarks/golden_weights.py` where "
                    "torchvision imports (a GPU session's image has torchvision and timm) and commit its files")
    check_fixture(path)


def test_the_check_fails_on_a_fixture_of_another_model(tmp_path) -> None:
    """The check itself can fail: a fixture whose outputs are not the model's (here: FedSight's own model's outputs
    perturbed by 1e-3) is refused, and the unperturbed one passes."""
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "tests" / "models"))
    from test_weights import tv_resnet

    shapes = {k: list(v.shape) for k, v in tv_resnet("resnet18", 10).items()}
    torch.manual_seed(0)
    model = build_model("resnet18_imagenet", {}, num_classes=10, in_channels=3, image_size=64).eval()
    model.load_state_dict(convert(seeded_state(shapes), "torchvision"))
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = model(x)
    meta = {"model": "resnet18_imagenet", "params": "{}", "classes": "10", "layout": "torchvision",
            "shapes": json.dumps(shapes)}
    for name, out in (("same", y), ("off", y + 1e-3)):
        save_file({"input": x, "output": out.contiguous()}, str(tmp_path / f"{name}.safetensors"), metadata=meta)
    check_fixture(tmp_path / "same.safetensors")
    with pytest.raises(AssertionError):
        check_fixture(tmp_path / "off.safetensors")
