"""Image-SR checkpoints load (``fedsight.weights_sr``): EDSR as EDSR-PyTorch and BasicSR publish it into ``edsr``, the
RDSN authors' network (ETC-RDSN) into ``rdsn_etc``.

The state dicts are written here from the published sources' architecture definitions (key names and shapes:
EDSR-PyTorch ``src/model/edsr.py`` + ``common.py``, BasicSR ``basicsr/archs/edsr_arch.py`` + ``arch_util.py``,
ETC-RDSN ``src/model/rdn.py`` + ``unet.py`` + ``unet_parts.py``), independently of FedSight's modules, and each
family's forward pass is re-written here as those sources compute it (functional convolutions over the state dict,
in the [0, 255] range they train at). A loaded FedSight model must give the same output to float64 rounding: every
value is in its place and the forward is the published one. Paper-size models are compared by key names, shapes
and parameter counts on the meta device (EDSR's counts are EDSR-PyTorch's published ones)."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from fedsight.models import build_model
from fedsight.weights import convert, load_checkpoint

#: the DIV2K mean as the published code holds it: ``torch.Tensor(rgb_mean)``, float32
MEAN = torch.tensor([0.4488, 0.4371, 0.4040]).double().view(1, 3, 1, 1)
#: EDSR-PyTorch's README (and its paper's Table): trainable parameters of EDSR-baseline x2 and EDSR x2
PUBLISHED_EDSR = {(64, 16, 2): 1_369_859, (256, 32, 2): 40_729_603}


def _conv(shapes: dict, name: str, cin: int, cout: int, k: int = 3) -> None:
    shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (cout, cin, k, k), (cout,)


def _upsampler(shapes: dict, prefix: str, cin: int, mid: int, scale: int) -> None:
    """EDSR-PyTorch's ``Upsampler`` / BasicSR's ``Upsample`` / ETC-RDSN's ``UPNet``: x2/x3 one conv (index 0) +
    PixelShuffle, x4 two conv (0, 2) + PixelShuffle(2) stages."""
    if scale == 3:
        _conv(shapes, f"{prefix}.0", cin, 9 * mid)
    else:
        for j in range(int(math.log2(scale))):
            _conv(shapes, f"{prefix}.{2 * j}", cin if j == 0 else mid, 4 * mid)


def edsr_pytorch_shapes(n_feats: int, n_resblocks: int, scale: int) -> dict[str, tuple]:
    s: dict[str, tuple] = {}
    _conv(s, "sub_mean", 3, 3, 1)
    _conv(s, "add_mean", 3, 3, 1)
    _conv(s, "head.0", 3, n_feats)
    for i in range(n_resblocks):  # ResBlock.body: conv, ReLU, conv
        _conv(s, f"body.{i}.body.0", n_feats, n_feats)
        _conv(s, f"body.{i}.body.2", n_feats, n_feats)
    _conv(s, f"body.{n_resblocks}", n_feats, n_feats)
    _upsampler(s, "tail.0", n_feats, n_feats, scale)
    _conv(s, "tail.1", n_feats, 3)
    return s


def basicsr_edsr_shapes(num_feat: int, num_block: int, upscale: int) -> dict[str, tuple]:
    s: dict[str, tuple] = {}
    _conv(s, "conv_first", 3, num_feat)
    for i in range(num_block):
        _conv(s, f"body.{i}.conv1", num_feat, num_feat)
        _conv(s, f"body.{i}.conv2", num_feat, num_feat)
    _conv(s, "conv_after_body", num_feat, num_feat)
    _upsampler(s, "upsample", num_feat, num_feat, upscale)
    _conv(s, "conv_last", num_feat, 3)
    return s


def etc_rdsn_shapes(G0: int, D: int, C: int, G: int, scale: int, unet: int = 64) -> dict[str, tuple]:
    """ETC-RDSN's ``RDN`` (``UNet(n_colors, G0, subpixel=True)``); ``unet`` scales the U-Net's fixed widths
    (64 in the authors' code: 64/128/256/512/512 down, 640->256, 320->128, 160->64, 80->64 up) by unet/64."""
    w = lambda c: c * unet // 64  # noqa: E731
    s: dict[str, tuple] = {}
    _conv(s, "sub_mean", 3, 3, 1)
    _conv(s, "add_mean", 3, 3, 1)
    _conv(s, "SFENet.0", 3, G0)
    _conv(s, "SFENet.1", G0, G0)
    for i in range(D):
        for c in range(C):
            _conv(s, f"RDBs.{i}.convs.{c}.conv.0", G0 + c * G, G)
        _conv(s, f"RDBs.{i}.LFF", G0 + C * G, G0, 1)
    _conv(s, "GFF.0", D * G0, G0, 1)
    _conv(s, "GFF.1", G0, G0)
    for name, cin, cout in [("inc", 3, w(64)), ("down1", w(64), w(128)), ("down2", w(128), w(256)),
                            ("down3", w(256), w(512)), ("down4", w(512), w(512)), ("up1", w(640), w(256)),
                            ("up2", w(320), w(128)), ("up3", w(160), w(64)), ("up4", w(80), w(64))]:
        p = {"inc": "unet.inc", "down": f"unet.{name}.maxpool_conv.1", "up": f"unet.{name}.conv"}[re.sub(r"\d", "", name)]
        _conv(s, f"{p}.double_conv.0", cin, cout)
        _conv(s, f"{p}.double_conv.2", cout, cout)
    _conv(s, "unet.outc.conv", w(64), G0, 1)
    _upsampler(s, "UPNet1", G0, G, scale)
    _upsampler(s, "UPNet2", 3, G, scale)
    _conv(s, "final_conv", G, 3)
    return s


def materialise(shapes: dict[str, tuple], seed: int = 0, rgb_range: float = 255.0) -> dict[str, torch.Tensor]:
    """Random float64 weights for ``shapes`` (a conv's std 1 / sqrt(fan-in), so that activations keep their scale
    through a paper-size network; biases std 0.1); the mean-shift convs as ``MeanShift(rgb_range)`` sets them."""
    g = torch.Generator().manual_seed(seed)
    std = lambda shape: 1 / math.sqrt(math.prod(shape[1:])) if len(shape) == 4 else 0.1  # noqa: E731
    state = {k: std(shape) * torch.randn(shape, generator=g, dtype=torch.float64) for k, shape in shapes.items()}
    if "sub_mean.weight" in state:
        for name, sign in (("sub_mean", -1), ("add_mean", 1)):
            state[f"{name}.weight"] = torch.eye(3, dtype=torch.float64).view(3, 3, 1, 1)
            state[f"{name}.bias"] = sign * rgb_range * MEAN.view(3).clone()
    return state


def _trainable(shapes: dict[str, tuple]) -> int:  # the mean-shift convs are frozen (requires_grad = False)
    return sum(math.prod(v) for k, v in shapes.items() if not k.startswith(("sub_mean", "add_mean")))


# -- the published forwards, re-written over the state dicts --------------------------------------------------------


def _c(s, t, name, pad=1):
    return F.conv2d(t, s[f"{name}.weight"], s[f"{name}.bias"], padding=pad)


def _up(s, prefix, t, scale):
    if scale == 3:
        return F.pixel_shuffle(_c(s, t, f"{prefix}.0"), 3)
    for j in range(int(math.log2(scale))):
        t = F.pixel_shuffle(_c(s, t, f"{prefix}.{2 * j}"), 2)
    return t


def edsr_pytorch_forward(s, x, B, scale, res_scale):
    """EDSR-PyTorch ``EDSR.forward`` on an image in [0, 1] given to it in [0, 255]; output back in [0, 1]."""
    h = _c(s, _c(s, x * 255, "sub_mean", 0), "head.0")
    res = h
    for i in range(B):
        res = _c(s, F.relu(_c(s, res, f"body.{i}.body.0")), f"body.{i}.body.2") * res_scale + res
    res = _c(s, res, f"body.{B}") + h
    return _c(s, _c(s, _up(s, "tail.0", res, scale), "tail.1"), "add_mean", 0) / 255


def basicsr_edsr_forward(s, x, B, scale, res_scale):
    """BasicSR ``EDSR.forward`` (img_range 255)."""
    h = _c(s, (x - MEAN.to(x.dtype)) * 255, "conv_first")
    res = h
    for i in range(B):
        res = res + _c(s, F.relu(_c(s, res, f"body.{i}.conv1")), f"body.{i}.conv2") * res_scale
    res = _c(s, res, "conv_after_body") + h
    return _c(s, _up(s, "upsample", res, scale), "conv_last") / 255 + MEAN.to(x.dtype)


def _double(s, t, p):
    return F.relu(_c(s, F.relu(_c(s, t, f"{p}.double_conv.0")), f"{p}.double_conv.2"))


def _unet_up(s, a, skip, name):  # unet_parts.Up with subpixel: PixelShuffle, pad to the skip, cat [skip, a]
    a = F.pixel_shuffle(a, 2)
    dy, dx = skip.size(2) - a.size(2), skip.size(3) - a.size(3)
    a = F.pad(a, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
    return _double(s, torch.cat([skip, a], dim=1), f"unet.{name}.conv")


def etc_rdsn_forward(s, x, D, C, scale):
    """ETC-RDSN ``RDN.forward`` on an image in [0, 1] given to it in [0, 255]; output back in [0, 1]."""
    x = _c(s, x * 255, "sub_mean", 0)
    x1 = _double(s, x, "unet.inc")
    x2 = _double(s, F.max_pool2d(x1, 2), "unet.down1.maxpool_conv.1")
    x3 = _double(s, F.max_pool2d(x2, 2), "unet.down2.maxpool_conv.1")
    x4 = _double(s, F.max_pool2d(x3, 2), "unet.down3.maxpool_conv.1")
    x5 = _double(s, F.max_pool2d(x4, 2), "unet.down4.maxpool_conv.1")
    u = _unet_up(s, _unet_up(s, _unet_up(s, _unet_up(s, x5, x4, "up1"), x3, "up2"), x2, "up3"), x1, "up4")
    weight = _c(s, u, "unet.outc.conv", 0)
    skip = _up(s, "UPNet2", x, scale)
    h = _c(s, _c(s, x, "SFENet.0"), "SFENet.1")
    outs = []
    for i in range(D):
        t = h
        for c in range(C):
            t = torch.cat([t, F.relu(_c(s, t, f"RDBs.{i}.convs.{c}.conv.0"))], dim=1)
        h = _c(s, t, f"RDBs.{i}.LFF", 0) + h
        outs.append(h)
    h = _c(s, _c(s, torch.cat(outs, dim=1), "GFF.0", 0), "GFF.1") * weight
    h = _up(s, "UPNet1", h, scale) + skip
    return _c(s, _c(s, h, "final_conv"), "add_mean", 0) / 255


# -- cases: (layout, FedSight model, its params, reference shapes, reference forward) ------------------------------

TINY = {  # layout -> (model, params, shapes(scale), forward(state, x, scale))
    "edsr": ("edsr", {"features": 8, "blocks": 2, "res_scale": 0.1, "rgb_range": 255},
             lambda sc: edsr_pytorch_shapes(8, 2, sc), lambda s, x, sc: edsr_pytorch_forward(s, x, 2, sc, 0.1)),
    "basicsr": ("edsr", {"features": 8, "blocks": 2, "rgb_range": 255},
                     lambda sc: basicsr_edsr_shapes(8, 2, sc), lambda s, x, sc: basicsr_edsr_forward(s, x, 2, sc, 1.0)),
    "etc_rdsn": ("rdsn_etc", {"features": 8, "blocks": 2, "layers": 2, "growth": 4, "unet_width": 8, "unet_depth": 4,
                              "rgb_range": 255},
                 lambda sc: etc_rdsn_shapes(8, 2, 2, 4, sc, unet=8), lambda s, x, sc: etc_rdsn_forward(s, x, 2, 2, sc)),
}


def _model(name, params, scale):
    torch.manual_seed(0)
    return build_model(name, params, family="image_sr", in_channels=3, num_outputs=3, scale=scale)


@pytest.mark.parametrize("scale", [2, 3, 4])
@pytest.mark.parametrize("layout", sorted(TINY))
def test_a_published_sr_checkpoint_loads_in_place_and_computes_the_published_forward(layout, scale, tmp_path):
    name, params, shapes, forward = TINY[layout]
    state = materialise(shapes(scale))
    path = tmp_path / f"{layout}_x{scale}.pth"
    torch.save({k: v.float() for k, v in state.items()}, path)
    model = _model(name, params, scale).double()
    loaded = load_checkpoint(model, path, layout)
    own = model.state_dict()
    assert set(loaded) == set(own)  # no missing, no unexpected key (the mean-shift convs checked and dropped)
    renamed = convert(state, layout)
    assert all(torch.equal(own[k], renamed[k].float().double()) for k in own)  # (the file holds float32)
    # the forward, in float64 (the same weights, not rounded to float32) on an odd LR size (17 x 19: the U-Net's
    # pooling drops a row and its up path pads it back)
    x = torch.rand(2, 3, 17, 19, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    model.load_state_dict({k: v for k, v in renamed.items() if k in own})
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), forward(state, x, scale), rtol=1e-9, atol=1e-9)


PAPER = [  # (layout, FedSight model, params, reference shapes, published trainable parameter count or None)
    ("edsr", "edsr", {"features": 64, "blocks": 16, "rgb_range": 255}, edsr_pytorch_shapes(64, 16, 2),
     PUBLISHED_EDSR[64, 16, 2]),
    ("edsr", "edsr", {"features": 256, "blocks": 32, "res_scale": 0.1, "rgb_range": 255},
     edsr_pytorch_shapes(256, 32, 2), PUBLISHED_EDSR[256, 32, 2]),
    ("edsr", "edsr", {"features": 256, "blocks": 32, "res_scale": 0.1, "rgb_range": 255},
     edsr_pytorch_shapes(256, 32, 4), None),
    ("basicsr", "edsr", {"features": 64, "blocks": 16, "rgb_range": 255}, basicsr_edsr_shapes(64, 16, 2),
     PUBLISHED_EDSR[64, 16, 2]),
    ("basicsr", "edsr", {"features": 256, "blocks": 32, "res_scale": 0.1, "rgb_range": 255},
     basicsr_edsr_shapes(256, 32, 3), None),
    ("etc_rdsn", "rdsn_etc", {"features": 64, "blocks": 16, "layers": 8, "growth": 64, "unet_width": 64,
                              "unet_depth": 4, "rgb_range": 255}, etc_rdsn_shapes(64, 16, 8, 64, 2), None),
    ("etc_rdsn", "rdsn_etc", {"features": 64, "blocks": 16, "layers": 8, "growth": 64, "unet_width": 64,
                              "unet_depth": 4, "rgb_range": 255}, etc_rdsn_shapes(64, 16, 8, 64, 4), None),
]


@pytest.mark.parametrize("case", range(len(PAPER)), ids=[f"{p[0]}-{p[1]}-{_trainable(p[3])}" for p in PAPER])
def test_paper_size_keys_shapes_and_parameter_counts(case):
    """On the meta device: the published paper-size state dict's keys map one to one onto the model's, with the
    model's shapes, and the model has the published number of parameters."""
    layout, name, params, shapes, published = PAPER[case]
    state = {k: torch.empty(v, device="meta") for k, v in shapes.items() if not k.startswith(("sub_mean", "add_mean"))}
    with torch.device("meta"):
        scale = 4 if "tail.0.2.weight" in shapes or "UPNet1.2.weight" in shapes else \
            (3 if shapes.get("upsample.0.weight", (0,))[0] == 9 * params["features"] else 2)
        model = _model(name, params, scale)
    renamed = convert(state, layout)
    own = model.state_dict()
    assert set(renamed) == set(own)
    assert all(tuple(renamed[k].shape) == tuple(own[k].shape) for k in own)
    count = sum(p.numel() for p in model.parameters())
    assert count == _trainable(shapes)
    if published is not None:
        assert count == published


def _edsr_file(tmp_path, rgb_range=255.0):
    path = tmp_path / "edsr_baseline_x2.pt"
    torch.save(materialise(edsr_pytorch_shapes(8, 2, 2), rgb_range=rgb_range), path)
    return path


@pytest.mark.parametrize("case", ["range", "no mean shift", "other mean", "not identity", "incomplete"])
def test_a_mean_shift_that_is_not_the_models_is_one_line_and_nothing_loads(case, tmp_path):
    state = materialise(edsr_pytorch_shapes(8, 2, 2))
    params = {"features": 8, "blocks": 2, "rgb_range": 1 if case == "range" else 255}
    if case == "no mean shift":
        params["mean_shift"] = False
    elif case == "other mean":
        state["sub_mean.bias"] = -255 * torch.tensor([0.5, 0.5, 0.5], dtype=torch.float64)
    elif case == "not identity":
        state["add_mean.weight"] = state["add_mean.weight"] / 2
    elif case == "incomplete":
        del state["add_mean.bias"]
    path = tmp_path / "edsr.pt"
    torch.save(state, path)
    model = _model("edsr", params, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        load_checkpoint(model, path, "edsr")
    msg = str(info.value)
    assert msg.startswith(f"{path} (edsr layout) does not fit the model: ") and "\n" not in msg, msg
    want = {"range": "the checkpoint works in [0, 255] (sub_mean.bias = -255 x the DIV2K mean) and the model has "
                     "rgb_range = 1: set the model's rgb_range = 255",
            "no mean shift": "the model has mean_shift = false",
            "other mean": "sub_mean.bias = [-127.5, -127.5, -127.5] is not -rgb_range x the DIV2K mean",
            "not identity": "add_mean.weight is not the identity",
            "incomplete": "mean shift is incomplete"}[case]
    assert want in msg, msg
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_checkpoint_for_rgb_range_1_loads_into_a_model_at_range_1(tmp_path):
    model = _model("edsr", {"features": 8, "blocks": 2}, 2)
    load_checkpoint(model, _edsr_file(tmp_path, rgb_range=1.0), "edsr")


@pytest.mark.parametrize("layout, given", [("edsr", "basicsr"), ("basicsr", "etc_rdsn"), ("etc_rdsn", "edsr")])
def test_another_familys_checkpoint_is_named(layout, given, tmp_path):
    name, params, shapes, _ = TINY[given]
    path = tmp_path / "other.pth"
    torch.save(materialise(shapes(2)), path)
    want = {"edsr": "not an EDSR-PyTorch EDSR state dict", "basicsr": "not a BasicSR EDSR, BasicVSR or SPyNet state dict",
            "etc_rdsn": "not an ETC-RDSN (RDN) state dict"}[layout]
    with pytest.raises(ValueError, match=re.escape(f"{path}: {want}")):
        load_checkpoint(_model(TINY[layout][0], TINY[layout][1], 2), path, layout)


def test_a_checkpoint_of_another_size_names_the_shapes(tmp_path):
    path = tmp_path / "edsr_x4.pt"
    torch.save(materialise(edsr_pytorch_shapes(8, 2, 4)), path)  # x4: two upsampling stages
    with pytest.raises(ValueError, match=r"keys the model does not have: head\.up\.2\.bias, head\.up\.2\.weight"):
        load_checkpoint(_model("edsr", {"features": 8, "blocks": 2, "rgb_range": 255}, 2), path, "edsr")


def test_the_configs_layout_choices_are_the_layouts():
    """``init.layout`` (a Literal, so that a typo is refused at config time) offers exactly ``weights.LAYOUTS``."""
    import typing

    from fedsight.config_sections import InitSection
    from fedsight.weights import LAYOUTS

    assert set(typing.get_args(InitSection.model_fields["layout"].annotation)) == set(LAYOUTS)


def test_a_converted_file_keeps_the_mean_shift_check_and_loads_as_fedsight(tmp_path):
    """``fedsight weights convert --from edsr`` keeps ``sub_mean`` / ``add_mean`` (checked again, then dropped, when
    the converted file loads), so a converted file still refuses a model at another ``rgb_range``."""
    from fedsight.weights import convert_file

    dst = tmp_path / "edsr.safetensors"
    convert_file(_edsr_file(tmp_path), dst, "edsr")
    model = _model("edsr", {"features": 8, "blocks": 2, "rgb_range": 255}, 2)
    assert set(load_checkpoint(model, dst)) == set(model.state_dict())
    with pytest.raises(ValueError, match="set the model's rgb_range = 255"):
        load_checkpoint(_model("edsr", {"features": 8, "blocks": 2}, 2), dst)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["edsr", "etc_rdsn"])
def test_paper_size_checkpoint_computes_the_published_forward(layout, tmp_path):
    """At the published size (EDSR x2: 256 features, 32 blocks, res_scale 0.1; the RDSN authors' x2: config B and
    the 64-wide U-Net), materialised: the loaded model's forward is the published one (float32, one 16 x 16 image)."""
    if layout == "edsr":
        shapes, params = edsr_pytorch_shapes(256, 32, 2), {"features": 256, "blocks": 32, "res_scale": 0.1}
        forward = lambda s, x: edsr_pytorch_forward(s, x, 32, 2, 0.1)  # noqa: E731
        name = "edsr"
    else:
        shapes = etc_rdsn_shapes(64, 16, 8, 64, 2)
        params = {"features": 64, "blocks": 16, "layers": 8, "growth": 64, "unet_width": 64, "unet_depth": 4}
        forward = lambda s, x: etc_rdsn_forward(s, x, 16, 8, 2)  # noqa: E731
        name = "rdsn_etc"
    state = {k: v.float() for k, v in materialise(shapes).items()}
    path = tmp_path / "paper.pth"
    torch.save(state, path)
    model = _model(name, {**params, "rgb_range": 255}, 2)
    load_checkpoint(model, path, layout)
    x = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(5))
    model.eval()
    with torch.no_grad():
        got, want = model(x), forward(state, x)
    assert want.abs().max() < 1e4  # (the weights keep the activations' scale: a meaningful comparison)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
