"""The segmentation models load their published checkpoints (``fedsight.weights_seg``): FedDrive's and
CoinCheung/BiSeNet's BiSeNetV2, LADD's DeepLabV3-MobileNetV2, d-li14's and torchvision's ImageNet MobileNetV2.

The state dicts are written here from the reference sources' architecture definitions (key names and shapes read
from ``Erosinho13/FedDrive`` ``src/modules/bisenetv2.py``, ``CoinCheung/BiSeNet`` ``lib/models/bisenetv2.py``,
``Erosinho13/LADD`` ``src/modules/{deeplabv3,mobilenetv2}.py`` and torchvision's ``DeepLabHead``), independently of
FedSight's models: every key loads with none missing or unexpected, the parameter counts are equal, and hand-picked
values land where the reference's forward uses them."""

from __future__ import annotations

import re

import pytest
import torch
from test_weights import _bn, _conv, _params, tv_mobilenet_v2

from fedsight.models import build_model
from fedsight.weights import convert, load_checkpoint, read_checkpoint

C = 19  # Cityscapes
#: BiSeNetV2's auxiliary heads: reference name, input channels, upsampling factor
AUX = [("aux2", 16, 4), ("aux3", 32, 8), ("aux4", 64, 16), ("aux5_4", 128, 32)]


def _cbr(s: dict, name: str, cin: int, cout: int, k: int, g: torch.Generator) -> None:
    """A reference ``ConvBNReLU``: ``<name>.conv`` (no bias) and ``<name>.bn``."""
    _conv(s, f"{name}.conv", cout, cin, k, g), _bn(s, f"{name}.bn", cout, g)


def _dw(s: dict, name: str, cout: int, g: torch.Generator) -> None:  # a depthwise conv (groups = input channels)
    s[f"{name}.weight"] = torch.randn(cout, 1, 3, 3, generator=g)


def ref_bisenetv2(style: str, num_classes: int = C, aux: bool = True) -> dict[str, torch.Tensor]:
    """BiSeNetV2's state dict as FedDrive (``style="feddrive"``) or CoinCheung's release (``"bisenet"``) defines it."""
    g, s = torch.Generator().manual_seed(2), {}
    for stage, chans in (("S1", [(3, 64), (64, 64)]), ("S2", [(64, 64)] * 3), ("S3", [(64, 128), (128, 128), (128, 128)])):
        for i, (cin, cout) in enumerate(chans):
            _cbr(s, f"detail.{stage}.{i}", cin, cout, 3, g)
    _cbr(s, "segment.S1S2.conv", 3, 16, 3, g)
    _cbr(s, "segment.S1S2.left.0", 16, 8, 1, g), _cbr(s, "segment.S1S2.left.1", 8, 16, 3, g)
    _cbr(s, "segment.S1S2.fuse", 32, 16, 3, g)
    for stage, cin, cout, n in (("S3", 16, 32, 2), ("S4", 32, 64, 2), ("S5_4", 64, 128, 4)):
        for i in range(n):
            p, c = f"segment.{stage}.{i}", cin if i == 0 else cout
            _cbr(s, f"{p}.conv1", c, c, 3, g)
            if i == 0:  # GELayerS2
                _dw(s, f"{p}.dwconv1.0", 6 * c, g), _bn(s, f"{p}.dwconv1.1", 6 * c, g)
                s[f"{p}.dwconv2.0.weight"] = torch.randn(6 * c, 1, 3, 3, generator=g)
                _bn(s, f"{p}.dwconv2.1", 6 * c, g)
                _dw(s, f"{p}.shortcut.0", c, g), _bn(s, f"{p}.shortcut.1", c, g)
                _conv(s, f"{p}.shortcut.2", cout, c, 1, g), _bn(s, f"{p}.shortcut.3", cout, g)
            else:  # GELayerS1
                _dw(s, f"{p}.dwconv.0", 6 * c, g), _bn(s, f"{p}.dwconv.1", 6 * c, g)
            _conv(s, f"{p}.conv2.0", cout, 6 * c, 1, g), _bn(s, f"{p}.conv2.1", cout, g)
    _bn(s, "segment.S5_5.bn", 128, g)
    _cbr(s, "segment.S5_5.conv_gap", 128, 128, 1, g), _cbr(s, "segment.S5_5.conv_last", 128, 128, 3, g)
    _dw(s, "bga.left1.0", 128, g), _bn(s, "bga.left1.1", 128, g), _conv(s, "bga.left1.2", 128, 128, 1, g)
    _conv(s, "bga.left2.0", 128, 128, 3, g), _bn(s, "bga.left2.1", 128, g)
    _conv(s, "bga.right1.0", 128, 128, 3, g), _bn(s, "bga.right1.1", 128, g)
    _dw(s, "bga.right2.0", 128, g), _bn(s, "bga.right2.1", 128, g), _conv(s, "bga.right2.2", 128, 128, 1, g)
    _conv(s, "bga.conv.0", 128, 128, 3, g), _bn(s, "bga.conv.1", 128, g)

    def classifier(name: str, cin: int, cout: int) -> None:
        s[f"{name}.weight"], s[f"{name}.bias"] = torch.randn(cout, cin, 1, 1, generator=g), torch.randn(cout, generator=g)

    _cbr(s, "head.conv", 128, 1024, 3, g)
    if style == "feddrive":  # conv_out = [1x1 to classes * 8**2, PixelShuffle(8)]
        classifier("head.conv_out.0", 1024, num_classes * 64)
    else:  # conv_out = [Identity, 1x1 to classes, Upsample]
        classifier("head.conv_out.1", 1024, num_classes)
    for name, cin, up in AUX if aux else []:
        _cbr(s, f"{name}.conv", cin, 128, 3, g)
        if style == "feddrive":
            classifier(f"{name}.conv_out.0", 128, num_classes * up * up)
        else:  # conv_out = [[Upsample(2), ConvBNReLU(128, up**2)], 1x1 to classes, Upsample]
            _cbr(s, f"{name}.conv_out.0.1", 128, up * up, 3, g)
            classifier(f"{name}.conv_out.1", up * up, num_classes)
    return s


