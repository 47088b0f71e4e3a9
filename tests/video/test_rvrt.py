"""RVRT (``fedsight.models.rvrt``) and its plain-PyTorch guided deformable attention (``models.deform_attn``).

The published checkpoint layout is written here from the reference's architecture (JingyunLiang/RVRT and
cszn/KAIR ``models/network_rvrt.py``: key names and shapes, independently of FedSight's model) and must load with
every key placed; the deformable attention is checked against a direct loop transcription of the CUDA kernel's
sampling rule (``dmcn_im2col_bilinear`` in ``models/op/deform_attn_cuda_kernel.cu``) and against plain attention
with zero and integer offsets."""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from fedsight.models.base import ModelIO
from fedsight.models.deform_attn import GuidedDeformAttn, deform_attn
from fedsight.registry import MODELS, build
from fedsight.weights import load_checkpoint

#: a small RVRT: every part built (shifted windows at 8x8 LR with 4x4 windows), in about a second
TINY = {"embed_dims": [8, 8, 8], "depths": [2, 2, 2], "num_blocks": [1, 1, 1], "num_heads": [2, 2, 2],
        "window_size": [2, 4, 4], "deformable_groups": 4, "attention_heads": 2}
BRANCHES = ("backward_1", "forward_1", "backward_2", "forward_2")


def make(params=None, scale=4, seed=0):
    torch.manual_seed(seed)
    return build(MODELS, "rvrt", TINY if params is None else params, io=ModelIO("video_sr", num_outputs=3, scale=scale))


# -- the published layout ------------------------------------------------------------------------------------------


def _index(win):
    """The reference's ``get_position_index``: pairwise (d, h, w) differences, shifted to >= 0, mixed radix."""
    pts = list(itertools.product(*[range(s) for s in win]))
    out = torch.empty(len(pts), len(pts), dtype=torch.long)
    for i, a in enumerate(pts):
        for j, b in enumerate(pts):
            d, h, w = (a[0] - b[0] + win[0] - 1, a[1] - b[1] + win[1] - 1, a[2] - b[2] + win[2] - 1)
            out[i, j] = (d * (2 * win[1] - 1) + h) * (2 * win[2] - 1) + w
    return out


