"""Published keypoint checkpoints load (``fedsight.weights_pose``): the official ViTPose release into ``vitpose_s`` /
``vitpose_b`` (layout ``vitpose``, also a plain MAE/ImageNet ViT backbone), torchvision's ImageNet ResNets and the
SimpleBaseline release into ``simplebaseline`` (layouts ``torchvision``, ``pose_resnet``, and mmpose's through
``vitpose``).

The state dicts are written here from the reference architectures as read in their sources (key names and
shapes), independently of FedSight's models: ViTPose's ``mmpose/models/backbones/vit.py`` and
``heads/topdown_heatmap_simple_head.py`` with the ``ViTPose_{small,base}_coco_256x192.py`` configs, SimpleBaseline's
``lib/models/pose_resnet.py``, torchvision's ResNets (``tests/models/test_weights.py``). Paper-size ViTPose models
are checked on the meta device (names and shapes) and by parameter count; tiny ones load from files, every value
in its place.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fedsight.models import build_model
from fedsight.weights import convert, fit_problems, load_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_weights import PUBLISHED, _bn, _conv, tv_resnet  # noqa: E402

J = 17
TINY = {"dim": 32, "depth": 2, "heads": 2, "deconv_filters": 16, "drop_path": 0.0}
#: timm's published parameter counts of vit_small_patch16_224 / vit_base_patch16_224 (1000 classes)
TIMM = {384: 22_050_664, 768: 86_567_656}


def release_vitpose(dim: int, depth: int, joints: int = J, grid: tuple[int, int] = (16, 12), head: str = "deconv",
                    filters: int = 256, device: str = "cpu", prefix: bool = True) -> dict[str, torch.Tensor]:
    """The official ViTPose ``TopDown`` state dict: ``backbone.`` ViT (PatchEmbed ``proj`` 16x16, ``pos_embed`` with
    the class-token slot over ``1 + h w`` positions, blocks with qkv bias and MLP ratio 4, ``last_norm``) and
    ``keypoint_head.`` (``deconv_layers`` = [ConvTranspose2d (no bias; weight [in, out, 4, 4]), BN, ReLU] x 2 and a
    1x1 ``final_layer``, or with ``head = "simple"`` only a 3x3 ``final_layer``). ``prefix=False``: a plain ViT's
    patch embedding, position embedding and blocks under their own names."""
    g = torch.Generator().manual_seed(3)
    shapes = {"patch_embed.proj.weight": (dim, 3, 16, 16), "patch_embed.proj.bias": (dim,),
              "pos_embed": (1, 1 + grid[0] * grid[1], dim)}
    for i in range(depth):
        b = f"blocks.{i}"
        shapes.update({f"{b}.norm1.weight": (dim,), f"{b}.norm1.bias": (dim,), f"{b}.attn.qkv.weight": (3 * dim, dim),
                       f"{b}.attn.qkv.bias": (3 * dim,), f"{b}.attn.proj.weight": (dim, dim),
                       f"{b}.attn.proj.bias": (dim,), f"{b}.norm2.weight": (dim,), f"{b}.norm2.bias": (dim,),
                       f"{b}.mlp.fc1.weight": (4 * dim, dim), f"{b}.mlp.fc1.bias": (4 * dim,),
                       f"{b}.mlp.fc2.weight": (dim, 4 * dim), f"{b}.mlp.fc2.bias": (dim,)})
    if not prefix:  # (a plain ViT's final norm is ``norm``: the caller adds it)
        return {k: _random(s, g, device) for k, s in shapes.items()}
    shapes.update({"last_norm.weight": (dim,), "last_norm.bias": (dim,)})
    state = {f"backbone.{k}": _random(s, g, device) for k, s in shapes.items()}
    if head == "deconv":
        cin = dim
        for i in (0, 3):
            state[f"keypoint_head.deconv_layers.{i}.weight"] = _random((cin, filters, 4, 4), g, device)
            for k in ("weight", "bias", "running_mean", "running_var"):
                state[f"keypoint_head.deconv_layers.{i + 1}.{k}"] = _random((filters,), g, device).abs() + 0.5
            state[f"keypoint_head.deconv_layers.{i + 1}.num_batches_tracked"] = torch.tensor(9, device=device)
            cin = filters
        state["keypoint_head.final_layer.weight"] = _random((joints, filters, 1, 1), g, device)
    else:
        state["keypoint_head.final_layer.weight"] = _random((joints, dim, 3, 3), g, device)
    state["keypoint_head.final_layer.bias"] = _random((joints,), g, device)
    return state


def _random(shape, g: torch.Generator, device: str) -> torch.Tensor:
    return torch.empty(shape, device="meta") if device == "meta" else torch.randn(shape, generator=g) * 0.1


def _n(state: dict, pattern: str = "") -> int:  # parameters (not BatchNorm statistics) of the keys matching pattern
    return sum(v.numel() for k, v in state.items() if pattern in k and not re.search(r"running_|num_batches", k))


def tiny_vitpose(seed: int = 0, **params):
    torch.manual_seed(seed)
    return build_model("vitpose_s", {**TINY, **params}, num_outputs=J).eval()


# -- ViTPose ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,dim", [("vitpose_s", 384), ("vitpose_b", 768)])
def test_the_paper_size_release_checkpoint_has_every_key_and_shape_of_the_model(name, dim):
    """On the meta device: the release's 256x192 checkpoint (17 COCO joints) converts to exactly the model's keys
    and shapes; the backbone is timm's ViT of that width less the classifier, the class token and 4 position slots
    (197 positions at 224x224, 193 at 256x192), and the head 2 deconvolutions of 256 + BN and a 1x1 conv."""
    state = release_vitpose(dim, 12, device="meta")
    with torch.device("meta"):
        model = build_model(name, {}, num_outputs=J)
    converted = convert(state, "vitpose")
    assert fit_problems(model, converted, list(model.state_dict())) == []
    assert set(converted) == set(model.state_dict())
    backbone = TIMM[dim] - (dim * 1000 + 1000) - dim - 4 * dim
    assert _n(state, "backbone.") == backbone == sum(p.numel() for p in model.backbone.parameters())
    head = dim * 256 * 16 + 256 * 256 * 16 + 2 * 2 * 256 + 256 * J + J
    assert _n(state, "keypoint_head.") == head == sum(p.numel() for p in model.head.parameters())


@pytest.mark.parametrize("head", ["deconv", "simple"])
def test_a_release_checkpoint_loads_every_value_in_its_place(head, tmp_path):
    state = release_vitpose(32, 2, head=head, filters=16, grid=(4, 3))
    path = tmp_path / "vitpose.pth"
    torch.save({"meta": {"epoch": 210}, "state_dict": state}, path)  # as mmcv's save_checkpoint writes it
    model = tiny_vitpose(head=head, image_size=[64, 48])
    loaded = load_checkpoint(model, path, "vitpose")
    own = model.state_dict()
    assert set(loaded) == set(own)
    pairs = {"backbone.pos_embed": "backbone.pos_embed", "backbone.blocks.1.attn.qkv.bias": "backbone.blocks.1.attn.qkv.bias",
             "backbone.last_norm.weight": "backbone.last_norm.weight", "head.final.weight": "keypoint_head.final_layer.weight"}
    if head == "deconv":
        pairs.update({"head.deconvs.0.weight": "keypoint_head.deconv_layers.0.weight",
                      "head.deconvs.4.running_var": "keypoint_head.deconv_layers.4.running_var"})
    for mine, theirs in pairs.items():
        assert torch.equal(own[mine], state[theirs]), mine
    assert all(torch.equal(own[k], v) for k, v in convert(state, "vitpose").items())


def test_patch_embedding_is_padded_by_2_and_the_class_slot_is_added_to_every_token():
    """The tokens entering the first block are ``conv16x16/16(pad2(x)) + pos_embed[1:] + pos_embed[0]`` (the
    release's ``PatchEmbed`` padding at ratio 1 and its ``x + pos_embed[:, 1:] + pos_embed[:, :1]``), written out
    with an explicit zero padding of the normalised image."""
    model = tiny_vitpose(image_size=[64, 48])
    bb = model.backbone
    seen = {}
    bb.blocks[0].register_forward_pre_hook(lambda m, args: seen.update(x=args[0]))  # (returns None: args unchanged)
    x = torch.rand(2, 3, 64, 48)
    with torch.no_grad():
        model(x)
        conv = F.conv2d(F.pad(bb.normalize(x), (2, 2, 2, 2)), bb.patch_embed.proj.weight, bb.patch_embed.proj.bias,
                        stride=16)
        assert conv.shape[-2:] == (4, 3)
        want = conv.flatten(2).transpose(1, 2) + bb.pos_embed[:, 1:] + bb.pos_embed[:, :1]
    torch.testing.assert_close(seen["x"], want, rtol=0, atol=1e-6)


def test_a_256x192_checkpoint_runs_at_other_sizes_as_the_release_model_built_for_them():
    """A model laid out for 256x192 run at 384x288 resamples its 16x12 embedding for that pass; the release's way is
    a model built for 384x288 loading the 256x192 checkpoint (its loader resamples bicubically, class slot kept):
    the two give the same heatmaps. The 16x12 grid is told from the 192 positions by the model's 4:3 grid."""
    small = tiny_vitpose()  # image_size 256x192 by default
    assert small.backbone.pos_embed.shape == (1, 193, 32)
    big = tiny_vitpose(seed=1, image_size=[384, 288])
    state = big.adapt_checkpoint(dict(small.state_dict()))
    pos = small.backbone.pos_embed.detach()
    grid = pos[:, 1:].reshape(1, 16, 12, 32).permute(0, 3, 1, 2)
    want = F.interpolate(grid, size=(24, 18), mode="bicubic", align_corners=False).permute(0, 2, 3, 1).flatten(1, 2)
    torch.testing.assert_close(state["backbone.pos_embed"][:, 1:], want)
    assert torch.equal(state["backbone.pos_embed"][:, :1], pos[:, :1])
    big.load_state_dict(state)
    x = torch.rand(1, 3, 384, 288)
    with torch.no_grad():
        out = small(x)
        assert out.shape == (1, J, 96, 72)
        torch.testing.assert_close(out, big(x), rtol=1e-5, atol=1e-6)


def test_an_embedding_whose_grid_cannot_be_told_is_refused_naming_the_file(tmp_path):
    state = release_vitpose(32, 2, filters=16, grid=(10, 3))  # 30 positions: not square, not 4:3
    path = tmp_path / "odd.pth"
    torch.save(state, path)
    model = tiny_vitpose()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        load_checkpoint(model, path, "vitpose")
    msg = str(info.value)
    assert msg.startswith(f"{path} (vitpose layout) does not fit the model: backbone.pos_embed has 30 patch positions") and "\n" not in msg
    assert "model.image_size" in msg
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_an_mae_backbone_loads_with_the_head_and_last_norm_excluded(tmp_path):
    """MAE's ``mae_pretrain_vit_*.pth`` (``model``: a plain ViT at 224x224 with ``cls_token``, its final ``norm`` and,
    in the full pre-training checkpoint, the decoder) as the paper's initialisation: the keys the release's loader
    ignores are dropped, the 14x14 embedding is resampled to 16x12 (bicubic, class slot kept), and the head and
    ``last_norm`` keep the model's own initialisation."""
    vit = release_vitpose(32, 2, grid=(14, 14), prefix=False)
    vit["cls_token"], vit["norm.weight"], vit["norm.bias"] = torch.ones(1, 1, 32), torch.ones(32), torch.ones(32)
    vit["mask_token"], vit["decoder_embed.weight"] = torch.ones(1, 1, 32), torch.ones(16, 32)
    path = tmp_path / "mae_pretrain_vit_tiny.pth"
    torch.save({"model": vit}, path)
    model = tiny_vitpose()
    with pytest.raises(ValueError, match=r"model keys it does not give: backbone\.last_norm\.bias, "
                                         r"backbone\.last_norm\.weight, head\.deconvs"):
        load_checkpoint(model, path, "vitpose")
    head = model.head.final.weight.clone()
    loaded = load_checkpoint(model, path, "vitpose", exclude=["head.*", "backbone.last_norm.*"])
    assert {k for k in loaded if not k.startswith("backbone.blocks.")} == {
        "backbone.patch_embed.proj.weight", "backbone.patch_embed.proj.bias", "backbone.pos_embed"}
    assert torch.equal(model.head.final.weight, head) and torch.equal(model.backbone.last_norm.weight, torch.ones(32))
    grid = vit["pos_embed"][:, 1:].reshape(1, 14, 14, 32).permute(0, 3, 1, 2)
    want = F.interpolate(grid, size=(16, 12), mode="bicubic", align_corners=False).permute(0, 2, 3, 1).flatten(1, 2)
    torch.testing.assert_close(model.backbone.pos_embed[:, 1:], want)
    assert torch.equal(model.backbone.blocks[1].mlp.fc2.weight, vit["blocks.1.mlp.fc2.weight"])


def test_another_model_size_or_family_is_named(tmp_path):
    path = tmp_path / "b.pth"
    torch.save(release_vitpose(48, 2, filters=16), path)
    with pytest.raises(ValueError, match=r"b\.pth \(vitpose layout\) does not fit the model: .*shapes do not fit: "
                                         r"backbone\.blocks\.0\.attn\.proj\.bias \[48\] vs the model's \[32\]"):
        load_checkpoint(tiny_vitpose(), path, "vitpose")
    torch.save(tv_resnet("resnet18"), path)
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a ViTPose checkpoint")):
        load_checkpoint(tiny_vitpose(), path, "vitpose")


# -- SimpleBaseline -------------------------------------------------------------------------------------------------


def simplebaseline(depth: int, **params):
    torch.manual_seed(0)
    return build_model("simplebaseline", {"depth": depth, "width": 64, "deconv_filters": 256, **params}, num_outputs=J)


TV_PAIRS = {"backbone.stem.0.weight": "conv1.weight", "backbone.stem.1.running_mean": "bn1.running_mean",
            "backbone.stages.0.0.conv2.weight": "layer1.0.conv2.weight",
            "backbone.stages.1.0.shortcut.0.weight": "layer2.0.downsample.0.weight",
            "backbone.stages.1.0.shortcut.1.running_var": "layer2.0.downsample.1.running_var",
            "backbone.stages.3.1.norm2.bias": "layer4.1.bn2.bias"}


@pytest.mark.parametrize("arch,depth", [("resnet18", 18), pytest.param("resnet34", 34, marks=pytest.mark.slow),
                                        ("resnet50", 50)])
def test_torchvision_imagenet_weights_load_into_simplebaselines_backbone(arch, depth, tmp_path):
    """simplebaseline's trunk has its own names (``stem``, ``stages``, ``normK``, ``shortcut``), not torchvision's:
    the model renames torchvision's on loading. The classifier ``fc`` (``head.*`` after conversion) is excluded and
    the pose head keeps its initialisation, as the release's ``init_weights`` does (``strict=False``)."""
    tv = tv_resnet(arch)
    path = tmp_path / f"{arch}.pth"
    torch.save(tv, path)
    model = simplebaseline(depth)
    assert sum(p.numel() for p in model.backbone.parameters()) == PUBLISHED[arch] - (_n(tv, "fc.")) == _n(tv) - _n(tv, "fc.")
    head = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("head.")}
    loaded = load_checkpoint(model, path, "torchvision", exclude=["head.*"])
    own = model.state_dict()
    assert set(loaded) == {k for k in own if k.startswith("backbone.")}
    pairs = {**TV_PAIRS, "backbone.stages.2.3.conv3.weight": "layer3.3.conv3.weight"} if depth == 50 else TV_PAIRS
    for mine, theirs in pairs.items():
        assert torch.equal(own[mine], tv[theirs]), mine
    assert all(torch.equal(own[k], v) for k, v in head.items())


