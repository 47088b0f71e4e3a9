"""Published checkpoints load (``fedsight.weights``): torchvision's ResNet-18/34/50 and MobileNetV2 state dicts,
written here from torchvision's published architecture definitions (key names and shapes; their parameter counts
are checked against torchvision's published ones, so the fixtures do not come from FedSight's own models), load
into ``resnet*_imagenet`` and ``mobilenetv2`` (``cifar_stem = false``) with no missing or unexpected key, every
value in its place; bad checkpoints are one error naming the file, and the model is left untouched."""

from __future__ import annotations

import pickle
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from fedsight.models import build_model
from fedsight.weights import convert, convert_file, load_checkpoint, read_checkpoint

#: torchvision's published parameter counts (its model documentation's "num_params")
PUBLISHED = {"resnet18": 11_689_512, "resnet34": 21_797_672, "resnet50": 25_557_032, "mobilenet_v2": 3_504_872}


def _conv(s: dict, name: str, cout: int, cin: int, k: int, g: torch.Generator) -> None:
    s[f"{name}.weight"] = torch.randn(cout, cin, k, k, generator=g)


def _bn(s: dict, name: str, c: int, g: torch.Generator) -> None:
    s.update({f"{name}.weight": torch.rand(c, generator=g) + 0.5, f"{name}.bias": torch.randn(c, generator=g),
              f"{name}.running_mean": torch.randn(c, generator=g), f"{name}.running_var": torch.rand(c, generator=g) + 0.5,
              f"{name}.num_batches_tracked": torch.tensor(7)})


def tv_resnet(arch: str, num_classes: int = 1000) -> dict[str, torch.Tensor]:
    """torchvision's ``ResNet`` state dict: ``_make_layer`` adds ``downsample`` (1x1 conv, BN) to a stage's first
    block when its stride is 2 or the width changes; Bottleneck expansion 4."""
    bottleneck = arch == "resnet50"
    layers = {"resnet18": [2, 2, 2, 2], "resnet34": [3, 4, 6, 3], "resnet50": [3, 4, 6, 3]}[arch]
    exp, g, s = 4 if bottleneck else 1, torch.Generator().manual_seed(0), {}
    _conv(s, "conv1", 64, 3, 7, g)
    _bn(s, "bn1", 64, g)
    inplanes = 64
    for i, (planes, n) in enumerate(zip([64, 128, 256, 512], layers)):
        for j in range(n):
            p, stride = f"layer{i + 1}.{j}", 2 if i > 0 and j == 0 else 1
            if bottleneck:
                _conv(s, f"{p}.conv1", planes, inplanes, 1, g), _bn(s, f"{p}.bn1", planes, g)
                _conv(s, f"{p}.conv2", planes, planes, 3, g), _bn(s, f"{p}.bn2", planes, g)
                _conv(s, f"{p}.conv3", planes * 4, planes, 1, g), _bn(s, f"{p}.bn3", planes * 4, g)
            else:
                _conv(s, f"{p}.conv1", planes, inplanes, 3, g), _bn(s, f"{p}.bn1", planes, g)
                _conv(s, f"{p}.conv2", planes, planes, 3, g), _bn(s, f"{p}.bn2", planes, g)
            if j == 0 and (stride != 1 or inplanes != planes * exp):
                _conv(s, f"{p}.downsample.0", planes * exp, inplanes, 1, g), _bn(s, f"{p}.downsample.1", planes * exp, g)
            inplanes = planes * exp
    s["fc.weight"], s["fc.bias"] = torch.randn(num_classes, 512 * exp, generator=g), torch.randn(num_classes, generator=g)
    return s


def tv_mobilenet_v2(num_classes: int = 1000) -> dict[str, torch.Tensor]:
    """torchvision's ``mobilenet_v2`` state dict: ``features.0`` the stem, ``features.1..17`` InvertedResidual
    (``conv``: [expand 1x1 Conv2dNormActivation,] depthwise Conv2dNormActivation, 1x1 conv, BN), ``features.18``
    the last 1x1 to 1280, ``classifier.1`` the Linear."""
    g, s = torch.Generator().manual_seed(1), {}
    _conv(s, "features.0.0", 32, 3, 3, g), _bn(s, "features.0.1", 32, g)
    inp, idx = 32, 1
    for t, c, n, _ in [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]:
        for _ in range(n):
            hidden, p = int(round(inp * t)), f"features.{idx}.conv"
            k = 0
            if t != 1:
                _conv(s, f"{p}.0.0", hidden, inp, 1, g), _bn(s, f"{p}.0.1", hidden, g)
                k = 1
            s[f"{p}.{k}.0.weight"] = torch.randn(hidden, 1, 3, 3, generator=g)
            _bn(s, f"{p}.{k}.1", hidden, g)
            _conv(s, f"{p}.{k + 1}", c, hidden, 1, g), _bn(s, f"{p}.{k + 2}", c, g)
            inp, idx = c, idx + 1
    _conv(s, "features.18.0", 1280, 320, 1, g), _bn(s, "features.18.1", 1280, g)
    s["classifier.1.weight"], s["classifier.1.bias"] = torch.randn(num_classes, 1280, generator=g), torch.randn(num_classes, generator=g)
    return s


