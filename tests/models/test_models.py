"""Tests for the classification model families.

The generic tests run over every name in ``MODELS`` (timm style), so a newly registered model is
checked automatically. Architecture-specific tests compare against published parameter counts and
output sizes, or against hand arithmetic written out in comments.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from fedsight.models import FedModel, build_model, load_weights, save_weights
from fedsight.registry import MODELS

ALL_MODELS = [e.name for e in MODELS.entries() if e.task_family == "classification"]  # video_sr models: tests/video
#: larger siblings of models whose code the generic tests already run at a smaller size (the same classes, other
#: widths and depths): generic tests with the suite's slow flag only; tests/models/test_weights.py loads each
SIBLINGS = {"resnet34_imagenet": "resnet18_imagenet", "vit_b16": "vit_s16"}
GENERIC = [pytest.param(n, marks=pytest.mark.slow) if n in SIBLINGS else n for n in ALL_MODELS]
NUM_CLASSES = 5


def make(
    name: str,
    params: dict | None = None,
    *,
    seed: int = 0,
    in_channels: int = 3,
    image_size: int = 8,
    num_classes: int = NUM_CLASSES,
) -> FedModel:
    torch.manual_seed(seed)
    return build_model(name, params, num_classes=num_classes, in_channels=in_channels, image_size=image_size)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def norm_choices(name: str) -> list[str | None]:
    """The values the model's ``norm`` parameter accepts (``[None]`` when it has no such parameter)."""
    field = MODELS.get(name).params.model_fields.get("norm")
    return list(typing.get_args(field.annotation)) if field is not None else [None]


# ---------------------------------------------------------------------------------------------------
# Generic: every registered model


def test_all_families_registered():
    assert {"cnn", "resnet8", "resnet18", "mobilenetv2"} <= set(ALL_MODELS)


@pytest.mark.parametrize("name", GENERIC)
@pytest.mark.parametrize("in_channels", [1, 3])
@pytest.mark.parametrize("image_size", [8, 32])
def test_output_and_feature_shapes(name, in_channels, image_size):
    model = make(name, in_channels=in_channels, image_size=image_size)
    assert isinstance(model, FedModel)
    assert isinstance(model.head, nn.Linear)
    assert model.head.in_features == model.feature_dim
    x = torch.randn(2, in_channels, image_size, image_size)
    out = model(x)
    assert out.shape == (2, NUM_CLASSES)
    assert torch.isfinite(out).all()
    model.eval()
    with torch.no_grad():
        feats = model.features(x)
        assert feats.shape == (2, model.feature_dim)
        torch.testing.assert_close(model.head(feats), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", GENERIC)
def test_backward_gives_finite_grads_everywhere(name):
    model = make(name)
    x = torch.randn(2, 3, 8, 8)
    loss = nn.functional.cross_entropy(model(x), torch.tensor([0, NUM_CLASSES - 1]))
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{pname} got no gradient"
        assert torch.isfinite(p.grad).all(), pname
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize(("name", "norm"), [(name, norm) for name in ALL_MODELS if name not in SIBLINGS
                                            for norm in norm_choices(name)])
def test_parameter_groups(name, norm):
    model = make(name, None if norm is None else {"norm": norm})
    keys = list(model.state_dict())
    groups = model.parameter_groups()
    backbone, head, norm_keys = groups["backbone"], groups["head"], groups["norm"]
    assert not set(backbone) & set(head)
    assert sorted(backbone + head) == sorted(keys)  # exact cover, and no duplicates within a group
    assert head and all(k.startswith("head.") for k in head)
    assert set(norm_keys) <= set(keys)
    assert len(set(norm_keys)) == len(norm_keys)
    if norm is not None:
        assert (len(norm_keys) == 0) == (norm == "none")


@pytest.mark.parametrize("name", GENERIC)
def test_build_is_deterministic_under_global_seed(name):
    a, b, c = make(name, seed=0).state_dict(), make(name, seed=0).state_dict(), make(name, seed=1).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())


@pytest.mark.parametrize("name", GENERIC)
def test_safetensors_round_trip(name, tmp_path):
    model = make(name, seed=0)
    model.train()
    with torch.no_grad():  # move any running statistics away from their initial values
        model(torch.randn(4, 3, 8, 8) * 3 + 1)
    path = tmp_path / "w.safetensors"
    save_weights(model, path)

    fresh = make(name, seed=1)
    x = torch.randn(3, 3, 8, 8)
    model.eval()
    fresh.eval()
    with torch.no_grad():
        assert not torch.allclose(model(x), fresh(x))
        load_weights(fresh, path)
        torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


