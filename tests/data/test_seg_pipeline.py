"""Segmentation training batches (fedsight.data.seg_pipeline): joint image/label geometry, per-sample random
streams through every prefetcher, style banks (CFSI's "other clients only", LAB's whole bank), bank clients
and class pixel counts.

Checks are properties (colour-coded classes stay on their pixels, padding is ignored, label values are
preserved) or independent references (numpy bincounts, torch interpolation plus the style functions, the
mean colour a restyled image must have), never stored outputs."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsight.data.pipeline import TensorStore
from fedsight.data.prefetch import Prefetcher
from fedsight.data.seg_pipeline import (
    SegBatchLoader,
    StyleBank,
    augment_pair,
    bank_clients,
    build_style_bank,
    class_pixel_counts,
    resize_pair,
    style_entry,
)
from fedsight.data.segmentation import IGNORE, TensorLabelStore
from fedsight.functional.style import amplitude_window, lab_stats
from fedsight.rng import np_rng

FEW = settings(max_examples=25, deadline=None)
# one distinct, non-zero colour per class (no channel is 0, so zero padding is recognisable)
PALETTE = torch.tensor([[200, 30, 30], [30, 200, 30], [30, 30, 200], [200, 200, 30], [200, 30, 200], [30, 200, 200],
                        [120, 60, 10], [10, 60, 120]], dtype=torch.uint8)
BLOCK = 8


def block_scene(seed: int, h: int = 48, w: int = 64, classes: int = 6, ignore: bool = True):
    """An image whose colour encodes its class: 8 x 8 blocks of random classes, each painted with its palette
    colour; with ``ignore``, some blocks are unlabelled (IGNORE) and painted grey."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, classes, (h // BLOCK, w // BLOCK))
    if ignore:
        blocks[rng.random(blocks.shape) < 0.15] = IGNORE
    label = torch.from_numpy(np.kron(blocks, np.ones((BLOCK, BLOCK), dtype=np.int64)).astype(np.uint8))
    image = torch.full((3, h, w), 90, dtype=torch.uint8)
    known = label != IGNORE
    image[:, known] = PALETTE[label[known].long()].T
    return image, label


def colour_matches_class(image: torch.Tensor, label: torch.Tensor, where: torch.Tensor) -> bool:
    """Every pixel of ``where`` with a class label has exactly that class's palette colour."""
    sel = where & (label != IGNORE)
    return bool(torch.equal(image[:, sel], PALETTE[label[sel].long()].T))


# -------------------------------------------------------------------------------------------- augment_pair


@FEW
@given(seed=st.integers(0, 10_000), crop=st.sampled_from([(16, 16), (24, 40), (48, 64), (8, 56)]),
       flip=st.booleans())
def test_crop_keeps_image_and_label_aligned(seed, crop, flip) -> None:
    image, label = block_scene(seed)
    x, y = augment_pair(image, label, crop, (1.0, 1.0), flip, np_rng(seed, "aug"))
    assert x.shape == (3, *crop) and y.shape == crop and x.dtype == y.dtype == torch.uint8
    assert colour_matches_class(x, y, torch.ones(crop, dtype=torch.bool))
    assert torch.equal(y == IGNORE, (x == 90).all(0))  # unlabelled pixels stay unlabelled, no padding here
    assert (y != IGNORE).any()  # the check above was not vacuous


def test_crop_position_and_flip_come_from_the_stream_in_order() -> None:
    """Draws (module docstring): scale, crop row, crop column, flip. The crop is a window of the image."""
    image, label = block_scene(3, ignore=False)
    image = image + torch.arange(48 * 64, dtype=torch.int64).reshape(48, 64).remainder(7).to(torch.uint8)  # unique-ish
    for seed in range(20):
        x, y = augment_pair(image, label, (16, 24), (1.0, 1.0), True, np_rng(seed, "aug"))
        rng = np_rng(seed, "aug")
        rng.uniform(1.0, 1.0)
        top, left = int(rng.integers(0, 48 - 16 + 1)), int(rng.integers(0, 64 - 24 + 1))
        wx, wy = image[:, top : top + 16, left : left + 24], label[top : top + 16, left : left + 24]
        if rng.random() < 0.5:
            wx, wy = wx.flip(-1), wy.flip(-1)
        assert torch.equal(x, wx) and torch.equal(y, wy), seed