def release_pose_resnet(depth: int, joints: int = J, counters: bool = True) -> dict[str, torch.Tensor]:
    """``PoseResNet`` (SimpleBaseline's release): torchvision's trunk names, ``deconv_layers`` = [ConvTranspose2d
    (no bias: ``DECONV_WITH_BIAS: false``), BN, ReLU] x 3 with 256 filters, a 1x1 ``final_layer``; ``counters=False``:
    saved by PyTorch 0.4.0 (the release's), whose BatchNorm had no ``num_batches_tracked``."""
    state = {k: v for k, v in tv_resnet(f"resnet{depth}").items() if not k.startswith("fc.")}
    g, cin = torch.Generator().manual_seed(5), 2048 if depth == 50 else 512
    for i in (0, 3, 6):
        state[f"deconv_layers.{i}.weight"] = torch.randn(cin, 256, 4, 4, generator=g)
        _bn(state, f"deconv_layers.{i + 1}", 256, g)
        cin = 256
    _conv(state, "final_layer", joints, 256, 1, g)
    state["final_layer.bias"] = torch.randn(joints, generator=g)
    return state if counters else {k: v for k, v in state.items() if "num_batches_tracked" not in k}


@pytest.mark.parametrize("depth,counters", [(18, False), (50, True)])
def test_the_simplebaseline_release_loads_whole(depth, counters, tmp_path):
    """pose_resnet_50 has 34.0M parameters in the paper (33,999,697 with 17 joints); the release's 2018 files lack
    BatchNorm's ``num_batches_tracked``, which loads as 0 (as torch's BatchNorm does for such files)."""
    state = release_pose_resnet(depth, counters=counters)
    if depth == 50:
        assert _n(state) == 33_999_697
    path = tmp_path / "pose_resnet.pth.tar"
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}}, path)  # DataParallel, as trained
    model = simplebaseline(depth)
    loaded = load_checkpoint(model, path, "pose_resnet")
    own = model.state_dict()
    assert set(loaded) == set(own)
    for mine, theirs in {**TV_PAIRS, "head.deconvs.0.weight": "deconv_layers.0.weight",
                         "head.deconvs.7.running_mean": "deconv_layers.7.running_mean",
                         "head.final.weight": "final_layer.weight", "head.final.bias": "final_layer.bias"}.items():
        assert torch.equal(own[mine], state[theirs]), mine
    counter = own["backbone.stages.0.0.norm1.num_batches_tracked"]
    assert counter.item() == (7 if counters else 0)