@pytest.mark.parametrize("name", GENERIC)
def test_load_weights_missing_file_names_path(name, tmp_path):
    path = tmp_path / "nowhere.safetensors"
    with pytest.raises(FileNotFoundError, match=re.escape(str(path))):
        load_weights(make(name), path)


@pytest.mark.parametrize("name", GENERIC)
def test_load_weights_foreign_file_names_path(name, tmp_path):
    path = tmp_path / "linear.safetensors"
    save_weights(nn.Sequential(nn.Linear(4, 3)), path)
    with pytest.raises(ValueError, match=re.escape(str(path))):
        load_weights(make(name), path)


@pytest.mark.parametrize("name", GENERIC)
def test_load_weights_other_architecture_names_path(name, tmp_path):
    other = next(n for n in ALL_MODELS if n != name)
    path = tmp_path / f"{other}.safetensors"
    save_weights(make(other), path)
    with pytest.raises(ValueError, match=re.escape(str(path))):
        load_weights(make(name), path)


def test_build_model_accepts_params_object_and_rejects_unknown_keys():
    params = MODELS.get("cnn").params(hidden=16)
    assert make("cnn", params).feature_dim == 16  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        make("cnn", {"hiden": 16})
    with pytest.raises(KeyError, match="unknown model"):
        make("no-such-model")


# ---------------------------------------------------------------------------------------------------
# CNN


def test_cnn_parameter_count_by_hand():
    # in 1 channel, channels (32, 64), hidden 128, 10 classes, norm none (convs carry a bias):
    #   conv1 1*32*9 + 32 = 320; conv2 32*64*9 + 64 = 18,496
    #   pooled to 2x2: 64*4 = 256 features -> hidden: 256*128 + 128 = 32,896; head 128*10 + 10 = 1,290
    #   total 320 + 18,496 + 32,896 + 1,290 = 53,002
    assert n_params(make("cnn", in_channels=1, num_classes=10)) == 53_002


def test_cnn_feature_size_independent_of_image_size():
    m8, m64 = make("cnn", image_size=8), make("cnn", image_size=64)
    assert n_params(m8) == n_params(m64)
    assert m64(torch.randn(2, 3, 64, 64)).shape == (2, NUM_CLASSES)


def test_cnn_deep_on_8x8_stops_pooling():
    # four 2x2 pools would take 8x8 to 0x0; pooling must stop once the map is below 4x4
    model = make("cnn", {"channels": [8, 8, 8, 8], "hidden": 16}, in_channels=1, image_size=8)
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, NUM_CLASSES)


@pytest.mark.parametrize("size", [2, 3, 4, 7])
def test_cnn_grid_pool_equals_adaptive_average_pooling_bit_for_bit(size):
    """The CNN's grid pooling skips the kernel when the map already is 2x2: output and input gradient are
    torch's adaptive average pooling's exactly, at that size and at the sizes where it pools."""
    from fedsight.models.cnn import POOL_GRID, GridPool

    x = torch.randn(3, 5, size, size, requires_grad=True)
    g = torch.randn(3, 5, POOL_GRID, POOL_GRID)
    out, ref = GridPool(POOL_GRID)(x), nn.functional.adaptive_avg_pool2d(x, POOL_GRID)
    (got,), (want,) = torch.autograd.grad(out, x, g), torch.autograd.grad(ref, x, g)
    assert torch.equal(out, ref) and torch.equal(got, want)


def test_cnn_dropout_active_in_train_only():
    model = make("cnn", {"dropout": 0.5})
    x = torch.randn(4, 3, 8, 8)
    model.train()
    assert not torch.equal(model.features(x), model.features(x))
    model.eval()
    assert torch.equal(model.features(x), model.features(x))


@pytest.mark.parametrize(
    "bad",
    [{"channels": []}, {"channels": [8, 0]}, {"hidden": 0}, {"dropout": 1.0}, {"dropout": -0.1}, {"norm": "layer"}],
)
def test_cnn_rejects_bad_params(bad):
    with pytest.raises(ValidationError):
        make("cnn", bad)


# ---------------------------------------------------------------------------------------------------
# ResNet


def test_resnet18_matches_published_count():
    # kuangliu/pytorch-cifar ResNet18(), 10 classes: 11,173,962 parameters
    assert n_params(make("resnet18", num_classes=10, image_size=32)) == 11_173_962


