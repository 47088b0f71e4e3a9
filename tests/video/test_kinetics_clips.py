"""examples/paper/kinetics_clips.py: Kinetics-style class folders of videos (frame folders or video files) into the
clip layout the ``video_frames`` loader reads (``layout = "categories"``), HR and bicubic LR, on tiny fixtures."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedsight.functional.resize import bicubic_degrade
from fedsight.registry import DATASETS, build

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "paper" / "kinetics_clips.py"


@pytest.fixture(scope="module")
def kc():
    spec = importlib.util.spec_from_file_location("kinetics_clips", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _video(folder: Path, frames: int, h: int, w: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(frames)]
    folder.mkdir(parents=True)
    for k, a in enumerate(arrays):  # ffmpeg's %05d names, from 1
        Image.fromarray(a).save(folder / f"{k + 1:05d}.png")
    return arrays


@pytest.fixture
def src(tmp_path):
    """3 classes: archery (3 good videos), bowling (2 good, 1 too short, 1 of another size), cooking (1 good)."""
    root, frames = tmp_path / "kinetics", {}
    for cls, vids in {"archery": [("a1", 5, 10, 15), ("a2", 6, 10, 15), ("a3", 5, 10, 15)],
                      "bowling": [("b1", 5, 10, 15), ("b2", 3, 10, 15), ("b3", 5, 12, 15), ("b4", 5, 10, 15)],
                      "cooking": [("c1", 5, 10, 15), ("c2", 2, 10, 15)]}.items():
        for k, (name, n, h, w) in enumerate(vids):
            frames[f"{cls}/{name}"] = _video(root / cls / name, n, h, w, hash(name) % 1000)
    return root, frames


def test_clips_hr_and_lr_in_the_loaders_layout(kc, src, tmp_path, capsys):
    root, frames = src
    out, lr = tmp_path / "data" / "kinetics240", tmp_path / "data" / "kinetics240_LRx2"
    argv = [str(root), str(out), "--lr", str(lr), "--classes", "2", "--videos", "2", "--frames", "4", "--start", "1",
            "--size", "10x15", "--scale", "2", "--seed", "3"]
    assert kc.main(argv) == 0
    assert "4 clips of 4 frames in 2 classes" in capsys.readouterr().out
    # cooking has one eligible video (c2 is too short): only archery and bowling can hold 2; b2 (short) and
    # b3 (12x15) are never chosen
    clips = sorted(str(p.relative_to(out)) for p in out.glob("*/*"))
    assert [c.split("/")[0] for c in clips] == ["archery", "archery", "bowling", "bowling"]
    assert {c for c in clips if c.startswith("bowling")} == {"bowling/b1", "bowling/b4"}
    manifest = json.loads((out / "clips.json").read_text())
    assert [e["clip"] for e in manifest["clips"]] == clips and manifest["settings"]["seed"] == 3
    for clip in clips:
        names = sorted(p.name for p in (out / clip).iterdir())
        assert names == [f"{k:08d}.png" for k in range(4)]
        for k in range(4):  # frames 1..4 of the source (its 2nd to 5th), mod-cropped to 10x14 at x2
            hr = np.asarray(Image.open(out / clip / f"{k:08d}.png"))
            np.testing.assert_array_equal(hr, frames[clip][k + 1][:10, :14])
    # the loader reads the layout, and the LR PNGs are exactly its on-the-fly BI degradation
    splits = build(DATASETS, "video_frames", {"root": str(out), "layout": "categories", "test_root": str(out / "archery"),
                                              "scale": 2, "num_frames": 2, "patch_size": 4}, seed=0)
    assert sorted(c.name for c in splits.train.clips) == clips
    assert len({c.category for c in splits.train.clips}) == 2
    for c in splits.train.clips:
        disk = torch.stack([torch.from_numpy(np.array(Image.open(lr / c.name / f"{k:08d}.png")))
                            for k in range(4)]).permute(0, 3, 1, 2)
        assert disk.shape == (4, 3, 5, 7)
        torch.testing.assert_close(disk, c.lr(0, 4))
        torch.testing.assert_close(disk, bicubic_degrade(c.hr(0, 4), 2))
    # the same seed draws the same clips; --first takes the first eligible videos
    assert kc.main(argv[:1] + [str(tmp_path / "again")] + argv[4:]) == 0
    assert sorted(str(p.relative_to(tmp_path / "again")) for p in (tmp_path / "again").glob("*/*")) == clips
    assert kc.main([str(root), str(tmp_path / "first"), "--videos", "1", "--frames", "5", "--first"]) == 0
    assert sorted(str(p.relative_to(tmp_path / "first")) for p in (tmp_path / "first").glob("*/*")) == \
        ["archery/a1", "bowling/b1", "cooking/c1"]
    # --size leaves b3 (12x15) out, --frames 4 leaves b2 (3 frames) out: bowling's first two are b1 and b4
    assert kc.main([str(root), str(tmp_path / "sized"), "--videos", "2", "--frames", "4", "--first",
                    "--size", "10x15"]) == 0
    assert sorted(str(p.relative_to(tmp_path / "sized")) for p in (tmp_path / "sized").glob("bowling/*")) == \
        ["bowling/b1", "bowling/b4"]


def _nothing_written(tmp_path: Path, out: Path) -> bool:
    return not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_bad_input_is_one_line_and_writes_nothing(kc, src, tmp_path, capsys):
    root, _ = src
    out = tmp_path / "o" / "clips"
    out.parent.mkdir()
    cases = [(["--classes", "3", "--videos", "2", "--frames", "4"], "--classes 3: only 2 classes have 2 eligible"),
             (["--frames", "0"], "--frames must be at least 1")]
    for extra, message in cases:
        assert kc.main([str(root), str(out)] + extra) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err
        assert _nothing_written(tmp_path, out)
    # an unreadable frame, found while writing: named, and the clips written before it are removed
    bad = root / "bowling" / "b1" / "00003.png"
    bad.write_bytes(b"not a png")
    assert kc.main([str(root), str(out), "--videos", "2", "--frames", "4", "--first"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(bad) in err
    assert _nothing_written(tmp_path, out)
    out.mkdir()
    (out / "x").write_text("")
    assert kc.main([str(root), str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err


def test_video_files_are_decoded_with_pyav(kc, tmp_path):
    av = pytest.importorskip("av")
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (12, 16, 3), dtype=np.uint8) for _ in range(5)]
    (tmp_path / "src" / "surfing").mkdir(parents=True)
    with av.open(str(tmp_path / "src" / "surfing" / "v1.mov"), "w") as container:  # lossless PNG frames
        stream = container.add_stream("png", rate=10)
        stream.width, stream.height, stream.pix_fmt = 16, 12, "rgb24"
        for f in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        container.mux(stream.encode())
    (tmp_path / "src" / "surfing" / "v2.mp4").write_bytes(b"\x00" * 64)  # a broken file is refused, not skipped
    assert kc.main([str(tmp_path / "src"), str(tmp_path / "bad"), "--videos", "1", "--frames", "3"]) == 2
    (tmp_path / "src" / "surfing" / "v2.mp4").unlink()
    assert kc.main([str(tmp_path / "src"), str(tmp_path / "out"), "--videos", "1", "--frames", "3", "--start", "2",
                    "--size", "12x16"]) == 0
    for k in range(3):
        hr = np.asarray(Image.open(tmp_path / "out" / "surfing" / "v1" / f"{k:08d}.png"))
        np.testing.assert_array_equal(hr, frames[k + 2])