@pytest.mark.parametrize("scale", [(2.0, 2.0), (0.5, 0.5)])
def test_exact_rescale_keeps_class_colours_inside_blocks(scale) -> None:
    """After a factor 2 or 1/2 (bilinear image, nearest label), a pixel whose 3 x 3 label neighbourhood is one
    class interpolates only pixels of that class: it has exactly the class colour (inside the crop)."""
    for seed in range(6):
        image, label = block_scene(seed)
        crop = (40, 56) if scale[0] > 1 else (24, 32)
        x, y = augment_pair(image, label, crop, scale, True, np_rng(seed, "scale"))
        assert x.shape == (3, *crop) and y.shape == crop
        pad = F.pad(y[None, None].to(torch.float32), (1, 1, 1, 1), mode="replicate")
        uniform = (F.max_pool2d(pad, 3, 1) == -F.max_pool2d(-pad, 3, 1))[0, 0]
        uniform[[0, -1]] = False  # the crop's border pixels have neighbours outside the crop
        uniform[:, [0, -1]] = False
        assert uniform.sum() > 0.15 * y.numel()
        assert colour_matches_class(x, y, uniform)
        # and the label map holds only labels of the input
        assert set(y.unique().tolist()) <= set(label.unique().tolist())


@FEW
@given(seed=st.integers(0, 10_000), s=st.floats(0.3, 0.9), crop=st.sampled_from([(40, 60), (48, 80), (60, 70)]),
       flip=st.booleans())
def test_padding_is_ignored_exactly_where_the_image_is_zero_padded(seed, s, crop, flip) -> None:
    image, label = block_scene(seed, 40, 56, ignore=False)
    x, y = augment_pair(image, label, crop, (s, s), flip, np_rng(seed, "pad"))
    assert x.shape == (3, *crop) and y.shape == crop
    h, w = max(1, round(40 * s)), max(1, round(56 * s))
    padded = (x == 0).all(0)
    assert torch.equal(y == IGNORE, padded)  # no input pixel is black or unlabelled
    assert padded.any()
    # the scaled image occupies the top-left h' x w' window (mirrored when flipped), the rest is padding
    want = torch.ones(crop, dtype=torch.bool)
    want[: min(h, crop[0]), : min(w, crop[1])] = False
    assert torch.equal(padded, want) or (flip and torch.equal(padded, want.flip(-1)))


def test_scaled_crop_equals_the_resized_image_when_it_fits() -> None:
    """With a crop larger than the scaled image, the crop is the resized image plus padding (independent
    bilinear / nearest resize)."""
    image, label = block_scene(1, 40, 56)
    x, y = augment_pair(image, label, (32, 48), (0.5, 0.5), False, np_rng(0))
    ref_x = F.interpolate(image[None].float(), size=(20, 28), mode="bilinear", align_corners=False)[0]
    ref_y = F.interpolate(label[None, None].float(), size=(20, 28), mode="nearest")[0, 0]
    assert torch.equal(x[:, :20, :28], ref_x.clamp(0, 255).round().to(torch.uint8))
    assert torch.equal(y[:20, :28], ref_y.to(torch.uint8))
    assert (x[:, 20:] == 0).all() and (x[:, :, 28:] == 0).all()
    assert (y[20:] == IGNORE).all() and (y[:, 28:] == IGNORE).all()


def test_flip_mirrors_image_and_label_together() -> None:
    image, label = block_scene(5)
    flipped = kept = 0
    for seed in range(40):
        x0, y0 = augment_pair(image, label, (32, 40), (0.8, 1.3), False, np_rng(seed, "flip"))
        x1, y1 = augment_pair(image, label, (32, 40), (0.8, 1.3), True, np_rng(seed, "flip"))
        # the flip is the last draw: same scale and crop, then both mirrored or neither
        if torch.equal(x1, x0):
            assert torch.equal(y1, y0)
            kept += 1
        else:
            assert torch.equal(x1, x0.flip(-1)) and torch.equal(y1, y0.flip(-1)), seed
            flipped += 1
    assert flipped >= 10 and kept >= 10