def test_resnet8_parameter_count_by_hand():
    # 3 input channels, widths 16/32/64, one BasicBlock per stage, 1x1 conv + BN projection shortcuts,
    # 10 classes. Convs have no bias; each BN has 2*C parameters.
    #   stem:    conv 3*16*9 = 432, BN 32                                           ->    464
    #   stage 1: conv 16*16*9 = 2,304 (x2), BN 32 (x2)                               ->  4,672
    #   stage 2: conv 16*32*9 = 4,608, conv 32*32*9 = 9,216, BNs 64*2,
    #            shortcut conv 16*32 = 512 + BN 64                                   -> 14,528
    #   stage 3: conv 32*64*9 = 18,432, conv 64*64*9 = 36,864, BNs 128*2,
    #            shortcut conv 32*64 = 2,048 + BN 128                                -> 57,728
    #   head:    64*10 + 10                                                          ->    650
    #   total 464 + 4,672 + 14,528 + 57,728 + 650 = 78,042
    assert n_params(make("resnet8", num_classes=10)) == 78_042


def test_resnet8_norm_layer_count():
    # 9 norm layers (stem 1, blocks 3 x 2, shortcuts 2); BN has 5 state entries
    # (weight, bias, running_mean, running_var, num_batches_tracked), GroupNorm 2.
    assert len(make("resnet8").parameter_groups()["norm"]) == 9 * 5
    assert len(make("resnet8", {"norm": "group"}).parameter_groups()["norm"]) == 9 * 2


def test_resnet18_cifar_stem_keeps_resolution():
    # 3x3 stride-1 stem and no max-pool: a 32x32 image ends as a 4x4 map (kuangliu's avg_pool2d(out, 4))
    model = make("resnet18", image_size=32)
    assert model.backbone.feature_map(torch.randn(2, 3, 32, 32)).shape == (2, 512, 4, 4)


@pytest.mark.parametrize(("name", "width", "dim"), [("resnet18", 0.5, 256), ("resnet8", 2.0, 128)])
def test_resnet_width_scales_features(name, width, dim):
    assert make(name, {"width": width}).feature_dim == dim


def test_resnet_group_norm_uses_requested_groups():
    model = make("resnet8", {"norm": "group", "group_norm_groups": 4})
    gns = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert gns and all(m.num_groups == 4 for m in gns)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())


# ---------------------------------------------------------------------------------------------------
# MobileNetV2


def test_mobilenetv2_matches_published_count():
    # torchvision mobilenet_v2(), ImageNet configuration, 1000 classes: 3,504,872 parameters
    model = make("mobilenetv2", {"cifar_stem": False}, num_classes=1000, image_size=224)
    assert n_params(model) == 3_504_872


def test_mobilenetv2_width_half_matches_reference_count():
    # width 0.5, ImageNet configuration (last conv stays 1280 wide), 1000 classes: 1,968,680 parameters
    # (timm's mobilenetv2_050 lists 1.97M)
    model = make("mobilenetv2", {"cifar_stem": False, "width_mult": 0.5}, num_classes=1000, image_size=224)
    assert n_params(model) == 1_968_680


def test_mobilenetv2_cifar_stem_changes_strides_not_parameters():
    cifar, imagenet = make("mobilenetv2"), make("mobilenetv2", {"cifar_stem": False})
    assert n_params(cifar) == n_params(imagenet)
    x = torch.randn(2, 3, 32, 32)
    # total stride 8 with the CIFAR stem (32 -> 4), 32 in the ImageNet configuration (32 -> 1)
    assert cifar.backbone.feature_map(x).shape == (2, 1280, 4, 4)
    assert imagenet.backbone.feature_map(x).shape == (2, 1280, 1, 1)


def test_mobilenetv2_uses_relu6_and_dropout():
    model = make("mobilenetv2", {"dropout": 0.3})
    assert any(isinstance(m, nn.ReLU6) for m in model.modules())
    assert not any(type(m) is nn.ReLU for m in model.modules())
    assert [m.p for m in model.modules() if isinstance(m, nn.Dropout)] == [0.3]


def test_mobilenetv2_bad_group_count_is_a_clear_error():
    with pytest.raises(ValueError, match="channels which 3 groups do not divide"):
        make("mobilenetv2", {"norm": "group", "group_norm_groups": 3})


def test_weights_file_is_plain_safetensors(tmp_path: Path):
    from safetensors.torch import load_file

    model = make("resnet8")
    save_weights(model, tmp_path / "w.safetensors")
    assert set(load_file(str(tmp_path / "w.safetensors"))) == set(model.state_dict())
