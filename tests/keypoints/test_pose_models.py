"""Tests for the keypoint models (``fedsight.models.pose``): SimpleBaseline and ViTPose with ResFormer's GPE/LPE.

Heatmap shapes over RAF's resolution ladders, the size check, the LPE's zero initialisation, the GPE's position
awareness (a ViT without position embeddings is permutation-equivariant over patches), the sine-cosine formula,
gradients reaching every parameter, batch size 1, declared capabilities, and parameter counts against hand
arithmetic and published totals.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedsight.capabilities import resolve
from fedsight.models import build_model
from fedsight.models.base import detect_capabilities
from fedsight.models.pose import IMAGENET_MEAN, Attention, sincos_2d
from fedsight.registry import MODELS

J = 4  # joints
#: small configurations: the point of these tests is shapes and structure, not capacity
SB = {"width": 8, "deconv_filters": 16}
VIT16 = {"patch": 16, "dim": 32, "depth": 1, "heads": 2, "deconv_filters": 16}
VIT8 = {**VIT16, "patch": 8}

LADDER_16 = [(256, 192), (192, 144), (128, 96), (320, 240), (384, 288)]  # RAF's ladder and unseen sizes
LADDER_CPU = [(128, 96), (96, 72), (64, 48)]  # the CPU-sized ladder (patch 8)


def make(name: str, params: dict | None = None, seed: int = 0, **io):
    torch.manual_seed(seed)
    return build_model(name, params or {}, num_outputs=J, in_channels=3, **io)


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# -- shapes and sizes ----------------------------------------------------------------------------------------

SHAPE_CASES = (
    [("simplebaseline", SB, hw) for hw in LADDER_16 + LADDER_CPU[1:]]
    + [("vitpose", VIT16, hw) for hw in LADDER_16]
    + [("vitpose", {**VIT16, "head": "simple"}, hw) for hw in LADDER_16[:3]]
    + [("vitpose", VIT8, hw) for hw in LADDER_CPU]
    + [("vitpose", {**VIT8, "head": "simple"}, hw) for hw in LADDER_CPU]
)


@pytest.fixture(scope="module")
def models():
    cache: dict = {}

    def get(name, params):
        key = (name, tuple(sorted(params.items())))
        if key not in cache:
            cache[key] = make(name, params).eval()
        return cache[key]

    return get


@pytest.mark.parametrize("name,params,hw", SHAPE_CASES, ids=[f"{n}-{p.get('patch', '')}{p.get('head', '')}-{h}x{w}"
                                                             for n, p, (h, w) in SHAPE_CASES])
def test_heatmaps_are_a_quarter_of_every_ladder_size(models, name, params, hw):
    m = models(name, params)
    h, w = hw
    with torch.no_grad():
        out = m(torch.rand(2, 3, h, w))
    assert tuple(out.shape) == (2, J, h // 4, w // 4)
    assert torch.isfinite(out).all()
    assert h % m.stride_multiple == 0 and w % m.stride_multiple == 0 and m.output_stride == 4


@pytest.mark.parametrize("name,params,hw,multiple", [
    ("vitpose", VIT16, (96, 72), 16),
    ("vitpose", VIT16, (256, 200), 16),
    ("vitpose", VIT8, (100, 72), 8),
    ("simplebaseline", SB, (130, 96), 4),
    ("simplebaseline", {**SB, "crop": False}, (192, 144), 32),
])
def test_a_size_that_is_not_a_multiple_is_refused_naming_the_multiple(name, params, hw, multiple):
    m = make(name, params)
    assert m.stride_multiple == multiple
    with pytest.raises(ValueError, match=f"multiples of {multiple}"):
        m(torch.rand(1, 3, *hw))
    with pytest.raises(ValueError, match=r"\[B, C, H, W\]"):
        m(torch.rand(3, *hw))


def test_simplebaseline_crop_keeps_the_top_left_quarter_grid():
    """Without the crop the model needs multiples of 32; with it, a 192x144 input runs at its own size and the
    8 ceil(H/32)-row heatmaps are cut to H/4 from the top left; at multiples of 32 both agree exactly."""
    crop, plain = make("simplebaseline", SB).eval(), make("simplebaseline", {**SB, "crop": False}).eval()
    plain.load_state_dict(crop.state_dict())
    assert crop.split_head is False and plain.split_head is True
    x = torch.rand(2, 3, 192, 144)
    with torch.no_grad():
        full = crop.head(crop.features(x))
        assert tuple(full.shape[-2:]) == (48, 40)  # 8 * ceil(144 / 32) = 40 columns
        assert torch.equal(crop(x), full[..., :48, :36])
        x32 = torch.rand(2, 3, 128, 96)
        assert torch.equal(crop(x32), plain(x32))


# -- ViT position embeddings ---------------------------------------------------------------------------------


def test_sincos_embedding_matches_the_formula_on_a_3x4_grid():
    h, w, dim, temp = 3, 4, 16, 10000.0
    pos = sincos_2d(h, w, dim, temp)
    assert tuple(pos.shape) == (dim, h, w)
    half = dim // 2

    def expected(c: int, i: int, j: int) -> float:
        # ResFormer / DETR: coordinate (index + 1) / n * 2 pi; channel pair k // 2 has frequency T^(2 (k // 2) / half);
        # even channels sin, odd cos; the first half encodes the row, the second the column
        coord, k = ((i + 1) / h * 2 * math.pi, c) if c < half else ((j + 1) / w * 2 * math.pi, c - half)
        a = coord / temp ** (2 * (k // 2) / half)
        return math.sin(a) if k % 2 == 0 else math.cos(a)

    for c, i, j in [(0, 0, 0), (0, 2, 1), (3, 1, 3), (5, 2, 0), (8, 0, 1), (13, 2, 3), (15, 1, 2)]:
        assert pos[c, i, j].item() == pytest.approx(expected(c, i, j), abs=1e-5), (c, i, j)
    # rows carry no column information and vice versa
    assert torch.equal(pos[:half, :, 0:1].expand(-1, -1, w), pos[:half])
    assert torch.equal(pos[half:, 0:1, :].expand(-1, h, -1), pos[half:])


def lpe_keys(model: nn.Module) -> list[str]:
    return [k for k in model.state_dict() if ".attn.lpe." in k]


def test_lpe_starts_at_zero_and_changes_the_output_once_trained():
    vit = {**VIT16, "depth": 2}
    with_lpe = make("vitpose", {**vit, "lpe": True}).eval()
    without = make("vitpose", {**vit, "lpe": False}, seed=1).eval()
    keys = lpe_keys(with_lpe)
    assert len(keys) == 2 * 2 and not lpe_keys(without)  # weight and bias in each of the 2 blocks
    without.load_state_dict({k: v for k, v in with_lpe.state_dict().items() if k not in keys})  # strict
    x = torch.rand(2, 3, 64, 48)
    with torch.no_grad():
        torch.testing.assert_close(with_lpe(x), without(x), rtol=0, atol=0)
        for k in keys:
            with_lpe.state_dict()[k].normal_(0, 0.5)
        assert (with_lpe(x) - without(x)).abs().max() > 1e-3 * without(x).abs().max()


def test_attention_and_lpe_against_a_written_out_computation():
    """One attention on a 4x3 grid (non-square: rows and columns must not be swapped): qkv split as
    [q | k | v] with head n on channels n hd .. (n + 1) hd, softmax(q k^T / sqrt(hd)) v, plus the LPE, a
    depth-wise conv on each head's V over the grid; here a kernel that copies the left neighbour for channel 0,
    the upper neighbour for channel 1 (zero padding), plus a bias."""
    torch.manual_seed(0)
    d, heads, hd, (h, w) = 8, 2, 4, (4, 3)
    attn = Attention(d, heads, lpe=True)
    with torch.no_grad():
        attn.lpe.weight.zero_()
        attn.lpe.weight[0, 0, 1, 0] = 1.0  # out(i, j) = in(i, j - 1)
        attn.lpe.weight[1, 0, 0, 1] = 1.0  # out(i, j) = in(i - 1, j)
        attn.lpe.bias.copy_(torch.arange(hd, dtype=torch.float32))
    x = torch.randn(2, h * w, d)
    with torch.no_grad():
        out = attn(x, (h, w))
        qkv = x @ attn.qkv.weight.T + attn.qkv.bias
        heads_out = []
        for n in range(heads):
            q, k, v = (qkv[..., s * d + n * hd: s * d + (n + 1) * hd] for s in range(3))
            a = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd), dim=-1) @ v
            grid = v.reshape(2, h, w, hd)  # token t = i w + j
            lpe = torch.zeros_like(grid) + attn.lpe.bias
            lpe[:, :, 1:, 0] += grid[:, :, :-1, 0]
            lpe[:, 1:, :, 1] += grid[:, :-1, :, 1]
            heads_out.append(a + lpe.reshape(2, h * w, hd))
        want = torch.cat(heads_out, dim=-1) @ attn.proj.weight.T + attn.proj.bias
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def permute_patches(x: torch.Tensor, p: int, perm: torch.Tensor) -> torch.Tensor:
    """The image whose k-th p x p patch (row-major) is patch ``perm[k]`` of ``x``."""
    b, c, hh, ww = x.shape
    h, w = hh // p, ww // p
    patches = x.reshape(b, c, h, p, w, p).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w, c, p, p)[:, perm]
    return patches.reshape(b, h, w, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, hh, ww)


@pytest.mark.parametrize("pe,equivariant", [
    ({"gpe": False, "lpe": False}, True),
    ({"gpe": False, "lpe": True}, True),  # LPE starts at zero: no position information yet
    ({"gpe": False, "lpe": "perturbed"}, False),
    ({"gpe": True, "lpe": False}, False),
    ({"gpe": False, "lpe": False, "ape": True, "ape_grid": [4, 3]}, False),
])
def test_position_embeddings_break_permutation_equivariance(pe, equivariant):
    """Without position embeddings a ViT treats its tokens as a set: permuting the patches permutes the features.
    GPE, APE and a non-zero LPE each make the features depend on where a patch is."""
    lpe = pe["lpe"]
    m = make("vitpose", {**VIT16, "depth": 2, **pe, "lpe": bool(lpe)}).eval()
    if lpe == "perturbed":
        with torch.no_grad():
            for k in lpe_keys(m):
                m.state_dict()[k].normal_(0, 0.5)
    x = torch.rand(2, 3, 64, 48)
    perm = torch.randperm(4 * 3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        f = m.features(x).flatten(2)
        fp = m.features(permute_patches(x, 16, perm)).flatten(2)
    err = (fp - f[:, :, perm]).abs().max().item()
    if equivariant:
        assert err < 1e-4
    else:
        assert err > 1e-2


def test_ape_needs_a_grid_and_is_resized_to_other_grids():
    with pytest.raises(ValueError, match="ape_grid"):
        make("vitpose", {**VIT16, "ape": True})
    m = make("vitpose", {**VIT16, "ape": True}, image_size=64).eval()
    assert tuple(m.backbone.ape.shape) == (1, 32, 4, 4) and "backbone.ape" in m.parameter_groups()["backbone"]
    with torch.no_grad():
        assert tuple(m(torch.rand(1, 3, 128, 96)).shape) == (1, J, 32, 24)


# -- gradients, modes, capabilities ----------------------------------------------------------------------------


@pytest.mark.parametrize("name,params", [
    ("simplebaseline", SB),
    ("simplebaseline", {**SB, "depth": 50, "width": 4, "norm": "group"}),
    ("vitpose", {**VIT16, "depth": 2}),
    ("vitpose", {**VIT8, "ape": True, "ape_grid": [8, 6], "head": "simple"}),
])
def test_backward_reaches_every_parameter(name, params):
    m = make(name, params).train()
    out = m(torch.rand(2, 3, 64, 48))
    (out * torch.randn_like(out)).sum().backward()
    for k, prm in m.named_parameters():
        assert prm.grad is not None and prm.grad.abs().sum() > 0, k


@pytest.mark.parametrize("name,params", [("simplebaseline", SB), ("vitpose", VIT16), ("vitpose", VIT8)])
def test_batch_of_one_in_train_and_eval_mode(name, params):
    """BatchNorm in training mode needs more than one value per channel; at 64x48 the smallest map
    (SimpleBaseline's stride-32 map, 2x2; ViTPose's head input) still has several."""
    m = make(name, params)
    x = torch.rand(1, 3, 64, 48)
    m.train()
    assert tuple(m(x).shape) == (1, J, 16, 12)
    m.eval()
    with torch.no_grad():
        assert tuple(m(x).shape) == (1, J, 16, 12)


def test_drop_path_is_random_in_training_only():
    m = make("vitpose", {**VIT16, "depth": 2, "drop_path": 0.5})
    x = torch.rand(4, 3, 64, 48)
    m.train()
    torch.manual_seed(1)
    a = m.features(x)
    torch.manual_seed(2)
    assert not torch.allclose(a, m.features(x))
    m.eval()
    with torch.no_grad():
        assert torch.equal(m.features(x), m.features(x))


@pytest.mark.parametrize("name,params", [
    ("simplebaseline", SB), ("simplebaseline", {**SB, "norm": "group"}),
    ("vitpose", VIT16), ("vitpose", {**VIT16, "norm": "group"}), ("vitpose", {**VIT16, "head": "simple"}),
    ("vitpose", {**VIT16, "patch": 4}),  # no deconvolution: no BatchNorm
])
def test_declared_capabilities_are_the_built_models(name, params):
    entry = MODELS.get(name)
    m = make(name, params)
    assert resolve(entry.provides, entry.params(**params)) == detect_capabilities(m)
    assert "linear_head" not in detect_capabilities(m)


def test_input_normalisation_is_a_constant_not_state():
    for name, params in [("simplebaseline", SB), ("vitpose", VIT16)]:
        m = make(name, params)
        assert not [k for k in m.state_dict() if "normalize" in k]
        mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1).expand(1, 3, 8, 8)
        assert m.backbone.normalize(mean).abs().max() < 1e-6


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="divisible by heads"):
        make("vitpose", {**VIT16, "heads": 3})
    with pytest.raises(ValueError, match="number of joints"):
        build_model("vitpose", VIT16, num_outputs=0)


# -- parameter counts ------------------------------------------------------------------------------------------


def test_simplebaseline_resnet50_has_the_papers_34m_parameters():
    """ResNet-50 trunk = torchvision's resnet50 (25,557,032) without its 2048x1000 + 1000 classifier; head: deconvs
    2048 -> 256 and 2 x 256 -> 256 (4x4, no bias), 3 BatchNorms, 1x1 conv to 17 joints. 34.0M in the paper."""
    with torch.device("meta"):
        m = build_model("simplebaseline", {"depth": 50, "width": 64, "deconv_filters": 256}, num_outputs=17)
        r18 = build_model("simplebaseline", {"depth": 18, "width": 64, "deconv_filters": 256}, num_outputs=17)
    head = 2048 * 256 * 16 + 2 * 256 * 256 * 16 + 3 * 2 * 256 + 256 * 17 + 17
    assert n_params(m.backbone) == 25_557_032 - (2048 * 1000 + 1000)
    assert n_params(m.head) == head and n_params(m) == 33_999_697
    # ResNet-18 trunk = torchvision's resnet18 (11,689,512) without its 512x1000 + 1000 classifier
    assert n_params(r18.backbone) == 11_689_512 - (512 * 1000 + 1000)


def test_vitpose_small_parameter_count():
    """ViT-S (D = 384, 12 blocks of 12 D^2 + 13 D, 12 heads of 32 channels) with GPE and LPE instead of the
    absolute embedding, and ViTPose's two-deconvolution head with 256 filters for 17 joints."""
    d, depth, hd, p = 384, 12, 32, 16
    with torch.device("meta"):
        m = build_model("vitpose", {"dim": d, "depth": depth, "heads": 12, "deconv_filters": 256}, num_outputs=17)
    backbone = (3 * p * p * d + d) + (9 * d + d) + depth * (12 * d * d + 13 * d + 9 * hd + hd) + 2 * d
    head = d * 256 * 16 + 256 * 256 * 16 + 2 * 2 * 256 + 256 * 17 + 17
    assert n_params(m.backbone) == backbone == 21_597_312
    assert n_params(m.head) == head