def test_same_seed_same_output_different_seeds_different_crops() -> None:
    image, label = block_scene(2)
    image = image + torch.randint(0, 20, image.shape, generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    outs = []
    for seed in range(12):
        a = augment_pair(image, label, (16, 16), (0.9, 1.2), True, np_rng(seed, "det"))
        b = augment_pair(image, label, (16, 16), (0.9, 1.2), True, np_rng(seed, "det"))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        outs.append(a[0])
    distinct = {x.numpy().tobytes() for x in outs}
    assert len(distinct) == len(outs)
    # the input is left as it was
    assert torch.equal(image, block_scene(2)[0] + torch.randint(0, 20, image.shape,
                       generator=torch.Generator().manual_seed(0), dtype=torch.uint8))


# -------------------------------------------------------------------------------------------- resize_pair


@FEW
@given(seed=st.integers(0, 10_000), hw=st.tuples(st.integers(1, 24), st.integers(1, 24)),
       size=st.tuples(st.integers(1, 40), st.integers(1, 40)), values=st.lists(st.integers(0, 255), min_size=1,
                                                                               max_size=6))
def test_resized_labels_only_hold_input_values(seed, hw, size, values) -> None:
    rng = np.random.default_rng(seed)
    label = torch.from_numpy(rng.choice(np.array(values, dtype=np.uint8), hw))
    image = torch.from_numpy(rng.integers(0, 256, (3, *hw), dtype=np.uint8))
    x, y = resize_pair(image, label, size)
    assert x.shape == (3, *size) and y.shape == size and x.dtype == y.dtype == torch.uint8
    assert set(np.unique(y.numpy())) <= set(np.unique(label.numpy()))


@pytest.mark.parametrize("k", [2, 4])
def test_integer_upscaling_repeats_labels(k) -> None:
    rng = np.random.default_rng(k)
    label = rng.integers(0, 256, (5, 7), dtype=np.uint8)
    image = torch.from_numpy(rng.integers(0, 256, (3, 5, 7), dtype=np.uint8))
    _, y = resize_pair(image, torch.from_numpy(label), (5 * k, 7 * k))
    np.testing.assert_array_equal(y.numpy(), np.repeat(np.repeat(label, k, 0), k, 1))


# ---------------------------------------------------------------------------------------------- batches


N_IMG, H, W, CROP, BETA = 12, 20, 28, (12, 16), 0.2


def _stores():
    rng = np.random.default_rng(42)
    images = torch.from_numpy(rng.integers(0, 256, (N_IMG, 3, H, W), dtype=np.uint8))
    labels = rng.integers(0, 6, (N_IMG, H, W), dtype=np.uint8)
    labels[:, :3] = IGNORE
    return TensorStore(images), TensorLabelStore(torch.from_numpy(labels))


def _bank(kind: str) -> StyleBank:
    rng = np.random.default_rng(7)
    imgs = TensorStore(torch.from_numpy(rng.integers(0, 256, (6, 3, 30, 22), dtype=np.uint8)))
    return build_style_bank(kind, imgs, np.array([0, 1, 1, 2, 3, 3]), CROP, BETA, 0.7)


@pytest.fixture(scope="module")
def process_pf():
    with Prefetcher(workers=2, depth=2, backend="process") as pf:
        yield pf


@pytest.mark.parametrize("style", [None, "cfsi", "lab"])
def test_batches_are_a_function_of_seed_key_and_indices(style, process_pf) -> None:
    images, labels = _stores()
    bank = None if style is None else _bank(style)
    loader = SegBatchLoader(images, labels, CROP, (0.75, 1.5), True, seed=11, style=bank)
    order = np_rng(0, "shuffle", 2, 1).permutation(N_IMG)
    jobs = [(order[s * 4 : s * 4 + 4], ("augment", 2, 1, s), 1) for s in range(3)]
    ref = [loader(job) for job in jobs]
    for x, y in ref:
        assert x.shape == (4, 3, *CROP) and y.shape == (4, *CROP) and x.dtype == y.dtype == torch.uint8
    # sample j of a job draws from np_rng(seed, *key, j) only: geometry, then style, from that one stream
    for indices, key, client in jobs:
        x, y = loader((indices, key, client))
        for j, i in enumerate(indices):
            rng = np_rng(11, *key, j)
            want_x, want_y = augment_pair(images.get_one(int(i)), labels.get_one(int(i)), CROP, (0.75, 1.5), True, rng)
            if bank is not None:
                want_x = bank.apply(want_x, client, rng)
            assert torch.equal(x[j], want_x) and torch.equal(y[j], want_y), (key, j)
    # another key or another seed gives other batches
    other = SegBatchLoader(images, labels, CROP, (0.75, 1.5), True, seed=12, style=bank)
    assert not torch.equal(other(jobs[0])[0], ref[0][0])
    assert not torch.equal(loader((jobs[0][0], ("augment", 3, 1, 0), 1))[0], ref[0][0])
    np.random.seed(123)
    torch.manual_seed(123)  # the global generators do not matter
    for pf in (Prefetcher(0), Prefetcher(2), process_pf):
        with pf if pf is not process_pf else contextlib.nullcontext():
            out = list(pf.map(loader, jobs))
        assert len(out) == len(ref), pf
        for (x, y), (rx, ry) in zip(out, ref):
            assert torch.equal(x, rx) and torch.equal(y, ry), pf


def test_cfsi_style_depends_on_the_client_and_never_touches_labels() -> None:
    images, labels = _stores()
    bank = _bank("cfsi")
    bank.prob = 1.0
    loader = SegBatchLoader(images, labels, CROP, (1.0, 1.0), False, seed=3, style=bank)
    job = (np.arange(6), ("augment", 0, 0, 0))
    plain = SegBatchLoader(images, labels, CROP, (1.0, 1.0), False, seed=3)((*job, 0))
    a, b = loader((*job, 0)), loader((*job, 1))
    assert torch.equal(a[1], plain[1]) and torch.equal(b[1], plain[1])
    assert not torch.equal(a[0], plain[0]) and not torch.equal(b[0], plain[0])
    assert not torch.equal(a[0], b[0])  # the clients draw from different parts of the bank


# ------------------------------------------------------------------------------------------- style banks


SH, SW = 24, 32
# six directions away from the content's mean grey (128): one colour per bank entry
COLOURS = torch.tensor([[228, 128, 128], [28, 128, 128], [128, 228, 128], [128, 28, 128], [128, 128, 228],
                        [128, 128, 28]], dtype=torch.float64)
OWNERS = np.array([0, 1, 1, 2, 3, 0])


def _constant_bank(kind: str, owners=OWNERS, prob: float = 1.0) -> StyleBank:
    imgs = COLOURS[: len(owners), :, None, None].expand(-1, -1, SH, SW).to(torch.uint8).contiguous()
    return build_style_bank(kind, TensorStore(imgs), owners, (SH, SW), BETA, prob)


def _content(seed: int) -> torch.Tensor:
    """Mid-grey with a +-15 texture: restyling moves its mean without clipping."""
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(113, 144, (3, SH, SW), dtype=np.uint8))