def _bisenet_model(style: str, num_classes: int = C):
    torch.manual_seed(0)
    return build_model("bisenetv2", {"head_style": style}, num_classes=num_classes, in_channels=3, image_size=64)


#: reference key -> FedSight key, one per kind of rename (ConvBNReLU, GE layers, stem, context embedding, BGA, heads)
BISENET_SPOTS = {
    "detail.S1.0.conv.weight": "backbone.detail.S1.0.0.weight",
    "detail.S3.2.bn.running_var": "backbone.detail.S3.2.1.running_var",
    "segment.S1S2.left.1.conv.weight": "backbone.semantic.stem.left.1.0.weight",
    "segment.S1S2.fuse.bn.bias": "backbone.semantic.stem.fuse.1.bias",
    "segment.S3.0.shortcut.2.weight": "backbone.semantic.S3.0.shortcut.2.weight",
    "segment.S4.1.dwconv.0.weight": "backbone.semantic.S4.1.dwconv.0.weight",
    "segment.S5_4.3.conv1.conv.weight": "backbone.semantic.S5.3.conv1.0.weight",
    "segment.S5_4.0.dwconv2.1.weight": "backbone.semantic.S5.0.dwconv2.1.weight",
    "segment.S5_5.bn.running_mean": "backbone.semantic.ce.norm.running_mean",
    "segment.S5_5.conv_gap.conv.weight": "backbone.semantic.ce.conv_gap.0.weight",
    "segment.S5_5.conv_last.bn.weight": "backbone.semantic.ce.conv_last.1.weight",
    "bga.left1.2.weight": "backbone.bga.left1.2.weight",
    "bga.right2.0.weight": "backbone.bga.right2.0.weight",
    "bga.conv.1.bias": "backbone.bga.conv.1.bias",
    "head.conv.conv.weight": "head.main.conv.0.weight",
    "aux2.conv.bn.weight": "head.aux.0.conv.1.weight",
    "aux5_4.conv.conv.weight": "head.aux.3.conv.0.weight",
}
STYLE_SPOTS = {
    "feddrive": {"head.conv_out.0.weight": "head.main.classifier.weight", "aux3.conv_out.0.bias": "head.aux.1.classifier.bias"},
    "bisenet": {"head.conv_out.1.weight": "head.main.classifier.weight", "aux4.conv_out.1.weight": "head.aux.2.classifier.weight",
                "aux4.conv_out.0.1.conv.weight": "head.aux.2.refine.0.weight", "aux2.conv_out.0.1.bn.running_var":
                "head.aux.0.refine.1.running_var"},
}