def _params(state: dict) -> int:  # what torchvision counts: parameters, not BN running statistics
    return sum(v.numel() for k, v in state.items() if not re.search(r"running_|num_batches", k))


CASES = {  # torchvision model -> (its state dict, FedSight model, its params)
    "resnet18": (lambda nc=1000: tv_resnet("resnet18", nc), "resnet18_imagenet", None),
    "resnet34": (lambda nc=1000: tv_resnet("resnet34", nc), "resnet34_imagenet", None),
    "resnet50": (lambda nc=1000: tv_resnet("resnet50", nc), "resnet50_imagenet", None),
    "mobilenet_v2": (tv_mobilenet_v2, "mobilenetv2", {"cifar_stem": False}),
}


def _model(name: str, params, num_classes: int = 1000):
    torch.manual_seed(0)
    return build_model(name, params, num_classes=num_classes, in_channels=3, image_size=224)


@pytest.mark.parametrize("tv", sorted(CASES))
def test_a_torchvision_checkpoint_loads_every_key_in_its_place(tv, tmp_path) -> None:
    make, name, params = CASES[tv]
    state = make()
    assert _params(state) == PUBLISHED[tv]  # the fixture is torchvision's architecture, independently of FedSight's
    path = tmp_path / f"{tv}.pth"
    torch.save(state, path)
    model = _model(name, params)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[tv]
    loaded = load_checkpoint(model, path, "torchvision")
    own = model.state_dict()
    assert set(loaded) == set(own)  # no missing, no unexpected key
    renamed = convert(state, "torchvision")
    assert all(torch.equal(own[k], renamed[k]) for k in own)
    # the classifier is torchvision's fc / classifier.1, the stem its first conv
    assert torch.equal(own["head.weight"], state["fc.weight" if tv.startswith("resnet") else "classifier.1.weight"])
    assert torch.equal(own["backbone.conv1.weight" if tv.startswith("resnet") else "backbone.features.0.0.weight"],
                       state["conv1.weight" if tv.startswith("resnet") else "features.0.0.weight"])


def test_forward_with_loaded_weights_is_deterministic_and_uses_them(tmp_path) -> None:
    state = tv_resnet("resnet18", 10)
    path = tmp_path / "r18.safetensors"
    save_file(state, str(path))
    a, b = _model("resnet18_imagenet", None, 10), _model("resnet18_imagenet", None, 10)
    x = torch.randn(2, 3, 64, 64)
    a.eval(), b.eval()
    before = a(x)
    load_checkpoint(a, path, "torchvision"), load_checkpoint(b, path, "torchvision")
    assert not torch.allclose(a(x), before) and torch.equal(a(x), b(x))


def test_exclude_keeps_the_models_own_classifier(tmp_path) -> None:
    path = tmp_path / "r18.pth"
    torch.save(tv_resnet("resnet18"), path)
    model = _model("resnet18_imagenet", None, num_classes=10)
    head = model.head.weight.detach().clone()
    with pytest.raises(ValueError, match=r"r18\.pth \(torchvision layout\) does not fit the model: 2 shapes do not fit: "
                                         r"head\.bias \[1000\] vs the model's \[10\]"):
        load_checkpoint(model, path, "torchvision")
    assert torch.equal(model.head.weight, head)  # nothing loaded
    load_checkpoint(model, path, "torchvision", exclude=["head.*"])
    assert torch.equal(model.head.weight, head)
    assert torch.equal(model.backbone.conv1.weight, tv_resnet("resnet18")["conv1.weight"])


def test_wrapped_and_data_parallel_checkpoints_unwrap(tmp_path) -> None:
    state = tv_mobilenet_v2()
    path = tmp_path / "wrapped.pth"
    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in state.items()}}, path)
    assert read_checkpoint(path).keys() == state.keys()
    basicsr = tmp_path / "edsr.pth"  # BasicSR saves params and params_ema: the EMA weights win
    torch.save({"params": {"w": torch.zeros(2)}, "params_ema": {"w": torch.ones(2)}}, basicsr)
    assert torch.equal(read_checkpoint(basicsr)["w"], torch.ones(2))


class _Evil:
    def __reduce__(self):
        return (print, ("this would run code",))