def _cfsi_entry_used(content: torch.Tensor, out: torch.Tensor) -> int | None:
    """Which constant-colour entry a CFSI restyle used, from the mean colour alone: the DC amplitude becomes
    lam * style + (1 - lam) * own, so the mean moves by lam * (colour - mean). None when it barely moved."""
    mean = content.double().mean((1, 2))
    shift = out.double().mean((1, 2)) - mean
    if shift.norm() < 3.0:
        return None
    best, best_res = None, math.inf
    for e, colour in enumerate(COLOURS):
        v = colour - mean
        lam = float(shift @ v / (v @ v))
        res = float((shift - lam * v).norm())
        if 0 <= lam <= 1.0 + 1e-6 and res < best_res:
            best, best_res = e, res
    assert best is not None and best_res < 1.0, (shift, best_res)
    return best


@pytest.mark.parametrize("client", [0, 1, 2, 3])
def test_cfsi_never_uses_the_clients_own_entries(client) -> None:
    bank = _constant_bank("cfsi")
    used = []
    for i in range(150):
        content = _content(i)
        out = bank.apply(content, client, np_rng(5, "style", client, i))
        assert out.shape == content.shape and out.dtype == torch.uint8
        e = _cfsi_entry_used(content, out)
        if e is not None:
            used.append(e)
    assert len(used) > 120  # prob = 1: (nearly) every draw visibly restyles
    assert not any(OWNERS[e] == client for e in used)
    assert set(used) == {e for e in range(len(OWNERS)) if OWNERS[e] != client}  # every other entry, at least once


def _lab_entry_used(out: torch.Tensor) -> int:
    """A LAB restyle towards a constant image's stats (std 0) paints the image that constant colour."""
    colour = out.double().mean((1, 2))
    assert (out.double() - colour[:, None, None]).abs().max() <= 1.0
    dist = (COLOURS - colour).norm(dim=1)
    assert dist.min() < 3.0, colour
    return int(dist.argmin())