def test_mmposes_simplebaseline_loads_through_the_vitpose_layout(tmp_path):
    """mmpose's top-down ResNet checkpoints (``backbone.conv1``, ``backbone.layerN``, ``keypoint_head.*``) are the
    layout the ViTPose release saves too."""
    state = release_pose_resnet(18)
    mm = {(f"keypoint_head.{k}" if k.startswith(("deconv", "final")) else f"backbone.{k}"): v for k, v in state.items()}
    path = tmp_path / "res18_coco_256x192.pth"
    torch.save({"state_dict": mm}, path)
    model = simplebaseline(18)
    load_checkpoint(model, path, "vitpose")
    assert torch.equal(model.state_dict()["backbone.stages.1.0.shortcut.0.weight"], state["layer2.0.downsample.0.weight"])
    assert torch.equal(model.head.final.weight, state["final_layer.weight"])


def test_pose_resnet_layout_refuses_other_files(tmp_path):
    path = tmp_path / "vit.pth"
    torch.save(release_vitpose(32, 1, filters=16), path)
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a SimpleBaseline pose_resnet state dict")):
        load_checkpoint(simplebaseline(18), path, "pose_resnet")


def test_exclude_patterns_match_simplebaselines_own_names(tmp_path):
    """``exclude`` names FedSight keys; for simplebaseline those are its own (``stages.3``), not torchvision's
    (``layer4``), though the model renames torchvision's only after the layout's conversion."""
    path = tmp_path / "r18.pth"
    torch.save(tv_resnet("resnet18"), path)
    model = simplebaseline(18)
    last = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("backbone.stages.3.")}
    loaded = load_checkpoint(model, path, "torchvision", exclude=["head.*", "backbone.stages.3.*"])
    assert not [k for k in loaded if k.startswith("backbone.stages.3.")]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in last.items())
    assert torch.equal(model.state_dict()["backbone.stages.2.1.conv1.weight"], tv_resnet("resnet18")["layer3.1.conv1.weight"])


