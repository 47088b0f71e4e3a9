"""Image SR data: DIV2K and benchmark folders (EDSR and BasicSR layouts) written in tmp_path, the three LR
modes, mod-crop, caching, the built-in photo split, and one-line errors naming the field or file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import fedsight.data.image_sr as isr
from fedsight.data.photos import PHOTO_LOADERS, load_photo
from fedsight.functional.resize import bicubic_degrade, imresize
from fedsight.registry import DATASETS, build

RNG = np.random.default_rng(0)


def write(path, h, w):
    """A random RGB PNG of h x w at ``path``; returns its pixels as uint8 [3, h, w]."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = RNG.integers(0, 256, (h, w, 3), dtype=np.uint8)
    Image.fromarray(arr).save(path)
    return torch.from_numpy(arr).permute(2, 0, 1)


def div2k(root, scale=2, sizes=((26, 30), (27, 33), (24, 24)), valid=((20, 22),)):
    """A DIV2K tree: HR images (sizes need not be multiples of scale) and LR files of the mod-cropped size
    over scale (random pixels: the loader must return what is on disk). Returns {id: (hr, lr)}."""
    out = {}
    for kind, first, szs in (("train", 1, sizes), ("valid", 801, valid)):
        for i, (h, w) in enumerate(szs):
            name = f"{first + i:04d}"
            hr = write(root / f"DIV2K_{kind}_HR" / f"{name}.png", h, w)
            lr = write(root / f"DIV2K_{kind}_LR_bicubic" / f"X{scale}" / f"{name}x{scale}.png", h // scale, w // scale)
            out[name] = (hr, lr)
    return out


def edsr_bench(root, scale=2, images=(("baby", 27, 30), ("bird", 22, 24))):
    out = {}
    for name, h, w in images:
        out[name] = (write(root / "HR" / f"{name}.png", h, w),
                     write(root / "LR_bicubic" / f"X{scale}" / f"{name}x{scale}.png", h // scale, w // scale))
    return out


def basicsr_bench(root, scale=2, images=(("comic", 24, 36), ("zebra", 36, 24))):
    out = {}
    for name, h, w in images:
        out[name] = (write(root / "GTmod12" / f"{name}.png", h, w),
                     write(root / f"LRbicx{scale}" / f"{name}.png", h // scale, w // scale))
    return out


def load(name, **params):
    return build(DATASETS, name, params, seed=0)


def test_div2k_and_both_benchmark_layouts_read_what_is_on_disk(tmp_path):
    files = div2k(tmp_path / "DIV2K")
    set5 = edsr_bench(tmp_path / "Set5")
    set14 = basicsr_bench(tmp_path / "Set14")
    s = load("div2k", root=str(tmp_path / "DIV2K"), scale=2, patch_size=4, test_sets=[str(tmp_path / "Set5"), str(tmp_path / "Set14")],
             valid_as_test=True)
    assert isinstance(s, isr.ImageSRSplits) and s.scale == 2 and s.patch_size == 4
    assert list(s.tests) == ["Set5", "Set14", "DIV2K_valid"]  # benchmark folders in order, then DIV2K_valid
    assert [im.name for im in s.train.images] == ["0001", "0002", "0003"] and s.train.labels.tolist() == [0, 0, 0]
    for im in s.train.images + s.tests["DIV2K_valid"].images:
        hr, lr = files[im.name]
        h, w = hr.shape[-2:]
        assert torch.equal(im.hr(), hr[:, : h - h % 2, : w - w % 2])  # mod-crop keeps the top-left
        assert torch.equal(im.lr(), lr) and im.lr().dtype == torch.uint8
    for name, ref in (("Set5", set5), ("Set14", set14)):
        assert sorted(im.name for im in s.tests[name].images) == sorted(ref)
        for im in s.tests[name].images:
            hr, lr = ref[im.name]
            assert torch.equal(im.lr(), lr)
            assert torch.equal(im.hr(), hr[:, : 2 * lr.shape[-2], : 2 * lr.shape[-1]])


def test_train_images_by_count_or_id(tmp_path):
    div2k(tmp_path)
    base = {"root": str(tmp_path), "scale": 2, "patch_size": 4, "valid_as_test": True}
    assert [im.name for im in load("div2k", **base, train_images=2).train.images] == ["0001", "0002"]
    assert [im.name for im in load("div2k", **base, train_images=["0003", "0001"]).train.images] == ["0003", "0001"]
    with pytest.raises(ValueError, match="train_images.*0009"):
        load("div2k", **base, train_images=["0009"])


def test_mod_crop_at_scale_4(tmp_path):
    hr = write(tmp_path / "flat" / "a.png", 27, 31)
    im = isr.load_sr_folder(tmp_path / "flat", isr.SRDataParams(scale=4, lr="bicubic"), isr.ImageCache(0))[0]
    assert im.hr_size == (24, 28) and im.lr_size == (6, 7)
    assert torch.equal(im.hr(), hr[:, :24, :28])
    assert torch.equal(isr.mod_crop(hr, 4), hr[:, :24, :28])


def test_generated_bicubic_lr_is_bicubic_degrade_and_needs_no_lr_files(tmp_path):
    div2k(tmp_path, scale=3, sizes=((25, 31), (30, 36)))
    for f in (tmp_path / "DIV2K_train_LR_bicubic" / "X3").iterdir():
        f.unlink()
    s = load("div2k", root=str(tmp_path), scale=3, patch_size=4, lr="bicubic", valid_as_test=True)
    for im in s.train.images:
        assert im.hr_size[0] % 3 == 0 and im.hr_size[1] % 3 == 0
        assert torch.equal(im.lr(), bicubic_degrade(im.hr(), 3))
        assert not torch.equal(im.lr(), im.hr()[:, ::3, ::3])


@pytest.mark.parametrize("offset", [0, 1, 2])
def test_decimated_lr_keeps_pixel_s_i_plus_offset(tmp_path, offset):
    edsr_bench(tmp_path / "Set5", scale=3, images=(("a", 25, 31),))
    s = load("sr_benchmark", train_sets=[str(tmp_path / "Set5")], test_sets=[str(tmp_path / "Set5")], scale=3, patch_size=4,
             lr="decimate", decimate_offset=offset)
    im = s.train.images[0]
    hr = im.hr()
    assert torch.equal(im.lr(), hr[:, offset::3, offset::3])
    assert im.lr()[:, 2, 5].tolist() == hr[:, 3 * 2 + offset, 3 * 5 + offset].tolist()


def test_sr_benchmark_labels_are_training_folders(tmp_path):
    edsr_bench(tmp_path / "T91")
    basicsr_bench(tmp_path / "BSD")
    basicsr_bench(tmp_path / "Set14")
    s = load("sr_benchmark", train_sets=[str(tmp_path / "T91"), str(tmp_path / "BSD")], test_sets=[str(tmp_path / "Set14")],
             scale=2, patch_size=4)
    assert s.train.class_names == ["T91", "BSD"] and s.train.labels.tolist() == [0, 0, 1, 1]
    assert list(s.tests) == ["Set14"] and s.train.subset([3]).images[0].name == s.train.images[3].name


def test_lru_cache_and_in_memory(tmp_path):
    edsr_bench(tmp_path / "S")
    p = isr.SRDataParams(scale=2, lr="bicubic", cache_images=1)
    a, b = isr.load_sr_folder(tmp_path / "S", p, isr.ImageCache(1))
    first = a.pair()
    assert a.pair() is first  # cached
    b.pair()  # evicts a (capacity 1)
    again = a.pair()
    assert again is not first and all(torch.equal(x, y) for x, y in zip(again, first))
    a2, _ = isr.load_sr_folder(tmp_path / "S", p.model_copy(update={"in_memory": True}), isr.ImageCache(0))
    assert a2.pair() is a2.pair() and torch.equal(a2.hr(), first[0])


# -- errors: one line, naming the field or the file ----------------------------------------------------


def one_line(exc):
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_missing_lr_file_names_the_file(tmp_path):
    edsr_bench(tmp_path / "Set5")
    missing = tmp_path / "Set5" / "LR_bicubic" / "X2" / "birdx2.png"
    missing.unlink()
    with pytest.raises(FileNotFoundError) as exc:
        load("sr_benchmark", train_sets=[str(tmp_path / "Set5")], test_sets=[str(tmp_path / "Set5")], scale=2, patch_size=4)
    assert str(missing) in one_line(exc)
    with pytest.raises(FileNotFoundError) as exc:  # no LR folder for this scale at all
        load("sr_benchmark", train_sets=[str(tmp_path / "Set5")], test_sets=[str(tmp_path / "Set5")], scale=3, patch_size=4)
    assert str(tmp_path / "Set5" / "LR_bicubic" / "X3") in one_line(exc)


def test_lr_of_the_wrong_size_names_both_files(tmp_path):
    basicsr_bench(tmp_path / "Set14")
    bad = tmp_path / "Set14" / "LRbicx2" / "comic.png"
    write(bad, 11, 18)  # HR 24x36 -> LR must be 12x18
    with pytest.raises(ValueError) as exc:
        load("sr_benchmark", train_sets=[str(tmp_path / "Set14")], test_sets=[str(tmp_path / "Set14")], scale=2, patch_size=4)
    msg = one_line(exc)
    assert str(bad) in msg and str(tmp_path / "Set14" / "GTmod12" / "comic.png") in msg and "18x12" in msg


def test_folder_and_image_errors(tmp_path):
    with pytest.raises(FileNotFoundError) as exc:
        load("div2k", root=str(tmp_path / "nope"), valid_as_test=True)
    assert "nope" in one_line(exc)
    with pytest.raises(ValueError, match="test_sets"):
        load("div2k", root=str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError) as exc:
        load("sr_benchmark", train_sets=[str(tmp_path / "empty")], test_sets=[str(tmp_path / "empty")], lr="bicubic")
    assert "no images" in one_line(exc) and "empty" in str(exc.value)
    # a plain folder has no LR files
    write(tmp_path / "flat" / "a.png", 40, 40)
    with pytest.raises(FileNotFoundError, match="LR folder"):
        load("sr_benchmark", train_sets=[str(tmp_path / "flat")], test_sets=[str(tmp_path / "flat")], scale=2, patch_size=4)
    # an unreadable file
    (tmp_path / "flat" / "b.png").write_bytes(b"not a png")
    with pytest.raises(ValueError) as exc:
        load("sr_benchmark", train_sets=[str(tmp_path / "flat")], test_sets=[str(tmp_path / "flat")], scale=2, patch_size=4,
             lr="bicubic")
    assert str(tmp_path / "flat" / "b.png") in one_line(exc)
    (tmp_path / "flat" / "b.png").unlink()
    # a training image smaller than the HR patch
    with pytest.raises(ValueError) as exc:
        load("sr_benchmark", train_sets=[str(tmp_path / "flat")], test_sets=[str(tmp_path / "flat")], scale=2, patch_size=24,
             lr="bicubic")
    assert str(tmp_path / "flat" / "a.png") in one_line(exc) and "48" in str(exc.value)


def test_parameter_errors_name_the_field():
    with pytest.raises(ValueError, match="decimate_offset"):
        isr.SRDataParams(scale=2, decimate_offset=2)
    with pytest.raises(ValueError, match="lr = 'bicubic' or 'decimate'"):
        isr.BuiltinSRParams(lr="disk")
    with pytest.raises(ValueError, match="'china' is in both sources and test_sets.photos"):
        isr.BuiltinSRParams(sources=["chelsea", "china"])
    with pytest.raises(ValueError, match="unknown photo 'lena'"):
        isr.BuiltinSRParams(test_sets={"x": ["lena"]})
    with pytest.raises(ValueError, match="tile = 50 is not a multiple of scale 4"):
        isr.BuiltinSRParams(tile=50)


# -- built-in photos ----------------------------------------------------------------------------------


def test_builtin_split_is_disjoint_by_default():
    p = isr.BuiltinSRParams()
    test_photos = {n for v in p.test_sets.values() for n in v}
    assert list(p.test_sets) == ["photos", "textures"] and len(p.test_sets["textures"]) >= 2
    assert not test_photos & set(p.sources) and test_photos <= set(PHOTO_LOADERS)


def shrink(name, side):
    photo = load_photo(name)
    if max(photo.shape[-2:]) > side:
        photo = imresize(photo, side / max(photo.shape[-2:]))
    return photo.round().clamp(0, 255).to(torch.uint8)


def test_builtin_tiles_and_test_sets():
    s = load("builtin_sr", sources=["chelsea", "coffee"], tile=64, train_max_side=200, scale=2, patch_size=8,
             test_sets={"photos": ["flower"], "textures": ["brick", "camera"]}, test_max_side=48, lr="decimate")
    assert s.train.class_names == ["chelsea", "coffee"] and list(s.tests) == ["photos", "textures"]
    for label, name in enumerate(["chelsea", "coffee"]):
        photo = shrink(name, 200)
        rows, cols = photo.shape[-2] // 64, photo.shape[-1] // 64
        tiles = [im for im in s.train.images if im.label == label]
        assert len(tiles) == rows * cols > 0
        for im in tiles:
            r, c = (int(v) for v in im.name.split("_r")[1].split("c"))
            assert torch.equal(im.hr(), photo[:, 64 * r : 64 * r + 64, 64 * c : 64 * c + 64])
            assert torch.equal(im.lr(), im.hr()[:, ::2, ::2])
    for im in s.tests["textures"].images:
        assert max(im.hr_size) <= 48 and torch.equal(im.hr(), isr.mod_crop(shrink(im.name, 48), 2))
        assert torch.equal(im.hr()[0], im.hr()[1])  # grey photos: three equal channels