@pytest.mark.parametrize("style", ["feddrive", "bisenet"])
def test_a_bisenetv2_release_loads_every_key_in_its_place(style, tmp_path) -> None:
    state = ref_bisenetv2(style)
    path = tmp_path / f"{style}.pth"
    if style == "feddrive":  # FedDrive saves {"model_state": DDP state dict, "round": ...}
        torch.save({"round": 1600, "model_state": {f"module.{k}": v for k, v in state.items()}}, path)
    else:
        torch.save(state, path)
    model = _bisenet_model(style)
    assert sum(p.numel() for p in model.parameters()) == _params(state) == {"feddrive": 8_196_416, "bisenet": 5_231_487}[style]
    loaded = load_checkpoint(model, path, style)
    own = model.state_dict()
    assert set(loaded) == set(own)  # no missing, no unexpected key
    for ref, ours in {**BISENET_SPOTS, **STYLE_SPOTS[style]}.items():
        assert torch.equal(own[ours], state[ref]), (ref, ours)
    renamed = convert(state, style)
    assert all(torch.equal(own[k], renamed[k]) for k in own)


def test_the_paper_style_is_todays_model_and_its_inference_part_is_the_references() -> None:
    """``head_style = "paper"`` keeps today's keys; without auxiliary heads, CoinCheung's release (its main head is
    1x1 to classes) has the same parameter count (3,358,627 at 19 classes)."""
    model = _bisenet_model("paper")
    inference = sum(p.numel() for k, p in model.named_parameters() if not k.startswith("head.aux."))
    assert inference == _params(ref_bisenetv2("bisenet", aux=False)) == 3_358_627
    assert "head.main.classifier.weight" in model.state_dict() and not any(".refine." in k for k in model.state_dict())


def test_coincheungs_imagenet_backbone_loads_into_the_two_branches(tmp_path) -> None:
    """``backbone_v2.pth`` is ``{"detail": state, "segment": state}`` (CoinCheung loads it child by child)."""
    full = ref_bisenetv2("bisenet")
    nested = {top: {k[len(top) + 1:]: v for k, v in full.items() if k.startswith(f"{top}.")} for top in ("detail", "segment")}
    path = tmp_path / "backbone_v2.pth"
    torch.save(nested, path)
    model = _bisenet_model("bisenet")
    loaded = load_checkpoint(model, path, "bisenet", strict=False)
    branches = {k for k in model.state_dict() if k.startswith(("backbone.detail.", "backbone.semantic."))}
    assert set(loaded) == branches
    assert torch.equal(model.state_dict()["backbone.semantic.ce.norm.weight"], full["segment.S5_5.bn.weight"])


def test_a_checkpoint_for_another_head_style_names_the_style_to_build(tmp_path) -> None:
    path = tmp_path / "feddrive.pth"
    torch.save(ref_bisenetv2("feddrive"), path)
    model = _bisenet_model("paper")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        load_checkpoint(model, path, "feddrive")
    msg = str(info.value)
    assert msg.startswith(f"{path} (feddrive layout) does not fit the model") and "\n" not in msg
    assert msg.endswith("its heads are head_style 'feddrive' heads for 19 classes: build the model with "
                        "model.head_style = \"feddrive\"")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    torch.save(ref_bisenetv2("bisenet"), path)
    with pytest.raises(ValueError, match="use layout 'bisenet' and head_style = 'bisenet'"):
        load_checkpoint(model, path, "feddrive")
    with pytest.raises(ValueError, match="head_style 'bisenet' heads for 19 classes: build the model with "
                                         "model.head_style = \"bisenet\"$"):
        load_checkpoint(_bisenet_model("feddrive"), path, "bisenet")
    torch.save(ref_bisenetv2("feddrive"), path)  # another number of classes as well (a FedDrive Cityscapes model)
    with pytest.raises(ValueError, match="head_style 'feddrive' heads for 19 classes: build the model with model.head_style"
                                         " = \"feddrive\" and 19 classes \\(or exclude = \\[\"head.\\*.classifier.\\*\"\\]\\)$"):
        load_checkpoint(_bisenet_model("paper", num_classes=13), path, "feddrive")
    with pytest.raises(ValueError, match="heads for 19 classes: build the model with 19 classes \\(or exclude"):
        load_checkpoint(_bisenet_model("feddrive", num_classes=13), path, "feddrive")


# -- DeepLabV3 on MobileNetV2 ---------------------------------------------------------------------------------------

#: MobileNetV2's (expansion t, channels c, repeats n) (the paper's Table 2; d-li14's cfgs)
MBV2 = [(1, 16, 1), (6, 24, 2), (6, 32, 3), (6, 64, 4), (6, 96, 3), (6, 160, 3), (6, 320, 1)]


