"""Tests of fedsight.functional.keypoints against independent references.

References: numpy ports of SimpleBaseline (microsoft/human-pose-estimation.pytorch) ``get_affine_transform``,
``generate_target``, ``get_max_preds``/``get_final_preds``, ``flip_back``; a per-pixel numpy bilinear sampler;
pycocotools run the standard way (JSON files on disk); hand-computed PCKh fixtures and closed-form OKS.
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from fedsight.functional.keypoints import (
    COCO_SIGMAS,
    MPII_FLIP_PAIRS,
    MPII_PCKH_EXCLUDE,
    MPII_SIGMAS,
    crop_affine,
    decode_heatmaps,
    fix_aspect,
    flip_heatmaps,
    flip_joints,
    gaussian_heatmaps,
    invert_affine,
    oks,
    oks_ap,
    pck_hits,
    pckh_summary,
    transform_points,
    warp_crop,
    warp_crops,
)

D = torch.float64
angles = st.floats(-180, 180)


# ------------------------------------------------------------------------------------------ references


def _sb_affine(center, src_w, rot, out_wh):
    """SimpleBaseline lib/utils/transforms.py get_affine_transform (shift 0), solved as cv2.getAffineTransform."""
    dst_w, dst_h = out_wh
    r = np.pi * rot / 180

    def get_dir(p):
        sn, cs = np.sin(r), np.cos(r)
        return np.array([p[0] * cs - p[1] * sn, p[0] * sn + p[1] * cs])

    def third(a, b):
        d = a - b
        return b + np.array([-d[1], d[0]])

    src = [np.asarray(center, float), np.asarray(center, float) + get_dir([0, src_w * -0.5])]
    dst = [np.array([dst_w * 0.5, dst_h * 0.5]), np.array([dst_w * 0.5, dst_h * 0.5 + dst_w * -0.5])]
    src.append(third(*src))
    dst.append(third(*dst))
    p = np.hstack([np.array(src), np.ones((3, 1))])
    return np.linalg.solve(p, np.array(dst)).T


def _np_bilinear_warp(img, m, out_hw, fill):
    """Per-pixel reference: crop pixel (u, v) <- source point m^-1 (u, v), bilinear, constant padding."""
    c, hs, ws = img.shape
    inv = np.linalg.inv(np.vstack([m, [0, 0, 1]]))
    out = np.zeros((c, *out_hw))
    for v in range(out_hw[0]):
        for u in range(out_hw[1]):
            x, y, _ = inv @ np.array([u, v, 1.0])
            x0, y0 = math.floor(x), math.floor(y)
            fx, fy = x - x0, y - y0
            acc = np.zeros(c)
            for yy, wy in ((y0, 1 - fy), (y0 + 1, fy)):
                for xx, wx in ((x0, 1 - fx), (x0 + 1, fx)):
                    val = img[:, yy, xx] if (0 <= xx < ws and 0 <= yy < hs) else np.full(c, fill)
                    acc += wx * wy * val
            out[:, v, u] = acc
    return out


def _sb_generate_target(joints, vis, hw, sigma, subpixel=False):
    """SimpleBaseline JointsDataset.generate_target per joint; documented changes: floor for int(), br <= 0,
    draw when weight > 0; subpixel centres the Gaussian at the exact joint (mmpose UDP style)."""
    h, w = hw
    target = np.zeros((len(joints), h, w))
    weight = np.array(vis, dtype=float)
    tmp_size = sigma * 3
    for j, (x, y) in enumerate(joints):
        mu_x, mu_y = math.floor(x + 0.5), math.floor(y + 0.5)
        ul = [math.floor(mu_x - tmp_size), math.floor(mu_y - tmp_size)]
        br = [math.floor(mu_x + tmp_size + 1), math.floor(mu_y + tmp_size + 1)]
        if ul[0] >= w or ul[1] >= h or br[0] <= 0 or br[1] <= 0:
            weight[j] = 0
            continue
        size = 2 * tmp_size + 1
        gx = np.arange(0, size, 1, np.float64)
        gy = gx[:, None]
        x0 = y0 = size // 2
        if subpixel:
            x0, y0 = x0 + (x - mu_x), y0 + (y - mu_y)
        g = np.exp(-((gx - x0) ** 2 + (gy - y0) ** 2) / (2 * sigma**2))
        g_x = max(0, -ul[0]), min(br[0], w) - ul[0]
        g_y = max(0, -ul[1]), min(br[1], h) - ul[1]
        img_x = max(0, ul[0]), min(br[0], w)
        img_y = max(0, ul[1]), min(br[1], h)
        if weight[j] > 0:
            target[j][img_y[0]:img_y[1], img_x[0]:img_x[1]] = g[g_y[0]:g_y[1], g_x[0]:g_x[1]]
    return target, weight


def _sb_final_preds(hm):
    """SimpleBaseline lib/core/inference.py get_max_preds + the POST_PROCESS loop of get_final_preds."""
    n, j, h, w = hm.shape
    flat = hm.reshape(n, j, -1)
    idx = np.argmax(flat, 2)
    maxvals = np.amax(flat, 2)
    preds = np.stack([idx % w, np.floor(idx / w)], -1).astype(np.float64)
    preds *= (maxvals > 0)[..., None]
    for a in range(n):
        for p in range(j):
            px, py = math.floor(preds[a, p, 0] + 0.5), math.floor(preds[a, p, 1] + 0.5)
            if 1 < px < w - 1 and 1 < py < h - 1:
                m = hm[a, p]
                diff = np.array([m[py][px + 1] - m[py][px - 1], m[py + 1][px] - m[py - 1][px]])
                preds[a, p] += np.sign(diff) * 0.25
    return preds, maxvals


def _sb_flip_back(out, pairs, shift):
    """SimpleBaseline lib/utils/transforms.py flip_back + TEST.SHIFT_HEATMAP."""
    out = out[:, :, :, ::-1].copy()
    for a, b in pairs:
        tmp = out[:, a].copy()
        out[:, a] = out[:, b]
        out[:, b] = tmp
    if shift:
        out[:, :, :, 1:] = out.copy()[:, :, :, 0:-1]
    return out


# --------------------------------------------------------------------------------------------- geometry


@given(st.floats(10, 200), st.floats(10, 200), st.floats(20, 300), angles, st.sampled_from([(64, 48), (256, 192)]))
@settings(max_examples=30)
def test_crop_affine_is_simplebaseline_minus_half_pixel(cx, cy, sw, rot, out_hw):
    h, w = out_hw
    size = torch.tensor([[sw, sw * h / w]], dtype=D)
    ours = crop_affine(torch.tensor([[cx, cy]], dtype=D), size, torch.tensor([rot], dtype=D), out_hw)[0].numpy()
    ref = _sb_affine([cx, cy], sw, rot, (w, h))
    ref[:, 2] -= 0.5
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-9)


def test_crop_affine_rotation_is_counter_clockwise_and_box_fills_crop():
    h, w = 40, 30
    c = torch.tensor([[100.0, 50.0]], dtype=D)
    s = torch.tensor([[60.0, 80.0]], dtype=D)
    a0 = crop_affine(c, s, torch.tensor([0.0], dtype=D), (h, w))
    corners = torch.tensor([[[70.0, 10.0], [130.0, 90.0], [100.0, 50.0]]], dtype=D)
    expect = torch.tensor([[[-0.5, -0.5], [w - 0.5, h - 0.5], [(w - 1) / 2, (h - 1) / 2]]], dtype=D)
    torch.testing.assert_close(transform_points(corners, a0), expect)
    # 90 degrees: a point right of the centre ends up above the crop centre (content turned counter-clockwise)
    a90 = crop_affine(c, s, torch.tensor([90.0], dtype=D), (h, w))
    q = transform_points(torch.tensor([[[110.0, 50.0]]], dtype=D), a90)[0, 0]
    torch.testing.assert_close(q, torch.tensor([(w - 1) / 2, (h - 1) / 2 - 10 * h / 80], dtype=D))


@given(st.lists(st.tuples(st.floats(-50, 250), st.floats(-50, 250), st.floats(5, 400), st.floats(5, 400), angles),
                min_size=1, max_size=4),
       st.integers(4, 96), st.integers(4, 96))
@settings(max_examples=40)
def test_inverse_composes_to_identity(boxes, h, w):
    b = torch.tensor(boxes, dtype=D)
    fwd = crop_affine(b[:, :2], b[:, 2:4], b[:, 4], (h, w))
    inv = crop_affine(b[:, :2], b[:, 2:4], b[:, 4], (h, w), inverse=True)
    bottom = torch.tensor([[0.0, 0.0, 1.0]], dtype=D).expand(len(boxes), 1, 3)
    prod = torch.cat([inv, bottom], 1) @ torch.cat([fwd, bottom], 1)
    torch.testing.assert_close(prod, torch.eye(3, dtype=D).expand_as(prod), atol=1e-9, rtol=0)
    torch.testing.assert_close(invert_affine(fwd), inv, atol=1e-9, rtol=1e-9)
    pts = torch.rand(len(boxes), 5, 2, dtype=D) * 300
    torch.testing.assert_close(transform_points(transform_points(pts, fwd), inv), pts, atol=1e-8, rtol=0)


def test_fix_aspect():
    size = torch.tensor([[100.0, 100.0], [30.0, 100.0], [200.0, 40.0]])
    out = fix_aspect(size, 0.75)
    torch.testing.assert_close(out, torch.tensor([[100.0, 400 / 3], [75.0, 100.0], [200.0, 800 / 3]]))


@given(st.floats(0.5, 3.0), angles, st.floats(-0.3, 0.3), st.floats(-0.3, 0.3), st.floats(-2.0, 2.0))
@settings(max_examples=20)
def test_warp_crops_matches_per_pixel_bilinear_reference(scale, rot, ox, oy, fill):
    gen = torch.Generator().manual_seed(0)
    img = torch.rand(2, 3, 21, 17, generator=gen, dtype=D)
    out_hw = (9, 11)
    center = torch.tensor([[8.0 + ox * 17, 10.0 + oy * 21], [3.0, 4.0]], dtype=D)
    size = torch.tensor([[11 * scale, 9 * scale], [30.0, 24.0]], dtype=D)
    aff = crop_affine(center, size, torch.tensor([rot, -rot], dtype=D), out_hw)
    got = warp_crops(img, aff, out_hw, fill=fill)
    for i in range(2):
        ref = _np_bilinear_warp(img[i].numpy(), aff[i].numpy(), out_hw, fill)
        np.testing.assert_allclose(got[i].numpy(), ref, rtol=0, atol=1e-9)


def _blob(hw, x, y, sigma):
    ys, xs = torch.meshgrid(torch.arange(hw[0], dtype=D), torch.arange(hw[1], dtype=D), indexing="ij")
    return torch.exp(-((xs - x) ** 2 + (ys - y) ** 2) / (2 * sigma**2))


@given(st.floats(0.7, 2.5), angles, st.floats(-0.3, 0.3), st.floats(-0.3, 0.3), st.booleans())
@settings(max_examples=40)
def test_blob_lands_where_transform_points_says(scale, rot, fx, fy, antialias):
    out_hw = (48, 40)
    center = torch.tensor([[80.0, 75.0]], dtype=D)
    size = torch.tensor([[40 * scale, 48 * scale]], dtype=D)
    aff = crop_affine(center, size, torch.tensor([rot], dtype=D), out_hw)
    inv = crop_affine(center, size, torch.tensor([rot], dtype=D), out_hw, inverse=True)
    # a source point at crop offset (fx, fy) of the box from the crop centre
    q = torch.tensor([[[(40 - 1) / 2 + fx * 40, (48 - 1) / 2 + fy * 48]]], dtype=D)
    p = transform_points(q, inv)
    img = _blob((160, 160), p[0, 0, 0].item(), p[0, 0, 1].item(), 1.5 * max(1.0, scale))[None, None]
    crop = warp_crops(img, aff, out_hw, antialias=antialias)[0, 0]
    ys, xs = torch.meshgrid(torch.arange(48, dtype=D), torch.arange(40, dtype=D), indexing="ij")
    centroid = torch.stack([(crop * xs).sum(), (crop * ys).sum()]) / crop.sum()
    expect = transform_points(p, aff)[0, 0]
    assert torch.linalg.vector_norm(centroid - expect) < 0.1  # a half-pixel convention error would be 0.5+
    peak = int(crop.argmax())
    assert abs(peak % 40 - expect[0].item()) <= 1 and abs(peak // 40 - expect[1].item()) <= 1


@given(st.floats(1.6, 4.5), angles)
@settings(max_examples=20)
def test_antialias_is_centred_on_linear_images(factor, rot):
    # a box average of a linear image, centred on the crop pixel's source point, equals the value there
    hs = ws = 200
    ys, xs = torch.meshgrid(torch.arange(hs, dtype=D), torch.arange(ws, dtype=D), indexing="ij")
    img = (0.3 * xs - 0.7 * ys + 5)[None, None]
    out_hw = (12, 10)
    center = torch.tensor([[100.0, 100.0]], dtype=D)
    size = torch.tensor([[10 * factor, 12 * factor]], dtype=D)
    aff = crop_affine(center, size, torch.tensor([rot], dtype=D), out_hw)
    got = warp_crops(img, aff, out_hw, antialias=True)[0, 0]
    v, u = torch.meshgrid(torch.arange(12, dtype=D), torch.arange(10, dtype=D), indexing="ij")
    src = transform_points(torch.stack([u, v], -1).reshape(1, -1, 2), invert_affine(aff))[0]
    expect = (0.3 * src[:, 0] - 0.7 * src[:, 1] + 5).reshape(12, 10)
    torch.testing.assert_close(got, expect, atol=1e-9, rtol=0)


def test_antialias_removes_aliasing_of_a_checkerboard():
    ys, xs = torch.meshgrid(torch.arange(120), torch.arange(120), indexing="ij")
    img = ((xs + ys) % 2).to(torch.float32)[None, None]
    aff = crop_affine(torch.tensor([[59.5, 59.5]]), torch.tensor([[60.0, 60.0]]), torch.tensor([0.0]), (20, 20))
    plain = warp_crops(img, aff, (20, 20))
    smooth = warp_crops(img, aff, (20, 20), antialias=True)
    assert plain.std() > 0.4  # sampling every third pixel of a 1-px checkerboard: a full-contrast alias
    assert smooth.std() < 0.1 and abs(smooth.mean().item() - 0.5) < 0.05


def test_warp_crop_handles_images_of_different_sizes():
    gen = torch.Generator().manual_seed(1)
    images = [torch.rand(3, 30, 40, generator=gen), torch.rand(3, 50, 20, generator=gen)]
    aff = crop_affine(torch.tensor([[20.0, 15.0], [10.0, 25.0]]), torch.tensor([[16.0, 20.0], [12.0, 15.0]]),
                      torch.tensor([10.0, -30.0]), (10, 8))
    for i, img in enumerate(images):
        one = warp_crop(img, aff[i], (10, 8), antialias=True)
        batch = warp_crops(img[None], aff[i : i + 1], (10, 8), antialias=True)[0]
        assert one.shape == (3, 10, 8)
        torch.testing.assert_close(one, batch)


@given(st.floats(-60, 60), st.floats(0.5, 2.0))
@settings(max_examples=20)
def test_crop_of_flipped_image_is_flipped_crop(rot, scale):
    gen = torch.Generator().manual_seed(2)
    img = torch.rand(1, 2, 40, 50, generator=gen, dtype=D)
    cx, cy = 22.3, 19.7
    size = torch.tensor([[16 * scale, 20 * scale]], dtype=D)
    a = crop_affine(torch.tensor([[cx, cy]], dtype=D), size, torch.tensor([rot], dtype=D), (20, 16))
    af = crop_affine(torch.tensor([[50 - 1 - cx, cy]], dtype=D), size, torch.tensor([-rot], dtype=D), (20, 16))
    torch.testing.assert_close(warp_crops(img.flip(-1), af, (20, 16)), warp_crops(img, a, (20, 16)).flip(-1))


def test_flip_joints_matches_image_flip():
    img = torch.zeros(2, 1, 9, 13)
    joints = torch.tensor([[[3.0, 2.0, 1.0], [10.0, 7.0, 0.0]], [[0.0, 0.0, 1.0], [12.0, 8.0, 1.0]]])
    for n in range(2):
        for j in range(2):
            img[n, 0, int(joints[n, j, 1]), int(joints[n, j, 0])] = j + 1
    flipped = flip_joints(joints, 13, [(0, 1)])
    fimg = img.flip(-1)
    for n in range(2):
        for j in range(2):
            x, y = int(flipped[n, j, 0]), int(flipped[n, j, 1])
            assert fimg[n, 0, y, x] == 2 - j  # joint j of the flipped image is the mirrored joint 1 - j
    assert torch.equal(flipped[:, :, 2], joints[:, [1, 0], 2])


# --------------------------------------------------------------------------------------------- heatmaps


JOINTS = [(10.0, 12.0), (3.4, 5.6), (0.2, 31.7), (-3.0, 8.0), (-6.4, 4.0), (-6.6, 4.0), (30.0, -6.6),
          (23.5, 17.5), (30.6, 20.0), (31.4, 0.0), (37.4, 10.0), (37.6, 10.0), (12.0, 12.0), (40.0, 50.0),
          (22.5, 6.5)]  # halves round up, as int(x + 0.5), not to even


@pytest.mark.parametrize("sigma,subpixel", [(2.0, False), (2.0, True), (3.0, False), (1.5, False), (1.5, True)])
def test_gaussian_heatmaps_match_simplebaseline_loop(sigma, subpixel):
    hw = (32, 32)
    vis = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1]
    j = torch.tensor([JOINTS], dtype=D)
    hm, wt = gaussian_heatmaps(j, torch.tensor([vis], dtype=D), hw, sigma, subpixel=subpixel)
    ref, ref_w = _sb_generate_target(JOINTS, vis, hw, sigma, subpixel)
    np.testing.assert_allclose(wt[0].numpy(), ref_w)
    np.testing.assert_allclose(hm[0].numpy(), ref, rtol=1e-12, atol=1e-15)


def test_gaussian_heatmaps_peak_weights_and_dtype():
    joints = torch.tensor([[[5.4, 7.6], [40.0, 3.0], [-7.0, 3.0], [-6.4, 3.0], [6.0, 6.0]]])
    weight = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    hm, wt = gaussian_heatmaps(joints, weight, (16, 24), 2.0)
    assert hm.dtype == torch.float32 and hm.shape == (1, 5, 16, 24)
    assert hm[0, 0, 8, 5] == 1.0 and hm[0, 0].max() == 1.0  # peak 1 exactly at the rounded centre (5, 8)
    assert torch.equal(wt, torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0]]))  # x=40 >= 24+6; x=-7 window ends at 0
    assert hm[0, 1:3].abs().sum() == 0 and hm[0, 4].abs().sum() == 0
    assert hm[0, 3, 3, 0] == pytest.approx(math.exp(-36 / 8))  # only the window's last column is inside
    with pytest.raises(ValueError, match="weight"):
        gaussian_heatmaps(joints, weight[:, :3], (16, 24), 2.0)
    with pytest.raises(ValueError, match="sigma"):
        gaussian_heatmaps(joints, weight, (16, 24), 0.0)


@given(st.integers(1, 4), st.integers(1, 5), st.integers(1, 12), st.integers(1, 12), st.booleans(),
       st.integers(0, 2**32 - 1))
@settings(max_examples=50)
def test_decode_matches_simplebaseline(n, j, h, w, ints, seed):
    rng = np.random.default_rng(seed)
    shape = (n, j, h, w)
    if ints:  # small integers: ties for the argmax and zero differences for the shift
        hm = rng.integers(-2, 4, shape).astype(np.float64)
    else:
        hm = rng.uniform(-1, 1, shape)
    coords, maxvals = decode_heatmaps(torch.from_numpy(hm))
    ref, ref_max = _sb_final_preds(hm)
    np.testing.assert_array_equal(coords.numpy(), ref)
    np.testing.assert_array_equal(maxvals.numpy(), ref_max)


@pytest.mark.parametrize("dx,dy", [(0.3, 0.0), (-0.3, 0.2), (0.0, -0.4), (0.45, 0.45)])
def test_decode_subpixel_gaussian(dx, dy):
    x0, y0 = 9.0, 6.0
    hm, _ = gaussian_heatmaps(torch.tensor([[[x0 + dx, y0 + dy]]]), torch.ones(1, 1), (16, 20), 2.0, subpixel=True)
    coords, maxvals = decode_heatmaps(hm)
    expect = torch.tensor([x0 + 0.25 * np.sign(dx), y0 + 0.25 * np.sign(dy)], dtype=torch.float32)
    torch.testing.assert_close(coords[0, 0], expect)
    assert abs(coords[0, 0, 0] - (x0 + dx)) <= 0.25 and abs(coords[0, 0, 1] - (y0 + dy)) <= 0.25
    assert maxvals[0, 0] == pytest.approx(math.exp(-(dx**2 + dy**2) / 8), rel=1e-6)
    raw, _ = decode_heatmaps(hm, refine=False)
    torch.testing.assert_close(raw[0, 0], torch.tensor([x0, y0]))


def test_decode_zero_and_negative_heatmaps_give_origin():
    hm = torch.zeros(2, 3, 8, 8)
    hm[0, 1] = -1.0
    hm[0, 1, 4, 5] = -0.5
    hm[1, 2, 4, 5] = 0.7
    coords, maxvals = decode_heatmaps(hm)
    assert torch.equal(coords[0], torch.zeros(3, 2)) and torch.equal(coords[1, :2], torch.zeros(2, 2))
    assert torch.equal(coords[1, 2], torch.tensor([5.0, 4.0]))  # neighbours equal: no shift
    assert maxvals[0, 1] == -0.5 and maxvals[1, 2] == pytest.approx(0.7)
    border = torch.zeros(1, 1, 8, 8)
    border[0, 0, 4, 1], border[0, 0, 4, 2] = 1.0, 0.5  # x = 1: SimpleBaseline's strict bound, not refined
    assert torch.equal(decode_heatmaps(border)[0][0, 0], torch.tensor([1.0, 4.0]))


# ------------------------------------------------------------------------------------------------- flips


@given(st.booleans())
@settings(max_examples=2)
def test_flip_heatmaps_matches_simplebaseline(shift):
    hm = torch.rand(2, 16, 8, 6, generator=torch.Generator().manual_seed(3), dtype=D)
    got = flip_heatmaps(hm, MPII_FLIP_PAIRS, shift=shift)
    np.testing.assert_array_equal(got.numpy(), _sb_flip_back(hm.numpy(), MPII_FLIP_PAIRS, shift))


def test_flip_heatmaps_twice_is_identity_and_commutes_with_rendering():
    gen = torch.Generator().manual_seed(4)
    joints = torch.rand(3, 16, 2, generator=gen, dtype=D) * torch.tensor([24.0, 32.0], dtype=D)
    hm, _ = gaussian_heatmaps(joints, torch.ones(3, 16, dtype=D), (32, 24), 2.0, subpixel=True)
    assert hm.abs().sum() > 0
    torch.testing.assert_close(flip_heatmaps(flip_heatmaps(hm, MPII_FLIP_PAIRS, False), MPII_FLIP_PAIRS, False), hm)
    fj = flip_joints(joints, 24, MPII_FLIP_PAIRS)
    hm_f, _ = gaussian_heatmaps(fj, torch.ones(3, 16, dtype=D), (32, 24), 2.0, subpixel=True)
    torch.testing.assert_close(flip_heatmaps(hm_f, MPII_FLIP_PAIRS, shift=False), hm)
    # decoding the flipped-back maps gives the original argmax positions
    torch.testing.assert_close(decode_heatmaps(flip_heatmaps(hm_f, MPII_FLIP_PAIRS, False), refine=False)[0],
                               decode_heatmaps(hm, refine=False)[0])
    with pytest.raises(ValueError, match="flip_pairs"):
        flip_heatmaps(hm, [(0, 5), (5, 1)])
    with pytest.raises(ValueError, match="flip_pairs"):
        flip_joints(joints, 24, [(0, 16)])


# ------------------------------------------------------------------------------------------------ PCKh


def test_pck_hits_and_pckh_summary_hand_fixture():
    n, j = 3, 16
    gt = torch.zeros(n, j, 2, dtype=D)
    pred = torch.zeros(n, j, 2, dtype=D)
    visible = torch.ones(n, j, dtype=torch.bool)
    norm = torch.tensor([10.0, 20.0, 0.0], dtype=D)  # instance 2 has no head box: never counted
    # threshold 0.5 -> radius 5 px for instance 0, 10 px for instance 1
    pred[0, :, 0] = 5.0  # exactly on the radius: hit (<=)
    pred[0, 0] = torch.tensor([3.0, 4.0000001], dtype=D)  # just beyond 5: miss
    pred[0, 1] = torch.tensor([3.0, 4.0], dtype=D)  # distance 5: hit
    pred[1, :, 1] = 10.5  # beyond 10: miss ...
    pred[1, 2:5, 1] = 9.9  # ... except joints 2, 3, 4
    pred[1, 6:8, 1] = 0.0  # pelvis, thorax hit (excluded from the mean)
    visible[0, 3] = False  # invisible: neither hit nor counted
    visible[1, 4] = False
    pred[2] = 100.0  # far off, but norm 0
    hits, counts = pck_hits(pred, gt, visible, norm, 0.5)
    exp_counts = torch.full((j,), 2, dtype=torch.int64)
    exp_counts[3] = exp_counts[4] = 1
    exp_hits = torch.ones(j, dtype=torch.int64)  # instance 0 hits all but joint 0 (and invisible 3)
    exp_hits[0] = 0
    exp_hits[3] = 1  # instance 1 only
    exp_hits[2] = 2
    exp_hits[4] = 1  # instance 0 only (instance 1 invisible)
    exp_hits[6] = exp_hits[7] = 2
    assert hits.dtype == torch.int64 and counts.dtype == torch.int64
    assert torch.equal(counts, exp_counts) and torch.equal(hits, exp_hits)
    # mean over the 14 kept joints: hits 0+1+2+1+1+1+ (8 joints x 1) = 14; counts 2*12 + 1 + 1 = 26
    assert pckh_summary(hits, counts, MPII_PCKH_EXCLUDE) == pytest.approx(14 / 26, abs=1e-15)
    assert pckh_summary(hits, counts, ()) == pytest.approx(18 / 30, abs=1e-15)
    # SimpleBaseline's weighted form gives the same value (in percent)
    h, c = hits.numpy().astype(float), counts.numpy().astype(float)
    pckh = np.ma.array(100 * h / c, mask=False)
    pckh.mask[6:8] = True
    cnt = np.ma.array(c, mask=False)
    cnt.mask[6:8] = True
    assert float(np.sum(pckh * (cnt / np.sum(cnt)))) == pytest.approx(100 * 14 / 26, abs=1e-12)
    # mergeable: two clients' sums add up to the sums of the union
    h1, c1 = pck_hits(pred[:2], gt[:2], visible[:2], norm[:2], 0.5)
    h2, c2 = pck_hits(pred[2:], gt[2:], visible[2:], norm[2:], 0.5)
    assert torch.equal(h1 + h2, hits) and torch.equal(c1 + c2, counts)
    assert math.isnan(pckh_summary(torch.zeros(16, dtype=torch.int64), torch.zeros(16, dtype=torch.int64), ()))
    with pytest.raises(ValueError, match="norm"):
        pck_hits(pred, gt, visible, norm[:2], 0.5)


# ------------------------------------------------------------------------------------------------- OKS


def _coco_fixture(num_joints, sigmas, seed, noise=3.0):
    rng = np.random.default_rng(seed)
    persons = []
    for img in range(5):
        for _ in range(rng.integers(1, 4)):
            persons.append(img * 7 + 3)
    n = len(persons)
    gt = np.zeros((n, num_joints, 3))
    gt[..., 0] = rng.uniform(20, 400, (n, num_joints))
    gt[..., 1] = rng.uniform(20, 300, (n, num_joints))
    gt[..., 2] = rng.choice([0, 1, 2], (n, num_joints), p=[0.2, 0.3, 0.5])
    gt[gt[..., 2] == 0, :2] = 0
    gt[n - 1, :, :] = 0  # one instance without any labelled joint: ignored by COCO
    area = rng.uniform(500, 30000, n)  # medium and large instances
    pred = np.zeros((n, num_joints, 3))
    pred[..., :2] = gt[..., :2] + rng.normal(0, noise, (n, num_joints, 2)) * np.sqrt(area / 4000)[:, None, None]
    pred[n - 1, :, :2] = rng.uniform(20, 300, (num_joints, 2))
    pred[..., 2] = rng.uniform(0.1, 1.0, (n, num_joints))
    score = rng.uniform(0.2, 1.0, n)
    return gt, pred, area, np.array(persons), score


def _coco_reference(tmp_path, gt, pred, area, image_id, sigmas, score, bbox=None):
    """pycocotools used the standard way: JSON files, COCO(file), loadRes(file)."""
    j = gt.shape[1]
    anns = []
    for i in range(len(gt)):
        lab = gt[i, gt[i, :, 2] > 0]
        box = [0.0, 0.0, 0.0, 0.0] if len(lab) == 0 else [
            lab[:, 0].min(), lab[:, 1].min(), lab[:, 0].max() - lab[:, 0].min(), lab[:, 1].max() - lab[:, 1].min()]
        if bbox is not None:
            box = bbox[i]
        anns.append({"id": i + 1, "image_id": int(image_id[i]), "category_id": 1, "iscrowd": 0,
                     "area": float(area[i]), "bbox": [float(b) for b in box],
                     "num_keypoints": int((gt[i, :, 2] > 0).sum()), "keypoints": gt[i].reshape(-1).tolist()})
    gt_json = {"info": {}, "images": [{"id": int(i)} for i in sorted(set(image_id.tolist()))], "annotations": anns,
               "categories": [{"id": 1, "name": "person", "keypoints": [str(k) for k in range(j)], "skeleton": []}]}
    res = [{"image_id": int(image_id[i]), "category_id": 1, "keypoints": pred[i].reshape(-1).tolist(),
            "score": float(score[i])} for i in range(len(gt))]
    gt_file, res_file = tmp_path / f"gt{j}.json", tmp_path / f"res{j}.json"
    gt_file.write_text(json.dumps(gt_json))
    res_file.write_text(json.dumps(res))
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO(str(gt_file))
        dets = coco.loadRes(str(res_file))
        ev = COCOeval(coco, dets, "keypoints")
        ev.params.kpt_oks_sigmas = np.array(sigmas)
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev


@pytest.mark.parametrize("num_joints,sigmas", [(17, COCO_SIGMAS), (16, MPII_SIGMAS)])
def test_oks_ap_matches_pycocotools_files(tmp_path, capsys, num_joints, sigmas):
    gt, pred, area, image_id, score = _coco_fixture(num_joints, sigmas, seed=num_joints)
    ev = _coco_reference(tmp_path, gt, pred, area, image_id, sigmas, score)
    capsys.readouterr()
    t = torch.from_numpy
    got = oks_ap(t(pred), t(gt), t(area), t(image_id), sigmas, score=t(score))
    assert capsys.readouterr().out == ""
    ref = [np.nan if s == -1 else s for s in ev.stats[:6]]
    assert 0.05 < ref[0] < 0.95  # a non-trivial AP: the comparison means something
    np.testing.assert_allclose([got[k] for k in ("ap", "ap50", "ap75", "ap_m", "ap_l", "ar")], ref,
                               rtol=0, atol=1e-12)
    # oks of matched pairs equals pycocotools' computeOks entries (dt i vs gt i of the same image)
    ours = oks(t(pred[..., :2]), t(gt), t(area), sigmas)
    for i in range(len(gt) - 1):
        img = int(image_id[i])
        dts = ev._dts[img, 1]
        order = np.argsort([-d["score"] for d in dts], kind="mergesort")
        row = next(k for k, o in enumerate(order) if dts[o]["id"] == i + 1)
        col = next(k for k, g in enumerate(ev._gts[img, 1]) if g["id"] == i + 1)
        assert ours[i].item() == pytest.approx(ev.ious[img, 1][row, col], abs=1e-12)
    assert math.isnan(ours[-1].item())
    # default detection score: the mean per-joint score
    default = oks_ap(t(pred), t(gt), t(area), t(image_id), sigmas)
    assert capsys.readouterr().out == ""
    ev_mean = _coco_reference(tmp_path, gt, pred, area, image_id, sigmas, pred[..., 2].mean(-1))
    np.testing.assert_allclose([default[k] for k in ("ap", "ap50", "ap75", "ap_m", "ap_l", "ar")],
                               [np.nan if s == -1 else s for s in ev_mean.stats[:6]], rtol=0, atol=1e-12)
    assert default["ap"] != got["ap"]  # the score order matters in this fixture


def test_oks_ap_given_boxes_match_unlabelled_instances(tmp_path):
    # pycocotools matches detections to a gt without labelled joints by the distance to its doubled box;
    # the detection matched to such an (ignored) gt is ignored instead of being a false positive
    gt, pred, area, image_id, score = _coco_fixture(17, COCO_SIGMAS, seed=7)
    bbox = np.tile([10.0, 10.0, 50.0, 40.0], (len(gt), 1))
    bbox[-1] = [20.0, 20.0, 280.0, 280.0]  # encloses the last (unlabelled) instance's prediction
    t = torch.from_numpy
    with_box = oks_ap(t(pred), t(gt), t(area), t(image_id), COCO_SIGMAS, score=t(score), bbox=t(bbox))
    without = oks_ap(t(pred), t(gt), t(area), t(image_id), COCO_SIGMAS, score=t(score))
    ev = _coco_reference(tmp_path, gt, pred, area, image_id, COCO_SIGMAS, score, bbox=bbox.tolist())
    np.testing.assert_allclose([with_box[k] for k in ("ap", "ap50", "ap75", "ap_m", "ap_l", "ar")],
                               [np.nan if s == -1 else s for s in ev.stats[:6]], rtol=0, atol=1e-12)
    assert with_box["ap"] > without["ap"]


def test_oks_ap_perfect_predictions_and_undefined_entries():
    gt, _, area, image_id, _ = _coco_fixture(17, COCO_SIGMAS, seed=5)
    keep = gt[..., 2].sum(-1) > 0
    gt, area, image_id = gt[keep], area[keep], image_id[keep]
    perfect = gt.copy()
    perfect[..., 2] = 0.9
    t = torch.from_numpy
    big = np.full_like(area, 20000.0)  # all large: no medium instance -> pycocotools -1 -> nan
    res = oks_ap(t(perfect), t(gt), t(big), t(image_id), COCO_SIGMAS)
    assert res["ap"] == pytest.approx(1.0) and res["ap50"] == 1.0 and res["ar"] == 1.0 and res["ap_l"] == 1.0
    assert math.isnan(res["ap_m"])
    assert all(math.isnan(v) for v in oks_ap(torch.zeros(0, 17, 3), torch.zeros(0, 17, 3), torch.zeros(0),
                                             torch.zeros(0, dtype=torch.int64), COCO_SIGMAS).values())
    with pytest.raises(ValueError, match="sigmas"):
        oks_ap(t(perfect), t(gt), t(area), t(image_id), MPII_SIGMAS)


@given(st.floats(0.0, 30.0), st.floats(100.0, 50000.0), st.sampled_from([COCO_SIGMAS, MPII_SIGMAS]))
@settings(max_examples=30)
def test_oks_closed_form_for_constant_offset(d, area, sigmas):
    j = len(sigmas)
    gen = torch.Generator().manual_seed(6)
    gt = torch.cat([torch.rand(1, j, 2, generator=gen, dtype=D) * 100, torch.ones(1, j, 1, dtype=D)], -1)
    gt[0, ::3, 2] = 0  # unlabelled joints do not count
    angle = torch.rand(1, j, generator=gen, dtype=D) * 2 * math.pi
    pred = gt[..., :2] + d * torch.stack([angle.cos(), angle.sin()], -1)
    got = oks(pred, gt, torch.tensor([area], dtype=D), sigmas)
    labelled = [k for k in range(j) if k % 3 != 0]
    expect = np.mean([math.exp(-(d**2) / (2 * area * (2 * sigmas[k]) ** 2)) for k in labelled])
    assert got.item() == pytest.approx(expect, rel=1e-9, abs=1e-12)


def test_sigma_constants():
    np.testing.assert_array_equal(np.array(COCO_SIGMAS), COCOeval(iouType="keypoints").params.kpt_oks_sigmas)
    assert len(MPII_SIGMAS) == 16 and MPII_SIGMAS[6:10] == (0.026,) * 4


def test_bad_shapes_raise_value_error():
    with pytest.raises(ValueError, match="rotation"):
        crop_affine(torch.zeros(2, 2), torch.ones(2, 2), torch.zeros(3), (8, 8))
    with pytest.raises(ValueError, match="affine"):
        transform_points(torch.zeros(2, 4, 2), torch.zeros(3, 2, 3))
    with pytest.raises(ValueError, match="images"):
        warp_crops(torch.zeros(2, 8, 8), torch.zeros(2, 2, 3), (4, 4))
    with pytest.raises(ValueError, match="heatmaps"):
        decode_heatmaps(torch.zeros(2, 8, 8))
    with pytest.raises(ValueError, match="gt"):
        oks(torch.zeros(2, 17, 2), torch.zeros(2, 17, 2), torch.ones(2), COCO_SIGMAS)
