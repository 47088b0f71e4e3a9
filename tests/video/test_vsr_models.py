"""The recurrent (BasicVSR-family) and sliding-window VSR models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedsight.models.vsr import SpyFlow, flow_warp
from fedsight.models.base import ModelIO
from fedsight.registry import MODELS, build

VARIANTS = [
    ("basicvsr", {"channels": 8, "blocks": 1, "align": "flow", "flow_channels": 4, "flow_levels": 2}),
    ("basicvsr", {"channels": 8, "blocks": 1, "align": "none"}),
    ("sliding_vsr", {"channels": 8, "blocks": 1, "radius": 1}),
    ("sliding_vsr", {"channels": 8, "blocks": 1, "radius": 2, "skip": "bicubic"}),
]


def make(name, params, scale=4, seed=0):
    torch.manual_seed(seed)
    return build(MODELS, name, params, io=ModelIO("video_sr", num_outputs=3, scale=scale))


def test_registered_for_video_sr():
    for name in ("basicvsr", "sliding_vsr"):
        assert MODELS.get(name).task_family == "video_sr"


@pytest.mark.parametrize("name,params", VARIANTS)
@pytest.mark.parametrize("frames", [1, 3, 5])
@pytest.mark.parametrize("scale,h,w", [(4, 8, 8), (4, 7, 9), (2, 5, 6), (3, 6, 5)])
def test_any_frame_count_and_size(name, params, frames, scale, h, w):
    model = make(name, params, scale)
    x = torch.rand(2, frames, 3, h, w)
    out = model(x)
    assert out.shape == (2, frames, 3, h * scale, w * scale)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name,params", VARIANTS)
def test_gradients_reach_the_parameters(name, params):
    model = make(name, params)
    out = model(torch.rand(1, 3, 3, 6, 6))
    (out - torch.rand_like(out)).abs().mean().backward()
    grads = {k: p.grad for k, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    last = [k for k in grads if k.startswith("upsampler.last")]
    assert last and all(grads[k].abs().sum() > 0 for k in last)
    if params.get("align") == "flow":
        # the flow net starts at zero flow, but its output layers still receive gradient through the warp
        assert any(grads[k].abs().sum() > 0 for k in grads if k.startswith("flow.") and k.endswith("4.weight"))


def test_untrained_model_starts_near_the_interpolation_skip():
    model = make("basicvsr", {"channels": 8, "blocks": 1})
    x = torch.rand(1, 3, 3, 8, 8)
    with torch.no_grad():
        out = model(x)
    up = F.interpolate(x.reshape(3, 3, 8, 8), scale_factor=4, mode="bilinear", align_corners=False).view_as(out)
    assert (out - up).abs().mean() < 0.1


def test_temporal_receptive_fields():
    x = torch.rand(1, 5, 3, 6, 6)
    y = x.clone()
    y[:, 4] += 0.5  # change the last frame only
    rec = make("basicvsr", {"channels": 8, "blocks": 1, "align": "none"})
    sld = make("sliding_vsr", {"channels": 8, "blocks": 1, "radius": 1})
    with torch.no_grad():
        # bidirectional recurrence: the first output frame sees the last input frame
        assert (rec(x)[:, 0] - rec(y)[:, 0]).abs().max() > 1e-6
        # a window of radius 1: frames 0..2 cannot see frame 4, frame 3 can
        a, b = sld(x), sld(y)
        assert torch.equal(a[:, :3], b[:, :3])
        assert (a[:, 3] - b[:, 3]).abs().max() > 1e-6


def test_flow_warp_by_hand_and_zero_initial_flow():
    img = torch.arange(2 * 1 * 4 * 5, dtype=torch.float32).view(2, 1, 4, 5)
    flow = torch.zeros(2, 2, 4, 5)
    torch.testing.assert_close(flow_warp(img, flow), img)
    flow[:, 0] = 1.0  # out(y, x) = img(y, x + 1); the last column samples outside -> 0
    warped = flow_warp(img, flow)
    torch.testing.assert_close(warped[..., :4], img[..., 1:])
    assert torch.count_nonzero(warped[..., 4]) == 0
    net = SpyFlow(channels=4, levels=3)
    f = net(torch.rand(3, 3, 7, 9), torch.rand(3, 3, 7, 9))
    assert f.shape == (3, 2, 7, 9) and torch.count_nonzero(f) == 0