def test_bad_vitpose_parameters_name_the_field():
    with pytest.raises(ValueError, match=r"vitpose_s: model.image_size must be multiples of the patch size 16, got \[250, 192\]"):
        build_model("vitpose_s", {**TINY, "image_size": [250, 192]}, num_outputs=J)
    with pytest.raises(ValueError, match="vitpose_b: model.dim 32 is not divisible by model.heads 3"):
        build_model("vitpose_b", {**TINY, "heads": 3}, num_outputs=J)
    with pytest.raises(ValueError, match=r"vitpose_s needs an input height and width that are multiples of 16"):
        tiny_vitpose()(torch.rand(1, 3, 72, 48))


@pytest.mark.parametrize("arch,depth", [("resnet18", 18), ("resnet50", 50)])
def test_simplebaselines_trunk_with_torchvision_weights_computes_torchvisions_trunk(arch, depth, tmp_path):
    """The renamed keys land where they act: with the same torchvision checkpoint, simplebaseline's backbone equals
    ``resnet*_imagenet``'s (torchvision's architecture and names) on the ImageNet-normalised input."""
    from fedsight.models.pose import IMAGENET_MEAN, IMAGENET_STD

    path = tmp_path / f"{arch}.pth"
    torch.save({k: v * 0.1 if k.endswith("weight") and v.ndim == 4 else v for k, v in tv_resnet(arch).items()}, path)
    pose = simplebaseline(depth).eval()
    load_checkpoint(pose, path, "torchvision", exclude=["head.*"])
    torch.manual_seed(0)
    ref = build_model(f"{arch}_imagenet", {}, num_classes=1000, in_channels=3).eval()
    load_checkpoint(ref, path, "torchvision")
    x = torch.rand(2, 3, 64, 64)
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        torch.testing.assert_close(pose.features(x), ref.backbone.feature_map((x - mean) / std), rtol=1e-5, atol=1e-5)
