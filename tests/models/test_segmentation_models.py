"""Tests for the segmentation models: BiSeNetV2 and DeepLabV3 / DeepLabV3+ on MobileNetV2.

Parameter counts are checked against hand arithmetic written from the architecture descriptions
(papers and the reference implementations) and against the published totals. The last section checks
that adding the ``dilation`` argument to MobileNetV2's blocks left the classification model unchanged.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedsight.capabilities import resolve

# importing a model module registers its models (once: the registry refuses a name registered twice)
from fedsight.models import bisenetv2 as bisenet_module
from fedsight.models import build_model
from fedsight.models import deeplab as deeplab_module
from fedsight.models.base import detect_capabilities, load_weights, save_weights
from fedsight.registry import MODELS

BISENET, DEEPLAB, DEEPLAB_PLUS = "bisenetv2", "deeplabv3_mobilenetv2", "deeplabv3plus_mobilenetv2"
NUM_CLASSES = 5
#: small variants (width 0.25) used wherever the full width is not the point
TINY = {
    BISENET: {"width": 0.25, "head_channels": 32, "aux_channels": 16},
    DEEPLAB: {"width_mult": 0.25, "aspp_channels": 32},
    DEEPLAB_PLUS: {"width_mult": 0.25, "aspp_channels": 32, "low_level_channels": 8, "decoder_channels": 32},
}
#: tiny variants covering every output stride / head style / norm
VARIANTS = [
    (BISENET, {}),
    (BISENET, {"norm": "group"}),
    (BISENET, {"aux_heads": False}),
    (DEEPLAB, {"output_stride": 8}),
    (DEEPLAB, {"output_stride": 16, "norm": "group"}),
    (DEEPLAB, {"output_stride": 32}),  # torchvision-style head on the 1280-channel map
    (DEEPLAB_PLUS, {"output_stride": 16}),
]
VARIANT_IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in p.items()) or 'default'}" for n, p in VARIANTS]


def make(name: str, params: dict | None = None, *, tiny: bool = True, seed: int = 0, num_classes: int = NUM_CLASSES):
    torch.manual_seed(seed)
    full = {**(TINY[name] if tiny else {}), **(params or {})}
    return build_model(name, full, num_outputs=num_classes, in_channels=3)


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def as_tuple(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def test_registered_as_segmentation_models():
    for name in (BISENET, DEEPLAB, DEEPLAB_PLUS):
        assert MODELS.get(name).task_family == "segmentation"
    assert bisenet_module.BiSeNetV2.split_head is False and deeplab_module.DeepLabV3.split_head is False


# ---------------------------------------------------------------------------------------------------
# Output contract


@pytest.mark.parametrize(("name", "params"), VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize(("h", "w"), [(64, 64), (65, 97), (33, 17)])
def test_logits_at_input_resolution_in_train_and_eval(name, params, h, w):
    model = make(name, params)
    x = torch.randn(2, 3, h, w)
    model.train()
    outs = as_tuple(model(x))
    n_aux = 4 if name == BISENET and params.get("aux_heads", True) else 0
    assert len(outs) == 1 + n_aux  # BiSeNetV2: (main, aux_stem, aux_s3, aux_s4, aux_s5) in training
    for o in outs:
        assert o.shape == (2, NUM_CLASSES, h, w) and torch.isfinite(o).all()
    model.eval()
    with torch.no_grad():
        out = model(x)
    assert isinstance(out, torch.Tensor) and out.shape == (2, NUM_CLASSES, h, w)


def test_bisenetv2_aux_outputs_are_distinct_heads_and_eval_returns_the_main_logits():
    model = make(BISENET)
    x = torch.randn(2, 3, 64, 96)
    model.eval()  # no dropout, running statistics: train- and eval-mode main logits agree
    with torch.no_grad():
        main = model(x)
        model.train()
        for m in model.modules():  # keep train-mode structure but freeze the statistics and dropout
            if isinstance(m, (nn.BatchNorm2d, nn.Dropout)):
                m.eval()
        outs = model(x)
    assert len(outs) == 5
    torch.testing.assert_close(outs[0], main, rtol=0, atol=0)
    for i in range(1, 5):
        assert not torch.allclose(outs[i], outs[0])


@pytest.mark.parametrize("name", [DEEPLAB, DEEPLAB_PLUS])
@pytest.mark.parametrize("output_stride", [8, 16, 32])
def test_deeplab_output_stride(name, output_stride):
    if name == DEEPLAB_PLUS and output_stride == 32:
        with pytest.raises(ValueError):
            make(name, {"output_stride": 32})
        return
    model = make(name, {"output_stride": output_stride}).eval()
    h, w = 65, 97
    x = torch.randn(1, 3, h, w)
    with torch.no_grad():
        feats = model.features(x)
        maps = model.feature_maps(x)
    # every stride-2 layer maps n to ceil(n/2), so the head sees ceil(H/OS) x ceil(W/OS)
    assert feats.shape[-2:] == (math.ceil(h / output_stride), math.ceil(w / output_stride))
    strides = [2, 4, 8, min(16, output_stride), output_stride]
    assert [tuple(m.shape[-2:]) for m in maps] == [(math.ceil(h / s), math.ceil(w / s)) for s in strides]
    assert torch.equal(maps[-1], feats)
    assert model.backbone.output_stride == output_stride


# depthwise-conv dilation of each MobileNetV2 block (features[1..17]) and its stride: stages
# (16 ch: 1 block, 24: 2, 32: 3, 64: 4, 96: 3, 160: 3, 320: 1); the first block of a stage whose stride is
# replaced keeps the previous rate, the following blocks use the rate times the skipped stride
DILATIONS = {
    32: [1] * 17,
    16: [1] * 13 + [1, 2, 2] + [2],
    8: [1] * 6 + [1, 2, 2, 2] + [2, 2, 2] + [2, 4, 4] + [4],
}
STRIDES = {
    32: [1] + [2, 1] + [2, 1, 1] + [2, 1, 1, 1] + [1, 1, 1] + [2, 1, 1] + [1],
    16: [1] + [2, 1] + [2, 1, 1] + [2, 1, 1, 1] + [1, 1, 1] + [1, 1, 1] + [1],
    8: [1] + [2, 1] + [2, 1, 1] + [1, 1, 1, 1] + [1, 1, 1] + [1, 1, 1] + [1],
}


@pytest.mark.parametrize("output_stride", [8, 16, 32])
def test_deeplab_dilates_instead_of_striding_beyond_the_output_stride(output_stride):
    model = make(DEEPLAB, {"output_stride": output_stride})
    dw = [next(m for m in blk.modules() if isinstance(m, nn.Conv2d) and m.groups > 1) for blk in model.backbone.features[1:18]]
    assert [c.dilation[0] for c in dw] == DILATIONS[output_stride]
    assert [c.stride[0] for c in dw] == STRIDES[output_stride]
    assert all(c.padding[0] == c.dilation[0] for c in dw)  # 'same' padding
    convs = [m for m in model.head.aspp.branches if isinstance(m, nn.Sequential)]
    assert [c[0].dilation[0] for c in convs] == [1, *deeplab_module.default_rates(output_stride)]


def test_deeplab_default_rates_and_head_style():
    assert deeplab_module.default_rates(16) == (6, 12, 18)
    assert deeplab_module.default_rates(8) == (12, 24, 36)
    assert deeplab_module.default_rates(32) == (12, 24, 36)  # torchvision's DeepLabHead (LADD)
    assert make(DEEPLAB, {"output_stride": 32}).feature_dim == 1280  # whole MobileNetV2 feature map
    assert make(DEEPLAB, {"output_stride": 16}).feature_dim == 80  # 320 * 0.25: second-to-last map
    assert make(DEEPLAB, {"output_stride": 16, "head_style": "torchvision"}).feature_dim == 1280
    with pytest.raises(ValueError):
        make(DEEPLAB, {"output_stride": 4})


# ---------------------------------------------------------------------------------------------------
# Parameter counts at full width


def ge_s1(c: int) -> int:
    """Stride-1 gather-and-expansion layer (expansion 6), convs without bias, BN = 2 params/channel:
    conv1 3x3 c->c 9c^2 + 2c; depthwise 3x3 c->6c 54c + 12c; 1x1 6c->c 6c^2 + 2c  =  15c^2 + 70c."""
    return 15 * c * c + 70 * c


def ge_s2(ci: int, co: int) -> int:
    """Stride-2 GE layer: conv1 9ci^2 + 2ci; dw 3x3/2 ci->6ci 54ci + 12ci; dw 3x3 6ci 54ci + 12ci;
    1x1 6ci->co 6ci*co + 2co; shortcut dw 3x3/2 9ci + 2ci and 1x1 ci*co + 2co."""
    return 9 * ci * ci + 7 * ci * co + 145 * ci + 4 * co


def conv_bn(ci: int, co: int, k: int) -> int:
    return ci * co * k * k + 2 * co


def test_bisenetv2_parameter_count_by_hand_and_published():
    # e.g. GE/2 16 -> 32 (stage 3's first layer): conv1 16*16*9 + 32 = 2,336; depthwise 16->96: 96*9 + 192
    # = 1,056; depthwise 96: 1,056; 1x1 96*32 + 64 = 3,136; shortcut 16*9 + 32 = 176 and 16*32 + 64 = 576:
    # 8,336 = ge_s2(16, 32)
    assert ge_s2(16, 32) == 2336 + 1056 + 1056 + 3136 + 176 + 576 == 8336
    detail = conv_bn(3, 64, 3) + conv_bn(64, 64, 3) * 4 + conv_bn(64, 128, 3) + conv_bn(128, 128, 3) * 2
    stem = conv_bn(3, 16, 3) + conv_bn(16, 8, 1) + conv_bn(8, 16, 3) + conv_bn(32, 16, 3)
    ce = 2 * 128 + conv_bn(128, 128, 1) + conv_bn(128, 128, 3)  # BN on the pooled vector, 1x1, 3x3
    semantic = (stem + ge_s2(16, 32) + ge_s1(32) + ge_s2(32, 64) + ge_s1(64) + ge_s2(64, 128) + 3 * ge_s1(128) + ce)
    # BGA: two (dw 3x3 + BN + 1x1) paths, two (3x3 + BN) paths, the 3x3 conv + BN
    bga = 2 * (128 * 9 + 256 + 128 * 128) + 3 * conv_bn(128, 128, 3)
    head = conv_bn(128, 1024, 3) + 1024 * 19 + 19  # 3x3 conv to 1024 + BN, 1x1 classifier with bias
    aux = sum(conv_bn(c, 128, 3) + 128 * 19 + 19 for c in (16, 32, 64, 128))
    assert (detail, semantic, bga, head, aux) == (519_232, 1_159_504, 478_720, 1_201_171, 287_308)

    model = make(BISENET, tiny=False, num_classes=19)
    b = model.backbone
    assert [n_params(m) for m in (b.detail, b.semantic, b.bga, model.head.main)] == [detail, semantic, bga, head]
    assert n_params(model.head.aux) == aux and n_params(model) == 3_645_935
    inference = make(BISENET, {"aux_heads": False}, tiny=False, num_classes=19)
    assert n_params(inference) == detail + semantic + bga + head == 3_358_627
    # published: ~3.4M (the CoinCheung/BiSeNet model without its training-only auxiliary heads; its code,
    # built with 19 classes, has exactly these 3,358,627). Tolerance: half a unit of the published last
    # digit (0.05M), the precision the figure is given to.
    assert abs(n_params(inference) - 3.4e6) <= 0.05e6


def test_bisenetv2_width_rounds_channels_to_multiples_of_8():
    model = make(BISENET, {"width": 0.25})
    assert model.backbone.semantic.channels == (8, 8, 16, 32)  # 16, 32, 64, 128 x 0.25, at least 8
    assert model.feature_dim == 32
    assert bisenet_module.scaled(64, 0.5) == 32 and bisenet_module.scaled(16, 0.75) == 16
    assert all(c % 8 == 0 for m in model.modules() if isinstance(m, nn.Conv2d) and m.groups > 1 for c in (m.in_channels, m.out_channels))


# MobileNetV2 features up to the 320-channel block (second-to-last map): torchvision's mobilenet_v2
# (3,504,872 with 1000 classes) minus its classifier (1280*1000 + 1000) and last 1x1 conv (320*1280 + 2*1280)
MNV2_320 = 3_504_872 - 1_281_000 - 412_160  # 1,811,712
MNV2_1280 = 3_504_872 - 1_281_000  # 2,223,872


def aspp(cin: int, c: int, rates: int) -> int:
    # 1x1 branch, one 3x3 branch per rate, image pooling 1x1, projection of the (rates + 2) branches; BN each
    return conv_bn(cin, c, 1) + rates * conv_bn(cin, c, 3) + conv_bn(cin, c, 1) + conv_bn((rates + 2) * c, c, 1)


def test_deeplabv3_parameter_counts_by_hand_and_published():
    # MobileNetV2 paper, Table 7 (DeepLabV3 on the second-to-last feature map, 21 PASCAL VOC classes):
    # with ASPP 4.52M, without (1x1 + image pooling only) 2.11M. ASPP on 320 channels with 256 outputs:
    # 1x1 320*256 + 512 = 82,432; three 3x3 320*256*9 + 512 = 737,792 each; pooling 82,432;
    # projection 1280*256 + 512 = 328,192 -> 2,706,432; classifier 256*21 + 21 = 5,397.
    assert aspp(320, 256, 3) == 82_432 + 3 * 737_792 + 82_432 + 328_192 == 2_706_432
    with_aspp = MNV2_320 + aspp(320, 256, 3) + 256 * 21 + 21
    without = MNV2_320 + aspp(320, 256, 0) + 256 * 21 + 21
    for os_ in (8, 16):  # dilation changes no parameter
        assert n_params(make(DEEPLAB, {"output_stride": os_}, tiny=False, num_classes=21)) == with_aspp == 4_523_541
    assert n_params(make(DEEPLAB, {"atrous_rates": []}, tiny=False, num_classes=21)) == without == 2_113_557
    # published to two decimals of a million: tolerance half a unit of the last digit (0.005M)
    assert abs(with_aspp - 4.52e6) <= 0.005e6 and abs(without - 2.11e6) <= 0.005e6


def test_deeplabv3_torchvision_head_and_v3plus_counts_by_hand():
    # OS 32, LADD / torchvision DeepLabHead(1280, 19): ASPP on 1280 channels (rates 12, 24, 36), then
    # 3x3 conv 256 + BN and the classifier: 9,833,472 + 590,336 + 4,883 = 10,428,691
    head = aspp(1280, 256, 3) + conv_bn(256, 256, 3) + 256 * 19 + 19
    assert head == 10_428_691
    model = make(DEEPLAB, {"output_stride": 32}, tiny=False, num_classes=19)
    assert (n_params(model.backbone), n_params(model.head)) == (MNV2_1280, head)
    assert n_params(model) == 12_652_563
    # DeepLabV3+: 1x1 24 -> 48 + BN (1,248), decoder 3x3 (256 + 48) -> 256 and 3x3 256 -> 256 with BN
    plus = MNV2_320 + aspp(320, 256, 3) + conv_bn(24, 48, 1) + conv_bn(304, 256, 3) + conv_bn(256, 256, 3) + 256 * 21 + 21
    assert n_params(make(DEEPLAB_PLUS, tiny=False, num_classes=21)) == plus == 5_816_053


# ---------------------------------------------------------------------------------------------------
# Gradients, groups, capabilities, seeds, weights files


@pytest.mark.parametrize(("name", "params"), VARIANTS, ids=VARIANT_IDS)
def test_gradients_reach_every_parameter(name, params):
    # the GE layers' zero-initialised last norm (the reference's init) blocks the gradient of their residual
    # branch on the very first step, so check non-zero gradients with it off, and non-None with it on
    model = make(name, {**params, **({"zero_init_residual": False} if name == BISENET else {})})
    x, y = torch.randn(2, 3, 48, 40), torch.randint(0, NUM_CLASSES, (2, 48, 40))
    model.train()
    outs = as_tuple(model(x))
    sum(F.cross_entropy(o, y) for o in outs).backward()  # main + auxiliary (booster) losses
    # one structural exception, as in the reference: the context embedding's BatchNorm bias shifts every
    # sample's pooled vector by the same constant, which the next 1x1 conv maps to a per-channel constant
    # that the following train-mode BatchNorm subtracts again, so its gradient is exactly zero in training
    inert = {"backbone.semantic.ce.norm.bias"} if name == BISENET and params.get("norm", "batch") == "batch" else set()
    for k, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), k
        assert (p.grad.abs().sum() > 0) == (k not in inert), k
    if name == BISENET:
        model = make(name, params)
        outs = as_tuple(model(x))
        outs[0].pow(2).mean().backward()  # the main loss alone never reaches the auxiliary heads
        aux = {k for k, _ in model.named_parameters() if k.startswith("head.aux.")}
        assert bool(aux) == params.get("aux_heads", True)
        for k, p in model.named_parameters():
            assert (p.grad is None) == (k in aux), k


@pytest.mark.parametrize(("name", "params"), VARIANTS, ids=VARIANT_IDS)
def test_parameter_groups_blocks_and_capabilities(name, params):
    model = make(name, params)
    state = model.state_dict()
    groups = model.parameter_groups()
    backbone, head, norm = groups["backbone"], groups["head"], groups["norm"]
    assert sorted(backbone + head) == sorted(state) and not set(backbone) & set(head)
    params_ = {k for k, _ in model.named_parameters()}
    assert (set(backbone) | set(head)) & params_ == params_
    assert all(k.startswith("backbone.") for k in backbone) and all(k.startswith("head.") for k in head)
    # auxiliary heads and ASPP / decoder are head; the BiSeNetV2 branches and the BGA layer are backbone
    prefixes = {BISENET: ("backbone.detail.", "backbone.semantic.", "backbone.bga."), DEEPLAB: ("backbone.features.",),
                DEEPLAB_PLUS: ("backbone.features.",)}[name]
    assert all(k.startswith(prefixes) for k in backbone)
    if name == BISENET:
        assert any(k.startswith("head.aux.3.") for k in head) == params.get("aux_heads", True)
    else:
        assert any(k.startswith("head.aspp.") for k in head)
    # norm keys: exactly the state of the normalisation layers, found here by module type
    norm_type = nn.GroupNorm if params.get("norm") == "group" else nn.BatchNorm2d
    expected = [f"{mn}.{k}" for mn, m in model.named_modules() if isinstance(m, norm_type) for k in m.state_dict()]
    assert sorted(norm) == sorted(expected) and expected
    entry = MODELS.get(name)
    declared = resolve(entry.provides, entry.params(**{**TINY[name], **params}))
    assert declared == detect_capabilities(model)
    assert declared == ({"parameter_groups", "norm_layers"} | ({"norm_stats"} if norm_type is nn.BatchNorm2d else set()))
    # blocks: disjoint, cover the state, in forward order
    blocks = model.blocks()
    flat = [k for keys in blocks.values() for k in keys]
    assert sorted(flat) == sorted(state) and len(flat) == len(set(flat))
    if name == BISENET:
        assert list(blocks)[:9] == ["backbone.detail.S1", "backbone.detail.S2", "backbone.detail.S3", "backbone.semantic.stem",
                                    "backbone.semantic.S3", "backbone.semantic.S4", "backbone.semantic.S5",
                                    "backbone.semantic.ce", "backbone.bga"]
    else:
        assert list(blocks)[:8] == ["backbone.stem"] + [f"backbone.stage{i}" for i in range(1, 8)]
        assert list(blocks)[-1] == "head.classifier"


@pytest.mark.parametrize(("name", "params"), VARIANTS, ids=VARIANT_IDS)
def test_same_seed_same_weights_and_safetensors_round_trip(name, params, tmp_path):
    a, b, c = make(name, params, seed=0), make(name, params, seed=0), make(name, params, seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())
    a.train()
    with torch.no_grad():  # move the running statistics away from their initial values
        a(torch.randn(2, 3, 40, 40) * 2 + 1)
    save_weights(a, tmp_path / "w.safetensors")
    x = torch.randn(2, 3, 40, 48)
    a.eval(), c.eval()
    with torch.no_grad():
        assert not torch.allclose(a(x), c(x))
        load_weights(c, tmp_path / "w.safetensors")
        torch.testing.assert_close(c(x), a(x), rtol=0, atol=0)
    assert all(torch.equal(v, c.state_dict()[k]) for k, v in a.state_dict().items())


def test_bisenetv2_zero_init_residual_matches_the_reference_init():
    last = [m.last_norm.weight for m in make(BISENET).modules() if isinstance(m, bisenet_module.GatherExpand)]
    assert len(last) == 8 and all(torch.equal(w, torch.zeros_like(w)) for w in last)
    last = [m.last_norm.weight for m in make(BISENET, {"zero_init_residual": False}).modules()
            if isinstance(m, bisenet_module.GatherExpand)]
    assert all(torch.equal(w, torch.ones_like(w)) for w in last)


# ---------------------------------------------------------------------------------------------------
# Overfitting one label map


def disc_scene() -> tuple[torch.Tensor, torch.Tensor]:
    """A 64x64 scene of two colour regions (a disc on a background) with noise, and its mirror image:
    a batch of two, since BatchNorm on pooled [B, C, 1, 1] maps needs more than one sample in training."""
    g = torch.Generator().manual_seed(0)
    yy, xx = torch.meshgrid(torch.arange(64.0), torch.arange(64.0), indexing="ij")
    label = (((yy - 30) ** 2 + (xx - 26) ** 2) < 18**2).long()
    colours = torch.tensor([[0.9, 0.2, 0.1], [0.1, 0.3, 0.9]])
    image = colours[label].permute(2, 0, 1) + 0.05 * torch.randn(3, 64, 64, generator=g)
    return torch.stack([image, image.flip(-1)]), torch.stack([label, label.flip(-1)])


@pytest.mark.parametrize(
    ("name", "params", "steps"),
    [(BISENET, {"dropout": 0.0}, 30), (DEEPLAB, {"output_stride": 8, "dropout": 0.0}, 50)],
    ids=[BISENET, DEEPLAB],
)
def test_width_quarter_model_overfits_one_label_map(name, params, steps):
    model = make(name, params, num_classes=2)
    x, y = disc_scene()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    model.train()
    with torch.no_grad():
        before = (as_tuple(model(x))[0].argmax(1) == y).float().mean()
    for _ in range(steps):
        loss = sum(F.cross_entropy(o, y) for o in as_tuple(model(x)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    # pixel accuracy of the main logits with batch statistics (the running statistics of the pooled
    # branches have not settled after a few dozen steps on two nearly identical images)
    with torch.no_grad():
        acc = (as_tuple(model(x))[0].argmax(1) == y).float().mean()
    assert acc > 0.95 > before


# ---------------------------------------------------------------------------------------------------
# MobileNetV2 behaves as before its blocks got a ``dilation`` argument

#: computed with the unmodified fedsight/models/mobilenetv2.py (before ``dilation`` was added), built
#: after ``torch.manual_seed(0)``: (params, classes) -> (sha256[:16] of repr(model) and the state
#: keys/shapes/dtypes; value fingerprint of the state (``_fingerprint``); train-mode feature map of
#: ``torch.manual_seed(1); randn(2, 3, 64, 64)``: its sum, sum of squares and cosine projection)
MNV2_BEFORE = [
    ({}, 10, "a807dcf7fefb7592", (-107.320365, -34.017025, 51457.236289), (65086.50719, 81543.081091, 21.341958)),
    ({"cifar_stem": False, "width_mult": 0.5}, 1000, "6ef3bca00e14a06e", (-79.271528, -1.742146, 27697.210874),
     (4232.23238, 5127.297782, -19.611665)),
    ({"norm": "group", "width_mult": 0.35}, 7, "9b1e3ea45497f4d1", (-45.65778, 76.363111, 13437.833117),
     (63335.325884, 80596.691585, 111.542527)),
]


def _fingerprint(state: dict[str, torch.Tensor]) -> tuple[float, float, float]:
    """Two fixed projections of all state values, in state order, and their squared norm: any change in
    what is drawn, in which order, or into which entry moves them by O(1); the last bits of a platform's
    normal sampler do not (compared with a relative tolerance; an exact hash would not be portable)."""
    f = [0.0, 0.0, 0.0]
    for k, v in enumerate(state.values()):
        v = v.double().flatten()
        i = torch.arange(v.numel(), dtype=torch.float64)
        f[0] += float((v * torch.cos(i + k)).sum())
        f[1] += float((v * torch.sin(1.3 * i + k)).sum())
        f[2] += float((v * v).sum())
    return f[0], f[1], f[2]


@pytest.mark.parametrize(("params", "classes", "structure", "values", "features"), MNV2_BEFORE)
def test_mobilenetv2_unchanged_by_the_dilation_argument(params, classes, structure, values, features):
    torch.manual_seed(0)
    model = build_model("mobilenetv2", params, num_classes=classes, image_size=32)
    state = model.state_dict()
    digest = hashlib.sha256((repr(model) + "".join(f"{k}:{tuple(v.shape)}:{v.dtype};" for k, v in state.items())).encode())
    assert digest.hexdigest()[:16] == structure  # same modules, hyperparameters (padding, dilation), names
    assert _fingerprint(state) == pytest.approx(values, rel=1e-6, abs=1e-4)  # same draws into the same entries
    assert not any(m.dilation != (1, 1) for m in model.modules() if isinstance(m, nn.Conv2d))
    model.train()  # batch statistics keep the activations O(1), so the map is sensitive to every block
    torch.manual_seed(1)
    with torch.no_grad():
        f = model.backbone.feature_map(torch.randn(2, 3, 64, 64)).double()
    proj = (f.flatten() * torch.cos(torch.arange(f.numel(), dtype=torch.float64))).sum()
    assert (float(f.sum()), float((f * f).sum())) == pytest.approx(features[:2], rel=1e-5)
    assert float(proj) == pytest.approx(features[2], abs=0.05)  # ~1e5 float32 terms of O(1)