def kair_rvrt(dim=144, heads=6, window=(2, 8, 8), blocks=(1, 2, 1), depth=2, groups=12, k=9) -> dict[str, torch.Tensor]:
    """RVRT's state dict as the release saves it (upscale 4): key names and shapes from the reference's modules."""
    gen = torch.Generator().manual_seed(0)
    s: dict[str, torch.Tensor] = {}

    def t(name, *shape):
        s[name] = torch.randn(*shape, generator=gen) * 0.02

    for lv in range(6):  # SpyNet: BasicModule's Sequential of 7x7 convs 8-32-64-32-16-2
        for j, (ci, co) in enumerate([(8, 32), (32, 64), (64, 32), (32, 16), (16, 2)]):
            t(f"spynet.basic_module.{lv}.basic_module.{2 * j}.weight", co, ci, 7, 7)
            t(f"spynet.basic_module.{lv}.basic_module.{2 * j}.bias", co)
    s["spynet.mean"] = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    s["spynet.std"] = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)

    def rstb_with_input_conv(p, cin, nblocks, win):
        # main: Rearrange, Conv3d (1), Rearrange, LayerNorm (3), Rearrange, make_layer(RSTB) (5), Rearrange, LN (7)
        t(f"{p}.main.1.weight", dim, cin, 1, 3, 3), t(f"{p}.main.1.bias", dim)
        t(f"{p}.main.3.weight", dim), t(f"{p}.main.3.bias", dim)
        for b in range(nblocks):
            for l in range(depth):
                q = f"{p}.main.5.{b}.residual_group.blocks.{l}"
                t(f"{q}.norm1.weight", dim), t(f"{q}.norm1.bias", dim)
                t(f"{q}.attn.relative_position_bias_table", (2 * win[0] - 1) * (2 * win[1] - 1) * (2 * win[2] - 1), heads)
                s[f"{q}.attn.relative_position_index"] = _index(win)
                t(f"{q}.attn.qkv_self.weight", 3 * dim, dim), t(f"{q}.attn.qkv_self.bias", 3 * dim)
                t(f"{q}.attn.proj.weight", dim, dim), t(f"{q}.attn.proj.bias", dim)
                t(f"{q}.norm2.weight", dim), t(f"{q}.norm2.bias", dim)
                t(f"{q}.mlp.fc1.weight", 2 * dim, dim), t(f"{q}.mlp.fc1.bias", 2 * dim)
                t(f"{q}.mlp.fc2.weight", dim, 2 * dim), t(f"{q}.mlp.fc2.bias", dim)
            t(f"{p}.main.5.{b}.linear.weight", dim, dim), t(f"{p}.main.5.{b}.linear.bias", dim)
        t(f"{p}.main.7.weight", dim), t(f"{p}.main.7.bias", dim)

    rstb_with_input_conv("feat_extract", 3, blocks[0], (1, *window[1:]))
    for i, name in enumerate(BRANCHES):
        p = f"deform_align.{name}"
        t(f"{p}.conv_offset.0.weight", 64, dim * 3 + 4, 1, 1, 1), t(f"{p}.conv_offset.0.bias", 64)
        for j in (2, 4, 6, 8):
            t(f"{p}.conv_offset.{j}.weight", 64, 64, 1, 3, 3), t(f"{p}.conv_offset.{j}.bias", 64)
        t(f"{p}.conv_offset.10.weight", 2 * groups * k * 2, 64, 1, 1, 1), t(f"{p}.conv_offset.10.bias", 2 * groups * k * 2)
        for proj in ("proj_q", "proj_k", "proj_v"):
            t(f"{p}.{proj}.1.weight", 2 * dim, dim), t(f"{p}.{proj}.1.bias", 2 * dim)
        t(f"{p}.proj.1.weight", dim, 2 * dim), t(f"{p}.proj.1.bias", dim)
        t(f"{p}.mlp.1.fc1.weight", 2 * dim, dim), t(f"{p}.mlp.1.fc1.bias", 2 * dim)
        t(f"{p}.mlp.1.fc2.weight", dim, 2 * dim), t(f"{p}.mlp.1.fc2.bias", dim)
        rstb_with_input_conv(f"backbone.{name}", (2 + i) * dim, blocks[1], window)
    rstb_with_input_conv("reconstruction", 5 * dim, blocks[2], (1, *window[1:]))
    t("conv_before_upsampler.0.weight", 64, dim, 1, 1, 1), t("conv_before_upsampler.0.bias", 64)
    for j in (0, 5):  # Upsample(4): (Conv3d, Rearrange, PixelShuffle, Rearrange, LeakyReLU) x 2, Conv3d
        t(f"upsampler.{j}.weight", 256, 64, 1, 3, 3), t(f"upsampler.{j}.bias", 256)
    t("upsampler.10.weight", 64, 64, 1, 3, 3), t("upsampler.10.bias", 64)
    t("conv_last.weight", 3, 64, 1, 3, 3), t("conv_last.bias", 3)
    return s


def _parameters(state):
    return sum(v.numel() for k, v in state.items() if not k.endswith(("relative_position_index", ".mean", ".std")))


def test_the_published_paper_size_checkpoint_has_the_papers_parameter_count_and_loads(tmp_path):
    state = kair_rvrt()
    assert round(_parameters(state) / 1e6, 1) == 10.8  # the RVRT paper's 10.8M (and FedVSR's Table 1)
    torch.save({"params": state}, tmp_path / "rvrt.pth")
    model = make({})
    assert sum(p.numel() for p in model.parameters()) == _parameters(state) == 10_782_295
    load_checkpoint(model, tmp_path / "rvrt.pth", "kair")
    own = model.state_dict()
    assert all(torch.equal(own[k], state[k]) for k in own)


def test_a_kair_rvrt_checkpoint_loads_every_key_in_its_place(tmp_path):
    state = kair_rvrt(dim=24, heads=2, groups=4)  # the published layout at a small width
    torch.save({"params": state}, tmp_path / "rvrt.pth")
    params = {"embed_dims": [24, 24, 24], "num_heads": [2, 2, 2], "deformable_groups": 4, "attention_heads": 12}
    model = make(params)
    loaded = load_checkpoint(model, tmp_path / "rvrt.pth", "kair")
    own = model.state_dict()
    assert set(loaded) == set(own)  # every model key given, no checkpoint key left over (but the constants)
    dropped = set(state) - set(own)
    assert dropped and all(k.endswith(("relative_position_index", "spynet.mean", "spynet.std")) for k in dropped)
    assert all(torch.equal(own[k], state[k]) for k in own)
    # the constants the release holds are the model's own
    assert torch.equal(model.spynet.mean, state["spynet.mean"])
    bufs = dict(model.named_buffers())
    assert all(torch.equal(bufs[k], state[k]) for k in dropped if k.endswith("relative_position_index"))


