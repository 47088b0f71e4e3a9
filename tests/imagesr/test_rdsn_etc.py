"""``rdsn_etc``, the RDSN authors' network (ETC-RDSN): the SR contract (any LR size the U-Net can pool, scales 2-4,
the UDC), its structure (U-Net attention multiplying the fused features, the learned skip in the head) and its
input checks. Its published checkpoints and forward: tests/models/test_weights_sr.py."""

from __future__ import annotations

import pydantic
import pytest
import torch
from torch import nn

from fedsight.models.base import FedModel, ModelIO, detect_capabilities, norm_keys
from fedsight.registry import MODELS, build

TINY = {"features": 8, "blocks": 2, "layers": 2, "growth": 4, "unet_width": 4, "unet_depth": 2}
DIV2K = torch.tensor([0.4488, 0.4371, 0.4040]).view(1, 3, 1, 1)


def make(params, scale=2, seed=0):
    torch.manual_seed(seed)
    return build(MODELS, "rdsn_etc", params, io=ModelIO("image_sr", 3, 3, scale=scale))


def test_registered_for_image_sr_without_norm_layers():
    entry = MODELS.get("rdsn_etc")
    model = make({})
    assert entry.task_family == "image_sr" and isinstance(model, FedModel) and model.split_head is False
    assert detect_capabilities(model) == entry.provides == {"parameter_groups"} and not norm_keys(model)


@pytest.mark.parametrize("params", [TINY, {**TINY, "attention": False}, {**TINY, "learned_skip": False},
                                    {**TINY, "udc": True, "rgb_range": 255}, {**TINY, "mean_shift": False}])
@pytest.mark.parametrize("scale,h,w", [(2, 5, 7), (3, 7, 4), (4, 4, 9), (4, 8, 8)])
def test_output_shape_any_size_the_unet_can_pool(params, scale, h, w):
    out = make(params, scale)(torch.rand(2, 3, h, w))
    assert out.shape == (2, 3, scale * h, scale * w) and torch.isfinite(out).all()


def test_an_input_too_small_for_the_unet_is_one_clear_error():
    with pytest.raises(ValueError, match=r"pools 2 times: LR inputs need at least 4 pixels a side, got \(3, 8\)"):
        make(TINY)(torch.rand(1, 3, 3, 8))
    assert make({**TINY, "attention": False})(torch.rand(1, 3, 3, 8)).shape == (1, 3, 6, 16)  # no U-Net, no limit
    with pytest.raises(ValueError, match=r"LR images \[B, C, h, w\]"):
        make(TINY)(torch.rand(3, 8, 8))


@pytest.mark.parametrize("field,value", [("unet_width", 6), ("unet_depth", 0), ("rgb_range", 0)])
def test_bad_parameters_name_the_field(field, value):
    with pytest.raises(pydantic.ValidationError, match=field):
        MODELS.get("rdsn_etc").params(**{field: value})
    with pytest.raises(ValueError, match="udc_offset"):
        make({**TINY, "udc": True, "udc_offset": 2}, scale=2)
    with pytest.raises(ValueError, match="scale"):
        make(TINY, scale=5)


@pytest.mark.parametrize("scale,offset", [(2, 0), (3, 2), (4, 1)])
def test_udc_keeps_the_input_pixels_exactly(scale, offset):
    x = torch.rand(2, 3, 5, 7)
    out = make({**TINY, "udc": True, "udc_offset": offset}, scale)(x)
    assert torch.equal(out[:, :, offset::scale, offset::scale], x)
    free = torch.ones(out.shape[-2:], dtype=torch.bool)
    free[offset::scale, offset::scale] = False
    with torch.no_grad():
        assert torch.equal(out[..., free], make(TINY, scale)(x)[..., free])


def test_the_unet_output_multiplies_the_features_and_the_skip_is_learned():
    """With the U-Net's output conv zeroed, the attended features are 0, and with the feature upsampler's biases
    zeroed the output is the learned skip alone: ``out(skip((x - m) r)) / r + m``; with the skip removed as well,
    the constant ``out.bias / r + m``."""

    def silence(m):
        with torch.no_grad():
            m.backbone.attention.out.weight.zero_()
            m.backbone.attention.out.bias.zero_()
            m.head.up[0].bias.zero_()
        return m

    model = silence(make({**TINY, "rgb_range": 255}, scale=3))
    x = torch.rand(2, 3, 6, 5)
    shifted = (x - DIV2K) * 255
    with torch.no_grad():
        assert torch.equal(model.features(x), torch.zeros(2, 8, 6, 5))
        want = model.head.out(model.head.skip(shifted)) * (1 / 255) + DIV2K
        torch.testing.assert_close(model(x), want, rtol=0, atol=1e-6)
        plain = silence(make({**TINY, "rgb_range": 255, "learned_skip": False}, scale=3))
        const = plain.head.out.bias.view(1, 3, 1, 1) / 255 + DIV2K
        torch.testing.assert_close(plain(x), const.expand(2, 3, 18, 15), rtol=0, atol=1e-6)


def test_parameter_groups_and_blocks():
    """``head`` = both upsamplers and the output conv (everything from the first PixelShuffle's conv on, found from
    the call order); blocks cover the state once."""
    model = make(TINY, scale=4)
    calls: list[str] = []
    for n, m in model.named_modules():
        if isinstance(m, (nn.Conv2d, nn.PixelShuffle)) and not n.startswith("backbone.attention"):
            m.register_forward_hook(lambda mod, inp, out, n=n: calls.append(n))
    model(torch.rand(1, 3, 4, 4))
    shuffles = {n for n, m in model.named_modules() if isinstance(m, nn.PixelShuffle)}
    convs = [n for n in calls if n not in shuffles]
    head_convs = {n for n in convs if n.startswith("head.")}
    assert len(head_convs) == 5  # two x2 stages for the features, two for the input, the output conv
    groups = model.parameter_groups()
    assert set(groups["head"]) == {f"{n}.{p}" for n in head_convs for p in ("weight", "bias")}
    assert set(groups["backbone"]) == {k for k, _ in model.named_parameters()} - set(groups["head"])
    blocks = model.blocks()
    flat = [k for keys in blocks.values() for k in keys]
    assert len(flat) == len(set(flat)) and set(flat) == set(model.state_dict())
    assert list(blocks) == ["backbone.sfe", "backbone.rdbs.0", "backbone.rdbs.1", "backbone.gff", "backbone.attention",
                            "head"]


@pytest.mark.parametrize("scale, h, w", [(2, 5, 7), (3, 4, 4)])
def test_the_fused_forward_is_each_clients_own(scale, h, w):
    """Three clients with their own weights through the vectorised engine's fused forward (the U-Net's padding at
    an odd size, the mean shift at rgb_range 255, the UDC): outputs and each client's gradient against its own
    module (float64; ``tests/test_fused.py``'s check)."""
    from test_fused import _each_clients_own

    from fedsight.models.rdsn_etc import ETCRDSN
    from fedsight.training.fused_trace import fused_plan

    make = lambda: ETCRDSN(scale, features=4, blocks=1, layers=1, growth=4, unet_width=4, unet_depth=2,  # noqa: E731
                           rgb_range=255, udc=True)
    assert fused_plan(make()) is not None
    gen = torch.Generator().manual_seed(scale)
    x = torch.rand(3, 2, 3, h, w, generator=gen, dtype=torch.float64)
    out = _each_clients_own(make, x, gen)
    assert torch.equal(out[..., ::scale, ::scale], x)