@pytest.mark.parametrize("case", ["code", "truncated", "not a dict", "no tensors", "other architecture", "missing",
                                  "text"])
def test_a_bad_checkpoint_is_one_line_naming_the_file_and_nothing_loads(case, tmp_path) -> None:
    path = tmp_path / "bad.pth"
    if case == "code":
        path.write_bytes(pickle.dumps({"w": _Evil()}, protocol=2))
    elif case == "truncated":
        torch.save(tv_resnet("resnet18"), path)
        path.write_bytes(path.read_bytes()[:5000])
    elif case == "not a dict":
        torch.save([torch.zeros(1)], path)
    elif case == "no tensors":
        torch.save({"epoch": 3}, path)
    elif case == "other architecture":
        torch.save(tv_mobilenet_v2(), path)
    elif case == "text":  # (a config given as a checkpoint)
        path.write_text("[model]\nname = 'cnn'\n")
    model = _model("resnet18_imagenet", None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    err = FileNotFoundError if case == "missing" else ValueError
    with pytest.raises(err) as info:
        load_checkpoint(model, path, "torchvision" if case == "other architecture" else "fedsight")
    msg = str(info.value)
    assert str(path) in msg and "\n" not in msg, msg
    want = {"code": "refused it (Unsupported global: GLOBAL print", "text": "not a torch checkpoint", "truncated": "not a readable checkpoint", "not a dict": "not a dict of tensors",
            "no tensors": "holds no tensors", "other architecture": "keys the model does not have: backbone.features",
            "missing": "not found"}[case]
    assert want in msg, msg
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_unknown_layout_and_wrong_family_are_named(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown weights layout 'timmy'; choose one of: fedsight, torchvision"):
        convert({"a": torch.zeros(1)}, "timmy")
    path = tmp_path / "x.safetensors"
    save_file({"blocks.0.attn.qkv.weight": torch.zeros(3, 1)}, str(path))
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a torchvision ResNet or MobileNetV2 state dict")):
        load_checkpoint(_model("resnet18_imagenet", None), path, "torchvision")


def test_the_config_accepts_exactly_the_layouts_that_exist() -> None:
    """init.layout's choices (config_sections.WEIGHT_LAYOUTS, kept free of torch) are fedsight.weights.LAYOUTS."""
    from fedsight.config_sections import WEIGHT_LAYOUTS
    from fedsight.weights import LAYOUTS

    assert set(WEIGHT_LAYOUTS) == set(LAYOUTS)


def test_convert_file_writes_fedsight_safetensors_that_load_as_fedsight(tmp_path) -> None:
    src, dst = tmp_path / "tv.pth", tmp_path / "fs.safetensors"
    torch.save(tv_resnet("resnet18"), src)
    assert convert_file(src, dst, "torchvision") == len(tv_resnet("resnet18"))
    assert "backbone.layer4.1.bn2.running_var" in load_file(str(dst))
    load_checkpoint(_model("resnet18_imagenet", None), dst, "fedsight")


def test_init_section_loads_a_torchvision_checkpoint_into_the_run(tmp_path) -> None:
    """``[init] weights / layout / exclude`` reach the run's initial model (``api.initial_weights``)."""
    from fedsight.api import initial_weights
    from fedsight.config import validate
    from helpers import tiny

    path = tmp_path / "r18.pth"
    torch.save(tv_resnet("resnet18"), path)
    cfg = validate(tiny(**{"model.name": "resnet18_imagenet", "init.weights": str(path), "init.layout": "torchvision",
                           "init.exclude": ["head.*"]}))
    model = _model("resnet18_imagenet", None, num_classes=10)
    initial_weights(cfg, model, None, torch.device("cpu"))
    assert torch.equal(model.state_dict()["backbone.layer1.0.conv1.weight"], tv_resnet("resnet18")["layer1.0.conv1.weight"])
    with pytest.raises(ValueError, match="head.weight"):
        initial_weights(validate(tiny(**{"model.name": "resnet18_imagenet", "init.weights": str(path),
                                         "init.layout": "torchvision"})), model, None, torch.device("cpu"))


def test_init_keys_without_weights_are_refused() -> None:
    from fedsight.config import validate
    from fedsight.errors import ConfigError
    from helpers import tiny

    for key, value in (("init.layout", "torchvision"), ("init.exclude", ["head.*"]), ("init.strict", False)):
        with pytest.raises(ConfigError, match=f"{re.escape(key)} is set but init.weights is not"):
            validate(tiny(**{key: value}))


def test_weights_convert_command(tmp_path) -> None:
    from typer.testing import CliRunner

    from fedsight.cli import app

    src, dst = tmp_path / "tv.pth", tmp_path / "fs.safetensors"
    torch.save(tv_mobilenet_v2(), src)
    run = lambda *a: CliRunner().invoke(app, ["weights", "convert", *map(str, a)])  # noqa: E731
    res = run(src, dst)
    assert res.exit_code == 0 and f"wrote {dst}" in res.output, res.output
    assert "backbone.features.17.block.2.weight" in load_file(str(dst))
    before = dst.read_bytes()
    for args, msg in (((src, dst), "exists; pass --force"), ((src, tmp_path / "y.safetensors", "--from", "timmy"),
                                                             "--from timmy: unknown layout"),
                      ((tmp_path / "none.pth", tmp_path / "z.safetensors"), "checkpoint file not found")):
        res = run(*args)
        assert res.exit_code == 2 and msg in res.output, res.output
    assert dst.read_bytes() == before and not (tmp_path / "y.safetensors").exists()
    res = run(src, tmp_path / "w.safetensors", "--from", "timm")  # another layout's keys: the file is named
    assert res.exit_code == 2 and f"{src}: not a timm VisionTransformer state dict" in res.output, res.output


def timm_vit(dim: int, depth: int, num_classes: int = 1000, grid: int = 14, patch: int = 16) -> dict[str, torch.Tensor]:
    """timm's ``VisionTransformer`` state dict (class token, absolute position embedding over 1 + grid^2 tokens,
    pre-norm blocks with one qkv linear, MLP ratio 4, final norm, linear head)."""
    g, s = torch.Generator().manual_seed(2), {}
    shapes = {"cls_token": (1, 1, dim), "pos_embed": (1, 1 + grid * grid, dim), "patch_embed.proj.weight": (dim, 3, patch, patch),
              "patch_embed.proj.bias": (dim,)}
    for i in range(depth):
        b = f"blocks.{i}"
        shapes.update({f"{b}.norm1.weight": (dim,), f"{b}.norm1.bias": (dim,), f"{b}.attn.qkv.weight": (3 * dim, dim),
                       f"{b}.attn.qkv.bias": (3 * dim,), f"{b}.attn.proj.weight": (dim, dim), f"{b}.attn.proj.bias": (dim,),
                       f"{b}.norm2.weight": (dim,), f"{b}.norm2.bias": (dim,), f"{b}.mlp.fc1.weight": (4 * dim, dim),
                       f"{b}.mlp.fc1.bias": (4 * dim,), f"{b}.mlp.fc2.weight": (dim, 4 * dim), f"{b}.mlp.fc2.bias": (dim,)})
    shapes.update({"norm.weight": (dim,), "norm.bias": (dim,), "head.weight": (num_classes, dim), "head.bias": (num_classes,)})
    for k, shape in shapes.items():
        s[k] = torch.randn(shape, generator=g) * 0.02
    return s


@pytest.mark.parametrize(("model", "dim", "published"), [("vit_s16", 384, 22_050_664), ("vit_b16", 768, 86_567_656)])
def test_a_timm_vit_checkpoint_loads_every_key_and_its_position_embedding_follows_the_image_size(model, dim, published,
                                                                                             tmp_path) -> None:
    state = timm_vit(dim, 12)
    assert _params(state) == published  # timm's published count for vit_*_patch16_224
    path = tmp_path / "vit.safetensors"
    save_file(state, str(path))
    full = _model(model, None)
    assert set(load_checkpoint(full, path, "timm")) == set(full.state_dict())
    assert torch.equal(full.backbone.pos_embed, state["pos_embed"]) and torch.equal(full.head.weight, state["head.weight"])
    # built for 32 x 32 images (a 2 x 2 grid): the 14 x 14 embedding is resampled, the class token's entry kept
    small = build_model(model, None, num_classes=1000, in_channels=3, image_size=32)
    load_checkpoint(small, path, "timm")
    pos = small.backbone.pos_embed
    assert pos.shape == (1, 5, dim) and torch.equal(pos[:, 0], state["pos_embed"][:, 0])
    assert small(torch.randn(2, 3, 32, 32)).shape == (2, 1000)


def test_position_embedding_resampling_keeps_a_constant_field_and_is_the_identity_on_its_own_grid() -> None:
    from fedsight.models.vit import resample_pos_embed

    pos = torch.randn(1, 1 + 14 * 14, 8)
    assert resample_pos_embed(pos, 14) is pos
    const = torch.cat([torch.zeros(1, 1, 8), torch.full((1, 196, 8), 0.7)], dim=1)
    torch.testing.assert_close(resample_pos_embed(const, 3)[:, 1:], torch.full((1, 9, 8), 0.7))
    with pytest.raises(ValueError, match="not a class token and a square grid"):
        resample_pos_embed(torch.zeros(1, 7, 8), 2)