def test_a_wrong_index_or_another_architecture_is_named(tmp_path):
    state = kair_rvrt(dim=8, heads=2, groups=4)
    key = "backbone.forward_1.main.5.0.residual_group.blocks.1.attn.relative_position_index"
    state[key] = state[key].flip(0)
    torch.save(state, tmp_path / "bad.pth")
    params = {"embed_dims": [8, 8, 8], "num_heads": [2, 2, 2], "deformable_groups": 4, "attention_heads": 2}
    with pytest.raises(ValueError, match=f"bad.pth: {key} is not the relative position index"):
        load_checkpoint(make(params), tmp_path / "bad.pth", "kair")
    torch.save({"conv1.weight": torch.zeros(1)}, tmp_path / "other.pth")
    with pytest.raises(ValueError, match="other.pth: not a KAIR RVRT state dict"):
        load_checkpoint(make(params), tmp_path / "other.pth", "kair")


def test_the_spynet_the_release_trains_from_loads_into_spynet_alone(tmp_path):
    state = {k[len("spynet."):]: v for k, v in kair_rvrt(dim=8, heads=2, groups=4).items() if k.startswith("spynet.")}
    torch.save({"params": state}, tmp_path / "spynet_sintel_final-3d2a1287.pth")
    model = make({"embed_dims": [8, 8, 8], "num_heads": [2, 2, 2], "deformable_groups": 4, "attention_heads": 2})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loaded = load_checkpoint(model, tmp_path / "spynet_sintel_final-3d2a1287.pth", "kair", strict=False)
    assert set(loaded) == {k for k in before if k.startswith("spynet.")}
    own = model.state_dict()
    assert all(torch.equal(own[k], state[k[len("spynet."):]]) for k in loaded)
    assert all(torch.equal(own[k], before[k]) for k in own if k not in loaded)


# -- guided deformable attention -------------------------------------------------------------------------------------


def _bilinear(img, y, x):
    """``dmcn_im2col_bilinear`` with the kernel's bounds check, one channel ``[H, W]``, one position."""
    h, w = img.shape
    if not (y > -1 and x > -1 and y < h and x < w):
        return 0.0
    y0, x0 = math.floor(y), math.floor(x)
    ly, lx = y - y0, x - x0

    def at(i, j):
        return float(img[i, j]) if 0 <= i < h and 0 <= j < w else 0.0

    return ((1 - ly) * (1 - lx) * at(y0, x0) + (1 - ly) * lx * at(y0, x0 + 1) + ly * (1 - lx) * at(y0 + 1, x0)
            + ly * lx * at(y0 + 1, x0 + 1))


