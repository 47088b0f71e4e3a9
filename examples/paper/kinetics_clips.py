"""Kinetics-style clips for FedVSR's "more heterogeneous" setting (Dehaghi et al. 2025, section 5.1; digest
``notes/000_fedvsr.md`` section 3.2): from a folder of videos sorted by class, the clip folders that FedSight's
``video_frames`` loader reads with ``layout = "categories"`` (``examples/paper/fedvsr_table*_kinetics.toml``).

Input: ``SRC/<class>/<video>``, where each video is either a folder of its frames (PNG/JPEG/BMP, ordered by the
numbers in their names, e.g. as ``ffmpeg -i v.mp4 v/%05d.png`` writes them) or a video file (``.mp4``, ``.avi``,
``.mkv``, ``.webm``, ``.mov``), decoded with PyAV (``pip install av``, the ``video`` extra) when it is installed.

What it does, as the paper describes its 240 clips ("only 720x1280 videos", 40 classes chosen at random, 6 videos
a class, one 100-frame clip from each, to match REDS):

* a video is *eligible* when it has at least ``--frames`` frames from ``--start`` on and, with ``--size HxW``, its
  frames are exactly that size (the paper: 720x1280); a class is eligible with at least ``--videos`` eligible
  videos;
* ``--classes`` eligible classes are drawn at random (``--seed``; all of them when unset) and, in each, ``--videos``
  eligible videos (the first ones in name order with ``--first``; the authors' choice of classes and videos is not
  published, so any draw rebuilds the setting, not their clips);
* each chosen video gives the frames ``--start .. --start + --frames - 1``, cropped at the top-left to a multiple
  of ``--scale`` (BasicSR's ``mod_crop``, as the loader does), written as ``OUT/<class>/<video>/<00000000>.png``
  (REDS's 8-digit names); with ``--lr LR_OUT`` their BI low-resolution frames (MATLAB bicubic with antialiasing,
  ``fedsight.functional.resize.bicubic_degrade``, rounded to 8 bits: exactly what the loader computes on the fly)
  go to ``LR_OUT/<class>/<video>/<00000000>.png`` for tools that read LR from disk (the authors' scripts made
  theirs with MATLAB's ``imresize``, ``generate_LR_for_Kinetics.m``);
* ``OUT/clips.json`` records each clip's source, first frame, frame count and size, and the command's settings.

Bad input (a missing or non-empty output folder, too few eligible classes, an unreadable frame or video, frames
of one video that differ in size) is one line naming the file or value on stderr, exit code 2, and nothing
written: the clips are assembled in a temporary folder beside OUT and moved into place at the end.

    python examples/paper/kinetics_clips.py kinetics400/train data/kinetics240 --classes 40 --videos 6 \\
        --frames 100 --size 720x1280 --seed 0 --lr data/kinetics240_LRx4
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from fedsight.data.video import list_frames, natural_key, read_frame
from fedsight.functional.resize import bicubic_degrade

VIDEO_EXTENSIONS = (".mp4", ".avi", ".mkv", ".webm", ".mov")


class BadInput(ValueError):
    """A problem with the input, reported as one line."""


# -- reading a video -------------------------------------------------------------------------------------------


def has_decoder() -> bool:
    """Whether PyAV is installed (it decodes the video files)."""
    import importlib.util

    return importlib.util.find_spec("av") is not None


def videos_of(cls: Path) -> list[Path]:
    """A class folder's videos: frame folders and (with a decoder) video files, in name order."""
    out = [p for p in cls.iterdir() if (p.is_dir() and list_frames(p)) or
           (p.is_file() and p.suffix.lower() in VIDEO_EXTENSIONS)]
    return sorted(out, key=natural_key)


def probe(video: Path) -> tuple[int, tuple[int, int]]:
    """(number of frames, (H, W) of the first frame) of a frame folder or video file."""
    if video.is_dir():
        frames = list_frames(video)
        try:
            with Image.open(frames[0]) as im:
                w, h = im.size
        except OSError as e:
            raise BadInput(f"{frames[0]}: not a readable image ({e})") from None
        return len(frames), (h, w)
    if not has_decoder():
        raise BadInput(f"{video}: reading video files needs PyAV (pip install av); extract the frames instead")
    import av

    try:
        with av.open(str(video)) as container:
            stream = container.streams.video[0]
            count = stream.frames or sum(1 for _ in container.decode(stream))
            return count, (stream.codec_context.height, stream.codec_context.width)
    except (av.FFmpegError, IndexError) as e:
        raise BadInput(f"{video}: not a readable video ({e})") from None


def read_frames(video: Path, start: int, count: int) -> list[torch.Tensor]:
    """Frames ``start .. start + count - 1`` as uint8 ``[3, H, W]`` RGB."""
    if video.is_dir():
        out = []
        for path in list_frames(video)[start:start + count]:
            try:
                out.append(read_frame(path))
            except ValueError as e:
                raise BadInput(str(e)) from None
        return out
    import av

    out = []
    try:
        with av.open(str(video)) as container:
            for k, frame in enumerate(container.decode(video=0)):
                if k >= start:
                    out.append(torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1).contiguous())
                if len(out) == count:
                    break
    except av.FFmpegError as e:
        raise BadInput(f"{video}: decoding failed ({e})") from None
    if len(out) < count:
        raise BadInput(f"{video}: {len(out)} frames from frame {start}, {count} needed")
    return out


# -- choosing and writing the clips ------------------------------------------------------------------------------


