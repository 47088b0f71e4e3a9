"""Single-image SR models (issue 13): RDSN (RDN + SAM + GSC + UDC) and the EDSR baseline."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fedsight.models.rdsn  # noqa: F401  (registration)
from fedsight.models.base import FedModel, ModelIO, detect_capabilities, norm_keys
from fedsight.registry import MODELS, build

TINY_RDSN = {"features": 8, "blocks": 2, "layers": 2, "growth": 4}
TINY_EDSR = {"features": 8, "blocks": 2}
DIV2K = torch.tensor([0.4488, 0.4371, 0.4040]).view(1, 3, 1, 1)


def make(name, params, scale=2, seed=0):
    torch.manual_seed(seed)
    return build(MODELS, name, params, io=ModelIO("image_sr", 3, 3, scale=scale))


def bicubic(x, s):
    return F.interpolate(x, scale_factor=s, mode="bicubic", align_corners=False)


def test_registered_for_image_sr_without_norm_layers():
    for name in ("rdsn", "edsr"):
        entry = MODELS.get(name)
        assert entry.task_family == "image_sr"
        model = make(name, {})
        assert isinstance(model, FedModel) and model.split_head is False
        assert detect_capabilities(model) == entry.provides == {"parameter_groups"}
        assert not norm_keys(model)


@pytest.mark.parametrize("name,params", [
    ("rdsn", TINY_RDSN), ("rdsn", {**TINY_RDSN, "attention": False, "global_skip": False}),
    ("rdsn", {**TINY_RDSN, "udc": True, "interp": "bilinear"}), ("edsr", TINY_EDSR),
])
@pytest.mark.parametrize("scale,h,w", [(2, 5, 7), (3, 7, 4), (4, 3, 9), (4, 8, 8)])
def test_output_shape_any_size(name, params, scale, h, w):
    out = make(name, params, scale)(torch.rand(2, 3, h, w))
    assert out.shape == (2, 3, scale * h, scale * w) and torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["rdsn", "edsr"])
def test_bad_scale_is_refused(name):
    with pytest.raises(ValueError, match="scale"):
        make(name, {}, scale=5)
    if name == "rdsn":
        with pytest.raises(ValueError, match="udc_offset"):
            make(name, {"udc": True, "udc_offset": 2}, scale=2)


def test_parameter_groups_split_at_the_upsampler():
    """``head`` = the convs from the one feeding the first PixelShuffle on (found from the call order)."""
    for name, params in (("rdsn", TINY_RDSN), ("edsr", TINY_EDSR)):
        model = make(name, params, scale=4)
        calls: list[str] = []
        for n, m in model.named_modules():
            if isinstance(m, (nn.Conv2d, nn.PixelShuffle)):
                m.register_forward_hook(lambda mod, inp, out, n=n: calls.append(n))
        model(torch.rand(1, 3, 4, 4))
        shuffles = {n for n, m in model.named_modules() if isinstance(m, nn.PixelShuffle)}
        first = next(i for i, n in enumerate(calls) if n in shuffles)
        head_convs = {n for n in calls[first - 1:] if n not in shuffles}
        assert len(head_convs) == 3  # two x2 stages and the output conv
        groups = model.parameter_groups()
        want = {f"{n}.{p}" for n in head_convs for p in ("weight", "bias")}
        assert set(groups["head"]) == want and groups["norm"] == []
        names = {k for k, _ in model.named_parameters()}
        assert set(groups["backbone"]) == names - want
        blocks = model.blocks()
        flat = [k for keys in blocks.values() for k in keys]
        assert len(flat) == len(set(flat)) and set(flat) == set(model.state_dict())


# -- global skip and UDC ------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [2, 3, 4])
@pytest.mark.parametrize("interp", ["bicubic", "bilinear"])
def test_zero_residual_path_gives_the_interpolation(scale, interp):
    model = make("rdsn", {**TINY_RDSN, "interp": interp}, scale)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    with torch.no_grad():  # the network's last conv: the residual F(I_in) is identically 0
        convs[-1].weight.zero_()
        convs[-1].bias.zero_()
    x = torch.rand(2, 3, 7, 6)
    ref = F.interpolate(x, scale_factor=scale, mode=interp, align_corners=False)
    torch.testing.assert_close(model(x), ref, rtol=0, atol=1e-7)
    # and without the skip the output is the (zero) residual
    plain = make("rdsn", {**TINY_RDSN, "global_skip": False}, scale)
    with torch.no_grad():
        plain.head.out.weight.zero_()
        plain.head.out.bias.zero_()
    assert torch.equal(plain(x), torch.zeros(2, 3, 7 * scale, 6 * scale))


def test_untrained_rdsn_starts_near_bicubic():
    x = torch.rand(1, 3, 8, 8)
    with torch.no_grad():
        out = make("rdsn", {}, 4)(x)
    assert (out - bicubic(x, 4)).abs().mean() < 0.05


@pytest.mark.parametrize("scale,offset", [(2, 0), (2, 1), (3, 0), (3, 2), (4, 0), (4, 3)])
def test_udc_keeps_the_input_pixels_exactly(scale, offset):
    model = make("rdsn", {**TINY_RDSN, "udc": True, "udc_offset": offset}, scale)
    x = torch.rand(2, 3, 5, 7)
    out = model(x)
    assert torch.equal(out[:, :, offset::scale, offset::scale], x)
    # the other pixels are the network's (not the input's) values
    free = torch.ones(out.shape[-2:], dtype=torch.bool)
    free[offset::scale, offset::scale] = False
    ref = make("rdsn", {**TINY_RDSN, "udc": False}, scale)
    with torch.no_grad():
        assert torch.equal(out[..., free], ref(x)[..., free])


def test_udc_gradients_kept_pixels_reach_only_the_input():
    s, o = 3, 1
    model = make("rdsn", {**TINY_RDSN, "udc": True, "udc_offset": o}, s)
    x = torch.rand(1, 3, 4, 5, requires_grad=True)
    out = model(x)
    kept = torch.zeros(out.shape[-2:], dtype=torch.bool)
    kept[o::s, o::s] = True
    weights = torch.rand_like(out)
    (out * weights)[..., kept].sum().backward()
    for k, p in model.named_parameters():
        assert p.grad is None or torch.count_nonzero(p.grad) == 0, k
    # d out[s i + o, s j + o] / d x[i, j] = 1: the input gets exactly the weights at the kept pixels
    assert torch.equal(x.grad, weights[..., o::s, o::s])
    model.zero_grad(set_to_none=True)
    x.grad = None
    out = model(x)
    (out * weights)[..., ~kept].sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert all(torch.count_nonzero(p.grad) > 0 for p in model.head.parameters())
    assert sum(torch.count_nonzero(p.grad) for p in model.backbone.parameters()) > 0


# -- structure seen through hooks ---------------------------------------------------------------------------


@pytest.mark.parametrize("g0,c,g", [(8, 3, 4), (6, 2, 5)])
def test_dense_block_concatenation_grows_by_g(g0, c, g):
    model = make("rdsn", {"features": g0, "blocks": 2, "layers": c, "growth": g})
    block = next(m for m in model.modules() if type(m).__name__ == "ResidualDenseBlock")
    seen: list[tuple[int, int]] = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append((inp[0].shape[1], out.shape[1])))
             for m in block.modules() if isinstance(m, nn.Conv2d)]
    io: list[tuple[int, int]] = []
    hooks.append(block.register_forward_hook(lambda mod, inp, out: io.append((inp[0].shape[1], out.shape[1]))))
    model(torch.rand(1, 3, 5, 5))
    for h in hooks:
        h.remove()
    # C dense layers (G0 + l G in, G out) in call order, then the 1x1 local fusion (G0 + C G -> G0)
    assert seen == [(g0 + i * g, g) for i in range(c)] + [(g0 + c * g, g0)]
    assert io == [(g0, g0)]


def test_spatial_attention_gates_the_fused_features():
    model = make("rdsn", TINY_RDSN)
    gates = []
    model.backbone.sam.conv.register_forward_hook(lambda m, inp, out: gates.append((inp[0], torch.sigmoid(out))))
    model(torch.rand(1, 3, 6, 6))
    pooled, gate = gates[0]
    assert pooled.shape == (1, 2, 6, 6) and ((gate > 0) & (gate < 1)).all()
    assert "sam" not in " ".join(k for k, _ in make("rdsn", {**TINY_RDSN, "attention": False}).named_parameters())


# -- EDSR mean shift ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [2, 3, 4])
def test_edsr_mean_shift_round_trips(scale):
    """Weights that make the network a nearest-neighbour copier of its (mean-shifted) input: the output is
    the nearest upsampling of the input itself, so the mean subtracted in front is added back after."""
    model = make("edsr", TINY_EDSR, scale)
    nf = 8
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        eye = torch.zeros(nf, 3, 3, 3)
        eye[:3, :3, 1, 1] = torch.eye(3)
        model.backbone.conv_first.weight.copy_(eye)  # body is zero: the long skip carries the features
        up = [m for m in model.head.up if isinstance(m, nn.Conv2d)]
        for conv in up:  # every sub-pixel channel of feature k copies feature k (PixelShuffle: channel k r^2 + q)
            r2 = conv.out_channels // nf
            for k in range(nf):
                conv.weight[k * r2:(k + 1) * r2, k, 1, 1] = 1.0
        out_w = torch.zeros(3, nf, 3, 3)
        out_w[:3, :3, 1, 1] = torch.eye(3)
        model.head.out.weight.copy_(out_w)
    seen = []
    model.backbone.conv_first.register_forward_pre_hook(lambda m, inp: seen.append(inp[0]))
    x = torch.rand(2, 3, 5, 6)
    nearest = x.repeat_interleave(scale, -2).repeat_interleave(scale, -1)
    torch.testing.assert_close(model(x), nearest, rtol=0, atol=1e-6)
    torch.testing.assert_close(seen[0], x - DIV2K, rtol=0, atol=0)  # the network sees the mean-free image
    assert not any("mean" in k for k in model.state_dict())  # a fixed constant, not state
    # a zero network returns the mean with the shift, zero without it
    off = make("edsr", {**TINY_EDSR, "mean_shift": False}, scale)
    with torch.no_grad():
        for p in list(model.parameters()) + list(off.parameters()):
            p.zero_()
    assert torch.equal(model(x), DIV2K.expand(2, 3, 5 * scale, 6 * scale))
    assert torch.equal(off(x), torch.zeros(2, 3, 5 * scale, 6 * scale))


# -- parameter counts --------------------------------------------------------------------------------------


def conv(cin, cout, k=3):
    return cin * cout * k * k + cout


def rdsn_count(g0, d, c, g, s, attention=True):
    sfe = conv(3, g0) + conv(g0, g0)
    rdb = sum(conv(g0 + i * g, g) for i in range(c)) + conv(g0 + c * g, g0, 1)
    gff = conv(d * g0, g0, 1) + conv(g0, g0)
    sam = conv(2, 1, 7) if attention else 0
    up = conv(g0, g * s * s) if s in (2, 3) else conv(g0, 4 * g) + conv(g, 4 * g)
    return sfe + d * rdb + gff + sam + up + conv(g, 3)


def edsr_count(f, b, s):
    up = conv(f, f * s * s) if s in (2, 3) else 2 * conv(f, 4 * f)
    return conv(3, f) + b * 2 * conv(f, f) + conv(f, f) + up + conv(f, 3)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("scale", [2, 3, 4])
def test_parameter_counts_follow_the_formula(scale):
    for g0, d, c, g, att in [(32, 4, 4, 16, True), (8, 2, 2, 4, True), (8, 3, 2, 4, False), (8, 2, 5, 4, True),
                             (8, 2, 2, 7, True), (64, 20, 6, 32, True)]:
        params = {"features": g0, "blocks": d, "layers": c, "growth": g, "attention": att}
        with torch.device("meta"):  # RDN config A: count without allocating
            model = build(MODELS, "rdsn", params, io=ModelIO("image_sr", 3, 3, scale=scale))
        assert n_params(model) == rdsn_count(g0, d, c, g, scale, att), params
    for f, b in [(32, 4), (8, 0), (8, 3), (64, 16)]:
        assert n_params(make("edsr", {"features": f, "blocks": b}, scale)) == edsr_count(f, b, scale)
    # the docstring's closed form: one more block adds one RDB and G0^2 to the 1x1 global fusion; one more
    # dense layer adds a conv (G0 + C G -> G) and G G0 to the local fusion in each of the D blocks
    g0, d, c, g = 8, 2, 3, 4
    base = rdsn_count(g0, d, c, g, scale)
    assert rdsn_count(g0, d + 1, c, g, scale) - base == (
        9 * g0 * c * g + c * g + 9 * g * g * c * (c - 1) // 2 + (g0 + c * g) * g0 + g0 + g0 * g0)
    assert rdsn_count(g0, d, c + 1, g, scale) - base == d * (9 * (g0 + c * g) * g + g + g * g0)


# -- Opacus per-sample gradients ----------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Full backward hook")
@pytest.mark.filterwarnings("ignore::UserWarning:opacus")
@pytest.mark.parametrize("name,params", [("rdsn", {**TINY_RDSN, "udc": True}), ("edsr", TINY_EDSR)])
def test_opacus_per_sample_gradients_match_one_example_at_a_time(name, params):
    from opacus import GradSampleModule
    from opacus.validators import ModuleValidator

    model = make(name, params, scale=2).double()
    assert ModuleValidator.validate(model, strict=False) == []
    x = torch.rand(3, 3, 5, 6, dtype=torch.float64)
    y = torch.rand(3, 3, 10, 12, dtype=torch.float64)
    # reference: one example at a time, plain autograd
    ref = []
    for i in range(3):
        model.zero_grad(set_to_none=True)
        (model(x[i:i + 1]) - y[i:i + 1]).pow(2).sum().backward()
        ref.append({k: p.grad.clone() for k, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    gsm = GradSampleModule(model, loss_reduction="sum")
    (gsm(x) - y).pow(2).sum().backward()
    for k, p in model.named_parameters():
        assert p.grad_sample is not None and p.grad_sample.shape == (3, *p.shape), k
        for i in range(3):
            torch.testing.assert_close(p.grad_sample[i], ref[i][k], rtol=1e-9, atol=1e-12, msg=k)
    gsm._close()