def dli14_features(prefix: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    """d-li14's MobileNetV2 ``features.0..17`` under ``prefix``: the stem ``0.{0,1}``, then each InvertedResidual's
    flat ``conv`` Sequential (expansion 1: dw 0, BN 1, 1x1 3, BN 4; otherwise 1x1 0, BN 1, dw 3, BN 4, 1x1 6, BN 7)."""
    s: dict[str, torch.Tensor] = {}
    _conv(s, f"{prefix}0.0", 32, 3, 3, g), _bn(s, f"{prefix}0.1", 32, g)
    inp, idx = 32, 1
    for t, c, n in MBV2:
        for _ in range(n):
            hidden, p = round(inp * t), f"{prefix}{idx}.conv"
            if t == 1:
                _dw(s, f"{p}.0", hidden, g), _bn(s, f"{p}.1", hidden, g)
                _conv(s, f"{p}.3", c, hidden, 1, g), _bn(s, f"{p}.4", c, g)
            else:
                _conv(s, f"{p}.0", hidden, inp, 1, g), _bn(s, f"{p}.1", hidden, g)
                _dw(s, f"{p}.3", hidden, g), _bn(s, f"{p}.4", hidden, g)
                _conv(s, f"{p}.6", c, hidden, 1, g), _bn(s, f"{p}.7", c, g)
            inp, idx = c, idx + 1
    return s


def dli14_mobilenetv2() -> dict[str, torch.Tensor]:
    """d-li14's ImageNet ``mobilenetv2_1.0`` checkpoint: ``features``, the last 1x1 conv as ``conv``, ``classifier``."""
    g = torch.Generator().manual_seed(3)
    s = dli14_features("features.", g)
    _conv(s, "conv.0", 1280, 320, 1, g), _bn(s, "conv.1", 1280, g)
    s["classifier.weight"], s["classifier.bias"] = torch.randn(1000, 1280, generator=g), torch.randn(1000, generator=g)
    return s


def ladd_deeplabv3(num_classes: int = C) -> dict[str, torch.Tensor]:
    """LADD's model: torchvision's DeepLabV3 with DeepLabHead(1280) on d-li14's features (``backbone.<i>``; LADD
    renames the last 1x1 conv ``features.18``)."""
    g = torch.Generator().manual_seed(4)
    s = dli14_features("backbone.", g)
    _conv(s, "backbone.18.0", 1280, 320, 1, g), _bn(s, "backbone.18.1", 1280, g)
    a = "classifier.0"
    _conv(s, f"{a}.convs.0.0", 256, 1280, 1, g), _bn(s, f"{a}.convs.0.1", 256, g)
    for i in (1, 2, 3):  # ASPPConv per rate (12, 24, 36)
        _conv(s, f"{a}.convs.{i}.0", 256, 1280, 3, g), _bn(s, f"{a}.convs.{i}.1", 256, g)
    _conv(s, f"{a}.convs.4.1", 256, 1280, 1, g), _bn(s, f"{a}.convs.4.2", 256, g)  # ASPPPooling: pool, conv, BN, ReLU
    _conv(s, f"{a}.project.0", 256, 5 * 256, 1, g), _bn(s, f"{a}.project.1", 256, g)
    _conv(s, "classifier.1", 256, 256, 3, g), _bn(s, "classifier.2", 256, g)
    s["classifier.4.weight"] = torch.randn(num_classes, 256, 1, 1, generator=g)
    s["classifier.4.bias"] = torch.randn(num_classes, generator=g)
    return s


def _deeplab(params: dict, num_classes: int = C, name: str = "deeplabv3_mobilenetv2"):
    torch.manual_seed(0)
    return build_model(name, params, num_classes=num_classes, in_channels=3, image_size=64)


LADD_SPOTS = {
    "backbone.0.0.weight": "backbone.features.0.0.weight",
    "backbone.1.conv.0.weight": "backbone.features.1.block.0.0.weight",  # expansion 1: the depthwise conv
    "backbone.1.conv.3.weight": "backbone.features.1.block.1.weight",
    "backbone.1.conv.4.running_mean": "backbone.features.1.block.2.running_mean",
    "backbone.2.conv.0.weight": "backbone.features.2.block.0.0.weight",  # expansion 6: the 1x1 expansion
    "backbone.2.conv.4.weight": "backbone.features.2.block.1.1.weight",
    "backbone.17.conv.6.weight": "backbone.features.17.block.2.weight",
    "backbone.17.conv.7.bias": "backbone.features.17.block.3.bias",
    "backbone.18.0.weight": "backbone.features.18.0.weight",
    "classifier.0.convs.0.0.weight": "head.aspp.branches.0.0.weight",
    "classifier.0.convs.3.1.running_var": "head.aspp.branches.3.1.running_var",
    "classifier.0.convs.4.1.weight": "head.aspp.branches.4.conv.0.weight",
    "classifier.0.convs.4.2.bias": "head.aspp.branches.4.conv.1.bias",
    "classifier.0.project.0.weight": "head.aspp.project.0.weight",
    "classifier.1.weight": "head.conv.0.weight",
    "classifier.2.weight": "head.conv.1.weight",
    "classifier.4.bias": "head.classifier.bias",
}


def test_a_ladd_deeplabv3_checkpoint_loads_every_key_in_its_place(tmp_path) -> None:
    state = ladd_deeplabv3()
    path = tmp_path / "ladd.ckpt"
    torch.save({"model_state": state}, path)  # LADD saves {"model_state": ...}
    model = _deeplab({"output_stride": 32})
    assert model.head_style == "torchvision"
    assert sum(p.numel() for p in model.parameters()) == _params(state) == 12_652_563  # (the docstring's number)
    loaded = load_checkpoint(model, path, "ladd")
    own = model.state_dict()
    assert set(loaded) == set(own)
    for ref, ours in LADD_SPOTS.items():
        assert torch.equal(own[ours], state[ref]), (ref, ours)


@pytest.mark.parametrize("source", ["torchvision", "dli14"])
def test_an_imagenet_mobilenetv2_loads_into_the_classifier_and_every_deeplab_backbone(source, tmp_path) -> None:
    """torchvision's and d-li14's ImageNet MobileNetV2 (3,504,872 parameters, torchvision's published count, for
    both) load into ``mobilenetv2`` whole, and into each DeepLab's backbone with ``exclude = ["head.*"]``: the final
    1x1 conv where the backbone ends before it (OS 8/16) and the Linear classifier are left out automatically."""
    state, layout = (tv_mobilenet_v2(), "torchvision") if source == "torchvision" else (dli14_mobilenetv2(), "ladd")
    assert _params(state) == 3_504_872
    path = tmp_path / f"{source}.pth"
    torch.save(state, path)
    classifier = build_model("mobilenetv2", {"cifar_stem": False}, num_classes=1000, in_channels=3, image_size=224)
    assert set(load_checkpoint(classifier, path, layout)) == set(classifier.state_dict())
    first = "features.1.conv.3.weight" if source == "dli14" else "features.1.conv.1.weight"  # the 1x1 projection
    for name, params in [("deeplabv3_mobilenetv2", {"output_stride": 32}), ("deeplabv3_mobilenetv2", {"output_stride": 16}),
                         ("deeplabv3_mobilenetv2", {"output_stride": 8}), ("deeplabv3plus_mobilenetv2", {})]:
        model = _deeplab(params, name=name)
        loaded = load_checkpoint(model, path, layout, exclude=["head.*"])
        own = model.state_dict()
        assert set(loaded) == {k for k in own if k.startswith("backbone.")}, (name, params)
        assert torch.equal(own["backbone.features.1.block.1.weight"], state[first])
        assert ("backbone.features.18.0.weight" in own) == (params.get("output_stride") == 32)


def test_torchvisions_deeplabv3_mobilenet_v3_is_refused_as_another_model(tmp_path) -> None:
    """torchvision's ``deeplabv3_mobilenet_v3_large`` keys (``IntermediateLayerGetter`` over MobileNetV3's
    ``features``: ``backbone.<i>.block.*``; ``classifier.0.convs.*``; ``aux_classifier.*``)."""
    state = {"backbone.0.0.weight": torch.zeros(16, 3, 3, 3), "backbone.1.block.0.0.weight": torch.zeros(16, 1, 3, 3),
             "classifier.0.convs.0.0.weight": torch.zeros(256, 960, 1, 1), "aux_classifier.0.weight": torch.zeros(10, 40, 3, 3)}
    path = tmp_path / "deeplabv3_mobilenet_v3_large.pth"
    torch.save(state, path)
    for layout in ("torchvision", "ladd"):
        with pytest.raises(ValueError, match=re.escape(f"{path}: this is a torchvision DeepLabV3 segmentation checkpoint")):
            load_checkpoint(_deeplab({"output_stride": 32}), path, layout)


def test_a_checkpoint_of_another_family_is_named(tmp_path) -> None:
    path = tmp_path / "r.pth"
    torch.save({"layer1.0.conv1.weight": torch.zeros(1)}, path)
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a FedDrive BiSeNetV2 state dict")):
        load_checkpoint(_bisenet_model("feddrive"), path, "feddrive")
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a LADD DeepLabV3-MobileNetV2 or d-li14")):
        load_checkpoint(_deeplab({"output_stride": 32}), path, "ladd")
    assert read_checkpoint(path).keys() == {"layer1.0.conv1.weight"}


def _reference_forward(m, x: torch.Tensor, style: str) -> list[torch.Tensor]:
    """BiSeNetV2's forward in the reference's op order (FedDrive's / CoinCheung's ``BGALayer.forward``,
    ``SegmentHead.forward``, ``BiSeNetV2.forward``), on FedSight's layers: BGA upsamples by ``scale_factor=4``
    (FedDrive: bilinear, ``align_corners=True``; CoinCheung: nearest); FedDrive's heads end in ``PixelShuffle(up)``,
    CoinCheung's main head in a bilinear 8x upsampling and its auxiliary heads in nearest 2x, ConvBNReLU, 1x1 and a
    bilinear ``up/2`` upsampling. Returns ``[main, aux2, aux3, aux4, aux5_4]``."""
    import torch.nn.functional as F

    up4 = (lambda t: F.interpolate(t, scale_factor=4, mode="bilinear", align_corners=True)) if style == "feddrive" \
        else (lambda t: F.interpolate(t, scale_factor=4))
    feat_d = m.backbone.detail(x)
    feat2, feat3, feat4, feat5_4, feat_s = m.backbone.semantic(x)
    b = m.backbone.bga
    left = b.left1(feat_d) * torch.sigmoid(up4(b.right1(feat_s)))
    right = up4(b.left2(feat_d) * torch.sigmoid(b.right2(feat_s)))
    feat_head = b.conv(left + right)

    def head(h, f: torch.Tensor, up: int, aux: bool) -> torch.Tensor:
        y = h.conv(f)  # (dropout 0)
        if style == "feddrive":
            return F.pixel_shuffle(h.classifier(y), up)
        if aux:
            y, up = h.refine(F.interpolate(y, scale_factor=2)), up // 2
        return F.interpolate(h.classifier(y), scale_factor=up, mode="bilinear", align_corners=False)

    return [head(m.head.main, feat_head, 8, False)] + [head(h, f, up, True) for h, f, (_, _, up) in
                                                        zip(m.head.aux, (feat2, feat3, feat4, feat5_4), AUX)]


@pytest.mark.parametrize("style", ["feddrive", "bisenet"])
def test_the_forward_follows_the_references_op_order(style) -> None:
    torch.manual_seed(0)
    model = build_model("bisenetv2", {"head_style": style, "width": 0.25, "head_channels": 16, "aux_channels": 8,
                                      "dropout": 0.0}, num_classes=3, in_channels=3, image_size=64)
    for m in model.modules():  # (non-trivial BatchNorm statistics and affine parameters)
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5), m.running_var.uniform_(0.5, 2), m.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 64, 96)
    model.eval()
    with torch.no_grad():
        ref = _reference_forward(model, x, style)
        assert all(r.shape == (2, 3, 64, 96) for r in ref)
        torch.testing.assert_close(model(x), ref[0], rtol=1e-5, atol=1e-5)
        model.train()  # the auxiliary heads (BatchNorm on batch statistics in both computations)
        ours = model(x)
        ref = _reference_forward(model, x, style)
    for a, r in zip(ours, ref):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style", ["feddrive", "bisenet"])
def test_the_reference_head_styles_train_vectorised_as_sequentially(style, monkeypatch) -> None:
    """The vectorised conformance test (tests/test_vectorized.py) on the two reference head styles (pixel shuffle;
    nearest upsampling and the refine convs), at a small width."""
    import test_conformance
    import test_vectorized

    case = ("bisenetv2", {"head_style": style, "width": 0.25, "head_channels": 16, "aux_channels": 8})
    monkeypatch.setattr(test_vectorized, "_conformance_cases", lambda: (test_conformance.FAMILIES, [case]))
    test_vectorized.test_every_builtin_model_trains_vectorised_as_sequentially(0)