def eligible(src: Path, frames: int, start: int, size: tuple[int, int] | None) -> dict[str, list[Path]]:
    """class -> its eligible videos (at least ``start + frames`` frames, of ``size`` when given)."""
    out: dict[str, list[Path]] = {}
    for cls in sorted((p for p in src.iterdir() if p.is_dir()), key=natural_key):
        ok = []
        for video in videos_of(cls):
            n, hw = probe(video)
            if n >= start + frames and (size is None or hw == size):
                ok.append(video)
        out[cls.name] = ok
    return out


def choose(pool: dict[str, list[Path]], classes: int | None, videos: int, seed: int, first: bool
           ) -> dict[str, list[Path]]:
    """``classes`` random classes with at least ``videos`` eligible videos, and ``videos`` of each."""
    ok = sorted((c for c, v in pool.items() if len(v) >= videos), key=natural_key)
    want = len(ok) if classes is None else classes
    if want == 0 or len(ok) < want:
        raise BadInput(f"--classes {want}: only {len(ok)} classes have {videos} eligible videos "
                       f"(of {len(pool)} classes)")
    rng = random.Random(seed)
    picked = sorted(rng.sample(ok, want), key=natural_key)
    return {c: (pool[c][:videos] if first else sorted(rng.sample(pool[c], videos), key=natural_key))
            for c in picked}


def write_png(frame: torch.Tensor, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.ascontiguousarray(frame.permute(1, 2, 0).numpy())).save(path)


def prepare(src: Path, out: Path, lr_out: Path | None, classes: int | None, videos: int, frames: int, start: int,
            size: tuple[int, int] | None, scale: int, seed: int, first: bool) -> list[dict]:
    """Write the clips (see the module docstring); returns the manifest's clip entries."""
    for target in [out] + ([lr_out] if lr_out is not None else []):
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise BadInput(f"{target}: the output folder exists and is not empty")
    if not src.is_dir():
        raise BadInput(f"{src}: folder not found")
    chosen = choose(eligible(src, frames, start, size), classes, videos, seed, first)
    staging = [Path(tempfile.mkdtemp(prefix=f".{t.name}.", dir=t.parent if t.parent.exists() else None))
               for t in [out] + ([lr_out] if lr_out is not None else [])]
    try:
        entries = []
        for cls, vids in chosen.items():
            for video in vids:
                clip = read_frames(video, start, frames)
                h, w = clip[0].shape[-2:]
                if any(f.shape != clip[0].shape for f in clip):
                    raise BadInput(f"{video}: frames differ in size")
                h, w = h - h % scale, w - w % scale
                if h == 0 or w == 0:
                    raise BadInput(f"{video}: frames smaller than --scale {scale}")
                name = video.stem if video.is_file() else video.name
                for k, frame in enumerate(clip):
                    hr = frame[:, :h, :w]
                    write_png(hr, staging[0] / cls / name / f"{k:08d}.png")
                    if lr_out is not None:
                        write_png(bicubic_degrade(hr, scale), staging[1] / cls / name / f"{k:08d}.png")
                entries.append({"clip": f"{cls}/{name}", "source": str(video), "start": start, "frames": frames,
                                "hr_size": [h, w]})
        settings = {"classes": len(chosen), "videos": videos, "frames": frames, "start": start,
                    "size": list(size) if size else None, "scale": scale, "seed": seed, "first": first,
                    "lr": str(lr_out) if lr_out is not None else None}
        (staging[0] / "clips.json").write_text(json.dumps({"settings": settings, "clips": entries}, indent=1) + "\n")
        for stage, target in zip(staging, [out] + ([lr_out] if lr_out is not None else [])):
            if target.exists():
                target.rmdir()  # empty (checked above)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(stage), str(target))
        return entries
    finally:
        for stage in staging:
            shutil.rmtree(stage, ignore_errors=True)


def parse_size(text: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--size must be HxW (e.g. 720x1280), got {text!r}") from None
    return h, w


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="SRC/<class>/<video> (frame folders or video files)")
    ap.add_argument("out", type=Path, help="the clips: OUT/<class>/<video>/<frame>.png")
    ap.add_argument("--lr", type=Path, default=None, help="also write the bicubic LR frames here")
    ap.add_argument("--classes", type=int, default=None, help="classes drawn at random (default: every eligible)")
    ap.add_argument("--videos", type=int, default=6, help="videos per class (the paper: 6)")
    ap.add_argument("--frames", type=int, default=100, help="frames per clip (the paper: 100)")
    ap.add_argument("--start", type=int, default=0, help="first frame of each clip")
    ap.add_argument("--size", type=parse_size, default=None, help="keep only videos of this HxW (paper: 720x1280)")
    ap.add_argument("--scale", type=int, default=4, help="super-resolution factor of the LR frames")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random choice of classes and videos")
    ap.add_argument("--first", action="store_true", help="the first eligible videos of a class, not random ones")
    args = ap.parse_args(argv)
    for name in ("videos", "frames", "scale"):
        if getattr(args, name) < 1:
            print(f"error: --{name} must be at least 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if args.start < 0 or (args.classes is not None and args.classes < 1):
        print("error: --start must be >= 0 and --classes >= 1", file=sys.stderr)
        return 2
    try:
        entries = prepare(args.src, args.out, args.lr, args.classes, args.videos, args.frames, args.start,
                          args.size, args.scale, args.seed, args.first)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{len(entries)} clips of {args.frames} frames in {len({e['clip'].split('/')[0] for e in entries})} "
          f"classes -> {args.out}" + (f" (LR x{args.scale}: {args.lr})" if args.lr else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