def test_lab_draws_from_the_whole_bank_own_entries_included() -> None:
    bank = _constant_bank("lab")
    used = [_lab_entry_used(bank.apply(_content(i), 0, np_rng(6, "lab", i))) for i in range(120)]
    assert set(used) == set(range(len(OWNERS)))  # client 0's own entries (0 and 5) included
    counts = np.bincount(used, minlength=len(OWNERS))
    assert counts.min() >= 8  # uniform over the 6 entries: 20 expected each


def test_restyle_probability() -> None:
    content = _content(0)
    for kind in ("cfsi", "lab"):
        never = _constant_bank(kind, prob=0.0)
        for i in range(30):
            assert torch.equal(never.apply(content, 1, np_rng(0, "p", i)), content)
    always = _constant_bank("lab", prob=1.0)
    assert all(not torch.equal(always.apply(content, 1, np_rng(1, "p", i)), content) for i in range(60))
    half = _constant_bank("lab", prob=0.5)
    changed = sum(not torch.equal(half.apply(content, 1, np_rng(2, "p", i)), content) for i in range(400))
    assert 160 <= changed <= 240


def test_cfsi_bank_of_only_the_client_leaves_images_unchanged() -> None:
    bank = _constant_bank("cfsi", owners=np.array([2, 2, 2]))
    for i in range(20):
        content = _content(i)
        assert torch.equal(bank.apply(content, 2, np_rng(3, i)), content)
    # another client does get restyled by the same bank
    assert sum(_cfsi_entry_used(_content(i), bank.apply(_content(i), 1, np_rng(3, i))) is not None
               for i in range(20)) >= 15


def test_bank_sizes() -> None:
    cfsi = _constant_bank("cfsi")
    # window: 2 floor(0.2 * 24 / 2) + 1 = 5 rows, 2 floor(0.2 * 32 / 2) + 1 = 7 columns, 3 channels, float32
    assert tuple(cfsi.entries.shape) == (6, 3, 5, 7)
    assert cfsi.nbytes() == 6 * 3 * 5 * 7 * 4 == 2520
    assert [cfsi.client_bytes(k) for k in range(5)] == [2 * 420, 2 * 420, 420, 420, 0]
    lab = _constant_bank("lab")
    assert tuple(lab.entries.shape) == (6, 2, 3)
    assert lab.nbytes() == 6 * 2 * 3 * 4
    assert [lab.client_bytes(k) for k in range(5)] == [48, 48, 24, 24, 0]


# ------------------------------------------------------------------------------------- style entries


@pytest.mark.parametrize("kind", ["cfsi", "lab"])
@pytest.mark.parametrize("workers", [0, 2])
def test_bank_entries_are_the_style_of_the_resized_image(kind, workers) -> None:
    rng = np.random.default_rng(9)
    raw = [torch.from_numpy(rng.integers(0, 256, (3, 30, 45), dtype=np.uint8)) for _ in range(5)]
    store = TensorStore(torch.stack(raw))
    owners = [4, 0, 4, 2, 0]
    crop = (18, 26)
    with Prefetcher(workers) as pf:
        bank = build_style_bank(kind, store, owners, crop, 0.15, 0.3, prefetcher=pf)
    assert bank.kind == kind and bank.beta == 0.15 and bank.prob == 0.3
    assert bank.owners.dtype == np.int64 and bank.owners.tolist() == owners
    assert bank.entries.dtype == torch.float32
    for i, img in enumerate(raw):
        small = F.interpolate(img[None].double(), size=crop, mode="bilinear", align_corners=False)[0]
        want = amplitude_window(small, 0.15) if kind == "cfsi" else lab_stats(small)
        assert want.shape == bank.entries[i].shape
        torch.testing.assert_close(bank.entries[i].double(), want.double(), rtol=1e-4, atol=1e-2)
        torch.testing.assert_close(style_entry(kind, img, crop, 0.15), bank.entries[i], rtol=0, atol=0)
    if kind == "cfsi":  # 2 floor(0.15 * 18 / 2) + 1 = 3 rows, 2 floor(0.15 * 26 / 2) + 1 = 3 columns
        assert tuple(bank.entries.shape) == (5, 3, 3, 3)


def test_empty_bank_is_an_error() -> None:
    with pytest.raises(ValueError, match="empty"):
        build_style_bank("cfsi", TensorStore(torch.zeros((0, 3, 8, 8), dtype=torch.uint8)), [], (8, 8), 0.1, 0.5)


# ------------------------------------------------------------------------------------------ bank clients


