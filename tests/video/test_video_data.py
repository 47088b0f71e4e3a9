"""REDS/Vid4-style frame-folder loader, REDS4 exclusion, and the camera-motion clip generator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedsight.data.partition import make_client_splits
from fedsight.data.photos import load_photo
from fedsight.data.video import REDS4
from fedsight.data.video_synth import CameraPath, render_clip
from fedsight.functional.resize import bicubic_degrade
from fedsight.registry import DATASETS, build


def _write_clip(root: Path, name: str, frames: int, h: int, w: int, seed: int, names=None) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    d = root / name
    d.mkdir(parents=True)
    arrays = []
    for i in range(frames):
        arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        fname = names[i] if names else f"{i:08d}.png"
        Image.fromarray(arr).save(d / fname)
        arrays.append(arr)
    return arrays


@pytest.fixture
def reds(tmp_path):
    root = tmp_path / "train_sharp"
    written = {}
    for k, clip in enumerate(["000", "001", "002", "011", "015", "020"]):
        written[clip] = _write_clip(root, clip, 4, 18, 26, k)  # 18x26: mod-crop to 16x24 at x4
    # unpadded frame numbers: must sort numerically (2 before 10), not as strings
    written["003"] = _write_clip(root, "003", 3, 16, 24, 9, names=["10.png", "2.png", "1.png"])
    return root, written


def _load(root, **kw):
    params = {"root": str(root), "scale": 4, "num_frames": 2, "patch_size": 4, **kw}
    return build(DATASETS, "video_frames", params, seed=0)


def test_reads_frames_and_holds_out_reds4(reds):
    root, written = reds
    splits = _load(root)
    assert [c.name for c in splits.train.clips] == ["001", "002", "003"]
    assert [c.name for c in splits.test.clips] == list(REDS4)
    clip = splits.train.clips[0]
    assert len(clip) == 4 and clip.hr_size == (16, 24)
    expected = torch.from_numpy(np.stack(written["001"])).permute(0, 3, 1, 2)[..., :16, :24]
    torch.testing.assert_close(clip.hr(0, 4), expected)
    torch.testing.assert_close(clip.lr(1, 2), bicubic_degrade(expected[1:3], 4))
    assert clip.lr(0, 1).shape == (1, 3, 4, 6)
    # numeric frame order: 1.png, 2.png, 10.png
    c3 = splits.train.clips[2]
    order = [written["003"][i] for i in (2, 1, 0)]  # written as 10.png, 2.png, 1.png
    torch.testing.assert_close(c3.hr(0, 3), torch.from_numpy(np.stack(order)).permute(0, 3, 1, 2))
    assert splits.train.labels.tolist() == [0, 1, 2] and splits.num_classes == 3


def test_reds4_can_be_kept_and_test_root_used(reds, tmp_path):
    root, _ = reds
    assert len(_load(root, exclude_test_clips=False).train) == 7
    vid4 = tmp_path / "Vid4"
    _write_clip(vid4, "calendar", 3, 16, 20, 11)
    _write_clip(vid4, "city", 2, 20, 16, 12)
    splits = _load(root, test_root=str(vid4), in_memory=True)
    assert [c.name for c in splits.test.clips] == ["calendar", "city"]
    assert "000" not in [c.name for c in splits.train.clips]  # REDS4 still excluded from training
    assert splits.test.clips[1].hr_size == (20, 16)


def test_category_layout_and_partition(tmp_path):
    root = tmp_path / "kinetics"
    for cat in ("archery", "cooking"):
        for k in range(3):
            _write_clip(root / cat, f"v{k}", 2, 16, 16, hash((cat, k)) % 1000)
    splits = _load(root, layout="categories", test_clips=["archery/v0"], max_frames=2)
    assert splits.train.class_names == ["archery", "cooking"]
    assert splits.train.labels.tolist() == [0, 0, 1, 1, 1]
    parts = make_client_splits(splits.train.labels, num_clients=2, partitioner="classes",
                               params={"classes_per_client": 1}, seed=0, local_test_fraction=0.0)
    assert sorted(len(set(splits.train.labels[p.train])) for p in parts) == [1, 1]


def test_clear_errors(reds, tmp_path):
    root, _ = reds
    with pytest.raises(FileNotFoundError, match="folder not found"):
        _load(tmp_path / "nope")
    with pytest.raises(ValueError, match="test clips"):
        _load(root, test_clips=["999"])
    with pytest.raises(ValueError, match="fewer than num_frames"):
        _load(root, num_frames=4)  # clip 003 has 3 frames
    (root / "001" / "00000001.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match="00000001.png"):
        _load(root, in_memory=True)


TINY_GEN = {
    "sources": ["astronaut", "coffee", "chelsea"], "test_sources": ["china"], "clips_per_source": 2,
    "test_clips_per_source": 1, "clip_length": 5, "frame_size": 48, "scale": 4, "num_frames": 3, "patch_size": 8,
}


def test_generator_is_deterministic_and_labelled():
    a = build(DATASETS, "synthetic_video", TINY_GEN, seed=0)
    b = build(DATASETS, "synthetic_video", TINY_GEN, seed=5)  # data_seed = 0: the run seed does not matter
    c = build(DATASETS, "synthetic_video", {**TINY_GEN, "data_seed": 1}, seed=0)
    assert len(a.train) == 6 and len(a.test) == 1
    assert a.train.labels.tolist() == [0, 0, 1, 1, 2, 2] and a.train.class_names == ["astronaut", "coffee", "chelsea"]
    for x, y in zip(a.train.clips, b.train.clips):
        assert torch.equal(x.hr(0, 5), y.hr(0, 5)) and torch.equal(x.lr(0, 5), y.lr(0, 5))
    assert not torch.equal(a.train.clips[0].hr(0, 5), c.train.clips[0].hr(0, 5))
    clip = a.train.clips[0]
    assert clip.hr(0, 5).shape == (5, 3, 48, 48) and clip.lr(0, 5).shape == (5, 3, 12, 12)


def test_generated_frames_move_smoothly():
    photo = load_photo("astronaut")
    path = CameraPath(fov=0.3, speed=2.0, direction=0.0, zoom=1.0, rotation=0.0)
    frames = render_clip(photo, 4, 48, path, np.random.default_rng(0)).double()
    # a pure horizontal pan of 2 px/frame: frame t+1 is frame t shifted left by 2 columns
    diff_shifted = (frames[1:, :, :, :-2] - frames[:-1, :, :, 2:]).abs().mean()
    diff_static = (frames[1:] - frames[:-1]).abs().mean()
    assert diff_shifted < 0.5 and diff_static > 4 * diff_shifted
    moving = CameraPath(fov=0.3, speed=1.0, direction=1.0, zoom=1.2, rotation=3.0)
    frames = render_clip(photo, 6, 48, moving, np.random.default_rng(1))
    assert frames.dtype == torch.uint8 and frames.shape == (6, 3, 48, 48)
    assert frames.double().std() > 20  # real photo content, not a flat image


def test_generator_partitions():
    splits = build(DATASETS, "synthetic_video", TINY_GEN, seed=0)
    one = make_client_splits(splits.train.labels, num_clients=3, partitioner="classes",
                             params={"classes_per_client": 1}, seed=0, local_test_fraction=0.0)
    assert sorted(tuple(sorted(set(splits.train.labels[p.train]))) for p in one) == [(0,), (1,), (2,)]
    iid = make_client_splits(splits.train.labels, num_clients=3, partitioner="iid", seed=0, local_test_fraction=0.0)
    assert [len(p.train) for p in iid] == [2, 2, 2]


def test_generator_rejects_bad_params():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="multiple of scale"):
        DATASETS.get("synthetic_video").params(frame_size=50, scale=4)
    with pytest.raises(ValidationError, match="unknown photo"):
        DATASETS.get("synthetic_video").params(sources=["lena"])