def loop_deform_attn(q, kv, offset, kernel, heads, groups):
    """A loop transcription of ``deform_attn_cuda_forward``: query ``b`` (batch ``b // clip``, frame
    ``b % clip``) reads set ``n`` from kv frame ``(n + b) % clip`` at ``y - kh//2 + i + dy``,
    ``x - kh//2 + j + dx`` with the offsets of its channel's group; softmax over the clip * K samples per head."""
    nb, clip, c2, h, w = kv.shape
    c, (kh, kw) = c2 // 2, kernel
    kk, per_group, d = kh * kw, c2 // groups, c // heads
    off = offset.view(nb * clip, clip, groups, kk, 2, h, w)
    out = torch.zeros(nb * clip, c, h, w, dtype=torch.float64)
    for b in range(nb * clip):
        for y in range(h):
            for x in range(w):
                cols = torch.zeros(clip, c2, kk, dtype=torch.float64)
                for n in range(clip):
                    frame = kv[b // clip, (n + b) % clip]
                    for ch in range(c2):
                        g = ch // per_group
                        for i in range(kh):
                            for j in range(kw):
                                dy, dx = off[b, n, g, i * kw + j, :, y, x].tolist()
                                cols[n, ch, i * kw + j] = _bilinear(frame[ch], y - kh // 2 + i + dy, x - kh // 2 + j + dx)
                for e in range(heads):
                    keys = cols[:, e * d:(e + 1) * d].permute(1, 0, 2).reshape(d, -1)
                    vals = cols[:, c + e * d:c + (e + 1) * d].permute(1, 0, 2).reshape(d, -1)
                    attn = ((q[b, e * d:(e + 1) * d, y, x].double() * d**-0.5) @ keys).softmax(-1)
                    out[b, e * d:(e + 1) * d, y, x] = vals @ attn
    return out


def test_deform_attn_is_the_kernels_sampling_rule_with_fractional_offsets_and_borders():
    gen = torch.Generator().manual_seed(0)
    nb, clip, c, h, w, heads, groups = 1, 2, 4, 3, 4, 2, 4
    kv = torch.randn(nb, clip, 2 * c, h, w, generator=gen, dtype=torch.float64)
    q = torch.randn(nb * clip, c, h, w, generator=gen, dtype=torch.float64)
    # fractional offsets up to 2.5 pixels: samples inside, partly outside (in (-1, 0) and (H-1, H)) and beyond
    offset = (torch.rand(nb * clip, clip * groups * 9 * 2, h, w, generator=gen, dtype=torch.float64) - 0.5) * 5
    got = deform_attn(q, kv, offset, (3, 3), heads, groups)
    torch.testing.assert_close(got, loop_deform_attn(q, kv, offset, (3, 3), heads, groups), atol=1e-12, rtol=1e-10)


def _neighbourhoods(frame, kernel, dy=0, dx=0):
    """``[C, H, W]`` -> ``[C, K, H, W]``: for every pixel, the kh x kw neighbourhood of the pixel moved by (dy, dx),
    zeros outside the frame (slices of a zero-padded copy)."""
    c, h, w = frame.shape
    kh, kw = kernel
    m = max(kh, kw) + abs(dy) + abs(dx)
    padded = F.pad(frame, (m, m, m, m))
    tops = [m - kh // 2 + i + dy for i in range(kh)]
    lefts = [m - kw // 2 + j + dx for j in range(kw)]
    return torch.stack([padded[:, top:top + h, left:left + w] for top in tops for left in lefts], 1)


def plain_attention(q, kv, kernel, heads, dy=0, dx=0):
    """Constant offsets (dy, dx): per head, softmax attention of each query pixel over the kh x kw neighbourhoods
    (moved by the offset) of the previous clip's frames (frame ``(n + j) mod clip`` for set n)."""
    nb, clip, c2, h, w = kv.shape
    c, d = c2 // 2, c2 // 2 // heads
    out = torch.empty(nb * clip, c, h, w, dtype=q.dtype)
    for b in range(nb):
        for j in range(clip):
            nbhd = torch.stack([_neighbourhoods(kv[b, (n + j) % clip], kernel, dy, dx) for n in range(clip)])
            keys = nbhd[:, :c].reshape(clip, heads, d, -1, h, w)
            vals = nbhd[:, c:].reshape(clip, heads, d, -1, h, w)
            qq = q[b * clip + j].view(heads, d, h, w) * d**-0.5
            logits = torch.einsum("edyx,nedkyx->eyxnk", qq, keys).flatten(-2)
            logits = logits.softmax(-1).unflatten(-1, (clip, keys.shape[3]))
            out[b * clip + j] = torch.einsum("eyxnk,nedkyx->edyx", logits, vals).reshape(c, h, w)
    return out


@pytest.mark.parametrize("kernel", [(1, 1), (3, 3)])
def test_with_zero_offsets_it_is_plain_attention_over_the_neighbourhoods(kernel):
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 2, 12, 5, 6, generator=gen, dtype=torch.float64)
    q = torch.randn(4, 6, 5, 6, generator=gen, dtype=torch.float64)
    k = kernel[0] * kernel[1]
    got = deform_attn(q, kv, torch.zeros(4, 2 * 3 * k * 2, 5, 6, dtype=torch.float64), kernel, heads=3, groups=3)
    torch.testing.assert_close(got, plain_attention(q, kv, kernel, heads=3), atol=1e-12, rtol=1e-10)


def test_integer_offsets_read_shifted_features():
    gen = torch.Generator().manual_seed(2)
    kv = torch.randn(1, 2, 8, 6, 7, generator=gen, dtype=torch.float64)
    q = torch.randn(2, 4, 6, 7, generator=gen, dtype=torch.float64)
    dy, dx = 2, -1
    offset = torch.zeros(2, 2, 2, 9, 2, 6, 7, dtype=torch.float64)  # [query, set, group, K, (dy, dx), H, W]
    offset[..., 0, :, :], offset[..., 1, :, :] = dy, dx
    got = deform_attn(q, kv, offset.flatten(1, 4), (3, 3), heads=2, groups=2)
    torch.testing.assert_close(got, plain_attention(q, kv, (3, 3), heads=2, dy=dy, dx=dx), atol=1e-12, rtol=1e-10)


def test_an_untrained_gda_samples_along_the_flows_and_returns_them():
    torch.manual_seed(0)
    gda = GuidedDeformAttn(8, heads=2, groups=4).double()
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 8, 5, 5, generator=gen, dtype=torch.float64) for _ in range(3))
    flows = [torch.randn(1, 2, 2, 5, 5, generator=gen, dtype=torch.float64) for _ in range(2)]
    _, f1, f2 = gda(q, k, v, [v, v], flows)
    # the offset net's last convolution starts at zero: the offsets are the flows (x, y) -> (dy, dx), unchanged
    torch.testing.assert_close(f1, flows[0]), torch.testing.assert_close(f2, flows[1])


# -- the model -------------------------------------------------------------------------------------------------------


def test_registered_for_video_sr():
    assert MODELS.get("rvrt").task_family == "video_sr"


@pytest.mark.parametrize("frames", [1, 2, 3, 5])
@pytest.mark.parametrize("scale,h,w", [(4, 8, 8), (2, 7, 9), (3, 5, 6)])
def test_any_frame_count_scale_and_size(frames, scale, h, w):
    model = make(scale=scale)
    with torch.no_grad():
        out = model(torch.rand(1, frames, 3, h, w))
    assert out.shape == (1, frames, 3, h * scale, w * scale) and torch.isfinite(out).all()


def test_gradients_reach_every_parameter_and_the_first_frame_sees_the_last():
    model = make()
    x = torch.rand(1, 4, 3, 8, 8)
    out = model(x)
    out.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    # only the layers before a zero-initialised last layer (SPyNet's levels, GDA's offset net) start without gradient
    zero = [n for n, p in model.named_parameters() if p.grad.abs().sum() == 0]
    assert all(re.match(r"(spynet\.basic_module\.\d\.basic_module\.[0246]|deform_align\.\w+\.conv_offset\.[02468])\.", n)
               for n in zero), zero
    assert all(model.deform_align[b].conv_offset[10].weight.grad.abs().sum() > 0 for b in BRANCHES)
    y = x.clone()
    y[:, 3] += 0.5
    with torch.no_grad():
        assert (model(x)[:, 0] - model(y)[:, 0]).abs().max() > 1e-6


def test_an_odd_clip_is_the_mirror_extended_clip_cut_back():
    model = make()
    x = torch.rand(1, 3, 3, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(torch.cat([x, x[:, -1:]], 1))[:, :3])


def test_bad_scale_input_and_sizes_are_one_line_errors():
    with pytest.raises(ValueError, match="rvrt: scale 5 is not supported"):
        make(scale=5)
    with pytest.raises(ValueError, match=r"rvrt expects LR clips \[B, T, 3, h, w\]"):
        make()(torch.rand(1, 3, 8, 8))
    with pytest.raises(ValueError, match="embed_dims: the feature and propagation channels must be equal"):
        make({**TINY, "embed_dims": [8, 16, 8]})
    with pytest.raises(ValueError, match="attention_heads must divide"):
        make({**TINY, "attention_heads": 3})


# -- numerical equivalence with the reference ------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "fixtures" / "golden" / "kair_rvrt_small.safetensors"


def test_with_seeded_weights_it_gives_the_reference_implementations_output():
    """``benchmarks/golden_rvrt.py`` ran the authors' ``network_rvrt.py`` (GDA by this plain kernel, which the
    tests above check against the CUDA kernel's rule) on a fixed clip with seeded weights: the same weights in
    FedSight's model give the same output."""
    if not GOLDEN.is_file():
        pytest.skip(f"no fixture {GOLDEN.relative_to(ROOT)}: run `python benchmarks/golden_rvrt.py --reference DIR` "
                    "with DIR a checkout of JingyunLiang/RVRT")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from golden_weights import seeded_state

    with safe_open(str(GOLDEN), "pt") as f:
        meta = f.metadata()
        x, want, sums = f.get_tensor("input"), f.get_tensor("output"), f.get_tensor("sums")
    model = make(json.loads(meta["params"])).double().eval()
    state = {k: v.double() for k, v in seeded_state(json.loads(meta["shapes"])).items()}
    assert set(state) == {k for k, _ in model.named_parameters()}
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        out = model(x)
    torch.testing.assert_close(out[..., ::4, ::4], want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out.sum((-2, -1)), sums, rtol=1e-9, atol=1e-7)


def test_a_bfloat16_model_runs_in_bfloat16():
    """(The shifted windows' mask is float32: added as it is, it turned the attention to float32.)"""
    model = make().to(torch.bfloat16)
    with torch.no_grad():
        out = model(torch.rand(1, 3, 3, 8, 8).to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