@FEW
@given(k=st.integers(1, 200), fraction=st.floats(0.001, 1.0), seed=st.integers(0, 2**31))
def test_bank_clients_count_distinct_sorted_deterministic(k, fraction, seed) -> None:
    got = bank_clients(k, fraction, seed)
    assert len(got) == max(1, math.ceil(fraction * k))
    assert len(set(got.tolist())) == len(got)
    assert np.all(np.diff(got) > 0) and got.min() >= 0 and got.max() < k
    np.testing.assert_array_equal(bank_clients(k, fraction, seed), got)


def test_bank_clients_vary_with_the_seed_and_are_unbiased() -> None:
    draws = [tuple(bank_clients(100, 0.5, s).tolist()) for s in range(6)]
    assert len(set(draws)) == len(draws)
    counts = np.zeros(10, dtype=int)
    for s in range(200):
        counts[bank_clients(10, 0.5, s)] += 1
    assert counts.min() >= 70 and counts.max() <= 130  # 100 expected per client


def test_bank_clients_count_is_the_exact_ceiling() -> None:
    # 0.28 * 25 is 7.000000000000001 in floating point
    assert len(bank_clients(25, 0.28, 0)) == 7
    assert len(bank_clients(50, 0.14, 0)) == 7


# ------------------------------------------------------------------------------------ class pixel counts


def _label_store(seed: int, n: int, c: int) -> tuple[TensorLabelStore, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, c, (n, 9, 11), dtype=np.uint8)
    labels[rng.random(labels.shape) < 0.2] = IGNORE
    return TensorLabelStore(torch.from_numpy(labels)), labels


@FEW
@given(seed=st.integers(0, 10_000), n=st.integers(0, 23), c=st.integers(1, 20), chunk=st.integers(1, 9))
def test_class_pixel_counts_equal_bincounts(seed, n, c, chunk) -> None:
    store, labels = _label_store(seed, n, c)
    got = class_pixel_counts(store, c, chunk=chunk)
    assert got.shape == (n, c) and got.dtype == np.int64
    for i in range(n):
        lab = labels[i].ravel()
        np.testing.assert_array_equal(got[i], np.bincount(lab[lab != IGNORE], minlength=c))
    assert got.sum() == int((labels != IGNORE).sum())


def test_class_pixel_counts_with_threads_and_errors() -> None:
    store, labels = _label_store(4, 37, 7)
    ref = class_pixel_counts(store, 7, chunk=5)
    with Prefetcher(2) as pf:
        np.testing.assert_array_equal(class_pixel_counts(store, 7, prefetcher=pf, chunk=5), ref)
    labels = labels.copy()
    labels[23, 4, 4] = 7  # one class id too many in map 23
    bad = TensorLabelStore(torch.from_numpy(labels))
    with pytest.raises(ValueError, match=r"label map 23 holds class id 7 >= 7"):
        class_pixel_counts(bad, 7, chunk=5)
    with Prefetcher(2) as pf, pytest.raises(ValueError, match=r"label map 23\b"):
        class_pixel_counts(bad, 7, prefetcher=pf, chunk=5)
    assert class_pixel_counts(bad, 8)[23, 7] == 1  # fine with one more class


def test_fda_style_swaps_in_another_clients_window_with_lambda_one() -> None:
    """``kind = "fda"``: the bank entry replaces the image's amplitude window (FDA, lambda = 1), never the
    client's own entries; it equals ``functional.style.fda`` with lambda 1 of the drawn entry."""
    from fedsight.functional.style import amplitude_window, fda, to_uint8

    g = torch.Generator().manual_seed(0)
    styles = [torch.randint(0, 256, (3, 16, 24), generator=g, dtype=torch.uint8) for _ in range(3)]
    entries = torch.stack([amplitude_window(s.float(), 0.3) for s in styles])
    bank = StyleBank("fda", entries, np.array([0, 1, 2]), beta=0.3, prob=1.0)
    image = torch.randint(0, 256, (3, 16, 24), generator=g, dtype=torch.uint8)
    used = set()
    for seed in range(30):
        out = bank.apply(image, client=1, rng=np.random.default_rng(seed))
        matches = [k for k in range(3) if torch.equal(out, to_uint8(fda(image.float(), entries[k], 0.3, 1.0)))]
        assert matches and 1 not in matches
        used.update(matches)
    assert used == {0, 2}
    with pytest.raises(ValueError, match="style kind must be 'fda', 'cfsi' or 'lab'"):
        StyleBank("CFSI", entries, np.array([0, 1, 2]))


