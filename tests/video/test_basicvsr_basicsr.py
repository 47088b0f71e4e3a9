"""``basicvsr_basicsr``: BasicSR's BasicVSR. BasicSR's checkpoints (key names and shapes written here from
basicsr/archs/basicvsr_arch.py and spynet_arch.py, independently of FedSight's model) load through the ``basicsr``
layout; the forward equals an independent functional transcription of BasicSR's ``BasicVSR.forward``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedsight.models import build_model
from fedsight.models.spynet import flow_warp
from fedsight.weights import load_checkpoint

TINY = {"num_feat": 8, "num_block": 2, "hr_feat": 8, "spynet_hidden": [4, 4, 4, 4]}


def make(params=None, scale=4, seed=0):
    torch.manual_seed(seed)
    return build_model("basicvsr_basicsr", params or {}, family="video_sr", num_outputs=3, scale=scale)


def basicsr_state(num_feat=64, num_block=30, hr=64, spynet_hidden=(32, 64, 32, 16), seed=0, constants=True,
                  spynet_std=0.05):
    """BasicSR's ``BasicVSR(num_feat, num_block)`` state dict: ``spynet`` (6 BasicModules of five 7x7 convs
    8 -> 32 -> 64 -> 32 -> 16 -> 2, buffers ``mean``/``std``), ``backward_trunk``/``forward_trunk``
    (``main.0`` conv3x3 num_feat+3 -> num_feat, ``main.2.{k}.conv1/conv2``), ``fusion`` 1x1 2F -> F, ``upconv1``
    F -> 4F, ``upconv2`` F -> 4x64, ``conv_hr`` 64 -> 64, ``conv_last`` 64 -> 3."""
    g = torch.Generator().manual_seed(seed)
    s: dict[str, torch.Tensor] = {}

    def conv(name, cout, cin, k, std=0.05):
        s[f"{name}.weight"] = std * torch.randn(cout, cin, k, k, generator=g)
        s[f"{name}.bias"] = 0.05 * torch.randn(cout, generator=g)

    widths = (8, *spynet_hidden, 2)
    for level in range(6):
        for j in range(5):
            conv(f"spynet.basic_module.{level}.basic_module.{2 * j}", widths[j + 1], widths[j], 7, spynet_std)
    if constants:
        s["spynet.mean"] = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
        s["spynet.std"] = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    for trunk in ("backward_trunk", "forward_trunk"):
        conv(f"{trunk}.main.0", num_feat, num_feat + 3, 3)
        for k in range(num_block):
            conv(f"{trunk}.main.2.{k}.conv1", num_feat, num_feat, 3)
            conv(f"{trunk}.main.2.{k}.conv2", num_feat, num_feat, 3)
    conv("fusion", num_feat, 2 * num_feat, 1)
    conv("upconv1", 4 * num_feat, num_feat, 3)
    conv("upconv2", 4 * hr, num_feat, 3)
    conv("conv_hr", hr, hr, 3)
    conv("conv_last", 3, hr, 3)
    return s


def test_paper_size_has_basicsr_keys_shapes_and_the_papers_parameter_count():
    ref = basicsr_state(constants=False)
    model = make()
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == {k: tuple(v.shape) for k, v in ref.items()}
    count = sum(v.numel() for v in ref.values())
    assert sum(p.numel() for p in model.parameters()) == count == 6_291_311
    assert round(count / 1e5) == 63  # the BasicVSR paper's Table 1: 6.3M


def test_a_basicsr_checkpoint_loads_every_value_in_its_place(tmp_path):
    state = basicsr_state()
    torch.save({"params": state}, tmp_path / "BasicVSR_REDS4.pth")
    model = make()
    loaded = load_checkpoint(model, tmp_path / "BasicVSR_REDS4.pth", "basicsr")
    assert "spynet.mean" not in loaded and "spynet.std" not in loaded
    own = model.state_dict()
    assert set(own) == set(state) - {"spynet.mean", "spynet.std"}
    assert all(torch.equal(own[k], state[k]) for k in own)


def test_a_standalone_spynet_checkpoint_initialises_the_flow_network_only(tmp_path):
    spy = {k[len("spynet."):]: v for k, v in basicsr_state().items() if k.startswith("spynet.basic_module.")}
    torch.save({"params": spy}, tmp_path / "spynet_sintel_final.pth")
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"spynet_sintel_final.pth .*model keys it does not give: backward_trunk"):
        load_checkpoint(model, tmp_path / "spynet_sintel_final.pth", "basicsr")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    load_checkpoint(model, tmp_path / "spynet_sintel_final.pth", "basicsr", strict=False)
    for k, v in model.state_dict().items():
        assert torch.equal(v, spy[k[len("spynet."):]] if k.startswith("spynet.") else before[k]), k


@pytest.mark.parametrize("case", ["mean", "x4 into x2", "edsr", "small spynet"])
def test_a_checkpoint_that_does_not_fit_is_one_error_and_nothing_loads(case, tmp_path):
    state, scale, params = basicsr_state(**{k: v for k, v in TINY.items() if k != "hr_feat"}, hr=8), 4, TINY
    if case == "mean":
        state["spynet.mean"] = torch.zeros(1, 3, 1, 1)
        match = r"spynet.mean is \[0.0, 0.0, 0.0\], not ImageNet's"
    elif case == "x4 into x2":
        scale, match = 2, r"keys the model does not have: upconv2.bias, upconv2.weight"
    elif case == "edsr":
        state = {"conv_first.weight": torch.zeros(64, 3, 3, 3), "body.0.conv1.weight": torch.zeros(64, 64, 3, 3)}
        match = "not a BasicSR EDSR, BasicVSR or SPyNet state dict"
    else:
        params = {**TINY, "spynet_hidden": [4, 4, 4, 5]}
        match = r"shapes do not fit: spynet.basic_module.0.basic_module.6.bias \[4\] vs the model.s \[5\]"
    path = tmp_path / "ckpt.pth"
    torch.save({"params": state}, path)
    model = make(params, scale)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match) as err:
        load_checkpoint(model, path, "basicsr")
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def basicsr_forward(s: dict[str, torch.Tensor], spynet, x: torch.Tensor, num_block: int) -> torch.Tensor:
    """BasicSR's ``BasicVSR.forward`` transcribed with the state dict's tensors: two SPyNet calls, the backward and
    forward loops, and each frame upsampled inside the forward loop as BasicSR does it (x4)."""
    lrelu = lambda t: F.leaky_relu(t, 0.1)  # noqa: E731

    def conv(name, t, pad=1):
        return F.conv2d(t, s[f"{name}.weight"], s[f"{name}.bias"], padding=pad)

    def trunk(name, t):
        t = lrelu(conv(f"{name}.main.0", t))
        for k in range(num_block):
            t = t + conv(f"{name}.main.2.{k}.conv2", F.relu(conv(f"{name}.main.2.{k}.conv1", t)))
        return t

    b, n, c, h, w = x.shape
    x1, x2 = x[:, :-1].reshape(-1, c, h, w), x[:, 1:].reshape(-1, c, h, w)
    flows_backward = spynet(x1, x2).view(b, n - 1, 2, h, w)
    flows_forward = spynet(x2, x1).view(b, n - 1, 2, h, w)
    out_l = []
    feat = x.new_zeros(b, s["fusion.bias"].numel(), h, w)
    for i in range(n - 1, -1, -1):
        if i < n - 1:
            feat = flow_warp(feat, flows_backward[:, i].permute(0, 2, 3, 1))
        feat = trunk("backward_trunk", torch.cat([x[:, i], feat], 1))
        out_l.insert(0, feat)
    feat = torch.zeros_like(feat)
    for i in range(n):
        if i > 0:
            feat = flow_warp(feat, flows_forward[:, i - 1].permute(0, 2, 3, 1))
        feat = trunk("forward_trunk", torch.cat([x[:, i], feat], 1))
        out = lrelu(conv("fusion", torch.cat([out_l[i], feat], 1), pad=0))
        out = lrelu(F.pixel_shuffle(conv("upconv1", out), 2))
        out = lrelu(F.pixel_shuffle(conv("upconv2", out), 2))
        out = conv("conv_last", lrelu(conv("conv_hr", out)))
        out_l[i] = out + F.interpolate(x[:, i], scale_factor=4, mode="bilinear", align_corners=False)
    return torch.stack(out_l, dim=1)


def test_forward_equals_basicsrs_forward_with_loaded_weights(tmp_path):
    """Random BasicSR weights (SPyNet's included, so the flows are not zero and the warps act) give the output of the
    transcription of BasicSR's forward, on frames whose size is not a multiple of 32."""
    state = basicsr_state(num_feat=8, num_block=2, hr=8, spynet_hidden=(8, 8, 8, 8), seed=3)
    torch.save({"params": state}, tmp_path / "w.pth")
    model = make({**TINY, "spynet_hidden": [8, 8, 8, 8]})
    load_checkpoint(model, tmp_path / "w.pth", "basicsr")
    model.eval()
    x = torch.rand(2, 4, 3, 11, 14, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        flow = model.spynet(x[:, 0], x[:, 1])
        back = model.spynet(x[:, 1], x[:, 0])
        # the warps are not the identity, and the two directions differ (a swap of them would show)
        assert flow.abs().mean() > 0.1 and flow.abs().max() < 2 and (flow - back).abs().mean() > 0.1 * flow.abs().mean()
        torch.testing.assert_close(model(x), basicsr_forward(state, model.spynet, x, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scale,frames,h,w", [(4, 1, 8, 8), (4, 3, 7, 9), (2, 2, 5, 6), (2, 3, 8, 8)])
def test_any_frame_count_and_size(scale, frames, h, w):
    out = make(TINY, scale)(torch.rand(2, frames, 3, h, w))
    assert out.shape == (2, frames, 3, h * scale, w * scale) and torch.isfinite(out).all()


def test_gradients_reach_every_parameter_and_the_first_frame_sees_the_last():
    model = make({**TINY, "spynet_init": "pytorch"})
    x = torch.rand(1, 4, 3, 6, 6)
    out = model(x)
    (out - torch.rand_like(out)).abs().mean().backward()
    for k, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, k
    y = x.clone()
    y[:, 3] += 0.5
    with torch.no_grad():
        assert (model(x)[:, 0] - model(y)[:, 0]).abs().max() > 1e-6


def test_zero_flow_init_starts_with_identity_warps_and_groups_cover_the_parameters():
    model = make(TINY)
    x = torch.rand(1, 2, 3, 6, 6)
    assert torch.count_nonzero(model.spynet(x[:, 0], x[:, 1])) == 0
    groups = model.parameter_groups()
    assert {k.split(".")[0] for k in groups["head"]} == {"fusion", "upconv1", "upconv2", "conv_hr", "conv_last"}
    assert {k.split(".")[0] for k in groups["backbone"]} == {"spynet", "backward_trunk", "forward_trunk"}
    assert groups["norm"] == []


def test_other_scales_and_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="basicvsr_basicsr upscales x4 .* or x2, not x3"):
        make(TINY, 3)
    with pytest.raises(ValueError, match=r"expects LR clips \[B, T, 3, h, w\]"):
        make(TINY)(torch.rand(1, 3, 8, 8))


def test_outputs_equal_basicsrs_own_code_on_the_golden_fixture():
    """``tests/fixtures/golden/basicsr_basicvsr.safetensors``, written by ``benchmarks/golden_basicvsr.py`` running
    BasicSR's own ``BasicVSR`` (its source commit in the metadata) on seeded weights: FedSight's model, given the same
    weights through the ``basicsr`` layout, gives BasicSR's SPyNet flows and outputs to float tolerance."""
    import json
    import sys
    from pathlib import Path

    from safetensors import safe_open

    from fedsight.weights import convert, fit_problems

    root = Path(__file__).resolve().parents[2]
    path = root / "tests" / "fixtures" / "golden" / "basicsr_basicvsr.safetensors"
    if not path.is_file():
        pytest.skip(f"no golden fixture {path.relative_to(root)}: run benchmarks/golden_basicvsr.py on a BasicSR tree")
    sys.path.insert(0, str(root / "benchmarks"))
    from golden_basicvsr import STRIDE, golden_state

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        x, flows, mean, sub = (f.get_tensor(k) for k in ("input", "flows_backward", "output_mean", "output_sub"))
    assert meta["source"].startswith("XPixelGroup/BasicSR@")
    model = make(json.loads(meta["params"]), int(meta["scale"])).eval()
    state = convert(golden_state(json.loads(meta["shapes"])), meta["layout"])
    assert fit_problems(model, state, list(model.state_dict())) == []
    model.load_state_dict(state)
    b, t, c, h, w = x.shape
    with torch.no_grad():
        mine = model.spynet(x[:, :-1].reshape(-1, c, h, w), x[:, 1:].reshape(-1, c, h, w)).view(b, t - 1, 2, h, w)
        out = model(x)
    assert flows.abs().max() > 0.5  # the warps move features by more than half a pixel
    torch.testing.assert_close(mine, flows, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.mean(dim=(2, 3, 4)), mean, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[..., ::STRIDE, ::STRIDE], sub, rtol=1e-4, atol=1e-5)