# ------------------------------------------------------------------------------------------ colour jitter


@FEW
@given(seed=st.integers(0, 2**31 - 1), factor=st.floats(0.0, 2.0))
def test_colour_operations_match_pil_image_enhance(seed, factor) -> None:
    """brightness, contrast and saturation against PIL's ImageEnhance (what torchvision's ColorJitter calls on
    PIL images, LADD's transform): at most one level apart (PIL truncates where these round)."""
    from PIL import Image, ImageEnhance

    from fedsight.functional.style import adjust_brightness, adjust_contrast, adjust_saturation

    img = np.random.default_rng(seed).integers(0, 256, (9, 13, 3), dtype=np.uint8)
    pil = Image.fromarray(img)
    x = torch.from_numpy(img).permute(2, 0, 1).contiguous()
    for ours, theirs in ((adjust_brightness, ImageEnhance.Brightness), (adjust_contrast, ImageEnhance.Contrast),
                         (adjust_saturation, ImageEnhance.Color)):
        want = np.asarray(theirs(pil).enhance(factor)).astype(np.int64)
        got = ours(x, factor).permute(1, 2, 0).numpy().astype(np.int64)
        assert np.abs(got - want).max() <= 1, (ours.__name__, factor)


def test_luma_is_pils_l_conversion_exactly() -> None:
    """Every colour of a 32-level RGB grid (and 190.5's tie, (131, 211, 241), on which a float luma rounded half to
    even was one level below PIL's and saturation 1.9375 then two levels off): equal to PIL's "L"."""
    from PIL import Image

    from fedsight.functional.style import luma

    levels = np.r_[np.arange(0, 256, 8), 255]
    grid = np.stack(np.meshgrid(levels, levels, levels, indexing="ij"), -1).reshape(-1, 1, 3)
    img = np.concatenate([grid, [[[131, 211, 241]]]]).astype(np.uint8)
    want = np.asarray(Image.fromarray(img).convert("L")).astype(np.int64)
    got = luma(torch.from_numpy(img).permute(2, 0, 1).float())[0].numpy().astype(np.int64)
    assert (got == want).all()


def test_colour_jitter_properties_and_stream() -> None:
    """Factor 1 is the identity; saturation 0 leaves grey (equal channels); contrast 0 one grey level; the draws
    (order, then factors in [1 - j, 1 + j]) come from the sample's stream after the geometry's, so geometry and
    labels are those of the unjittered batch."""
    from fedsight.data.seg_pipeline import jitter_colors
    from fedsight.functional.style import color_jitter

    images, labels = _stores()
    x = images.get_one(0)
    ones = {"brightness": 1.0, "contrast": 1.0, "saturation": 1.0}
    assert torch.equal(color_jitter(x, ones, ["contrast", "saturation", "brightness"]), x)
    grey = color_jitter(x, {**ones, "saturation": 0.0}, ["saturation"])
    assert torch.equal(grey[0], grey[1]) and torch.equal(grey[1], grey[2])
    assert color_jitter(x, {**ones, "contrast": 0.0}, ["contrast"]).unique().numel() == 1
    rng = np.random.default_rng(5)
    order = list(rng.permutation(3))
    f = [rng.uniform(0.5, 1.5) for _ in range(3)]
    names = ["brightness", "contrast", "saturation"]
    want = color_jitter(x, dict(zip(names, f)), [names[i] for i in order])
    assert torch.equal(jitter_colors(x, 0.5, np.random.default_rng(5)), want)
    plain = SegBatchLoader(images, labels, CROP, (0.75, 1.5), True, seed=3)
    jit = SegBatchLoader(images, labels, CROP, (0.75, 1.5), True, seed=3, jitter=0.5)
    job = ([0, 4, 7], ("augment", 1, 2, 0), 2)
    (xp, yp), (xj, yj) = plain(job), jit(job)
    assert torch.equal(yp, yj) and not torch.equal(xp, xj)
    for j, i in enumerate(job[0]):  # the jittered crop is the plain crop, jittered by the stream's next draws
        rng = np_rng(3, *job[1], j)
        augment_pair(images.get_one(i), labels.get_one(i), CROP, (0.75, 1.5), True, rng)
        assert torch.equal(xj[j], jitter_colors(xp[j], 0.5, rng))
