"""CIFAR-10 / CIFAR-100 / STL-10 from their official binary releases into the image folders the paper presets
read (``fedvg_cifar10.toml``: ``data/cifar10/all/<class>/``, and for its public validation sets
``data/stl10/{train,test}/<class>/`` and ``data/cifar100/{train,test}/<class>/``; ``fed3r_cifar100.toml``:
``data/cifar100/{train,test}/<class>/``).

The binary version (cifar-10-binary.tar.gz, cifar-100-binary.tar.gz from www.cs.toronto.edu/~kriz/cifar.html),
unpacked, is read as raw records, never unpickled: CIFAR-10's are 1 label byte + 3,072 pixel bytes
(``data_batch_1..5.bin``, ``test_batch.bin``, class names in ``batches.meta.txt``), CIFAR-100's 1 coarse + 1 fine
label byte + 3,072 pixel bytes (``train.bin``, ``test.bin``, ``fine_label_names.txt``); pixels are the red, green
and blue planes of a 32x32 image, row-major. STL-10's (stl10_binary.tar.gz from cs.stanford.edu/~acoates/stl10)
are ``train_X.bin``/``test_X.bin`` (3 x 96 x 96 bytes an image: the three colour planes, each stored column by
column) with labels 1-10 in ``train_y.bin``/``test_y.bin`` and names in ``class_names.txt``. Each image is written as ``<out>/<split>/<class>/<index>.png``, the
index counting through the split's files in order (``--merged`` puts train and test into ``<out>/all/``, train
first, as FedVG's code merges them). A wrong or truncated file is one line naming it; nothing is written unless
every file reads.

    python examples/paper/cifar_folders.py cifar-10-batches-bin data/cifar10 --merged
    python examples/paper/cifar_folders.py cifar-100-binary data/cifar100
    python examples/paper/cifar_folders.py stl10_binary data/stl10
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from PIL import Image

PIXELS = 3 * 32 * 32
STL10_PIXELS = 3 * 96 * 96
STL10 = ["train_X.bin", "train_y.bin", "test_X.bin", "test_y.bin", "class_names.txt"]
#: (label bytes before the pixels, index of the label kept, class names file, training files, test files)
LAYOUTS = {
    "cifar10": (1, 0, "batches.meta.txt", [f"data_batch_{k}.bin" for k in range(1, 6)], ["test_batch.bin"]),
    "cifar100": (2, 1, "fine_label_names.txt", ["train.bin"], ["test.bin"]),
}


def detect(src: Path) -> str:
    """Which CIFAR a folder holds, from the files it has."""
    for name, (_, _, names, train, test) in LAYOUTS.items():
        if all((src / f).is_file() for f in [names, *train, *test]):
            return name
    if all((src / f).is_file() for f in STL10):
        return "stl10"
    raise ValueError(f"{src}: neither CIFAR-10's binary files (data_batch_1..5.bin, test_batch.bin, batches.meta.txt) "
                     "nor CIFAR-100's (train.bin, test.bin, fine_label_names.txt) nor STL-10's (train_X.bin, "
                     "train_y.bin, test_X.bin, test_y.bin, class_names.txt)")


def read_records(path: Path, label_bytes: int, keep: int, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """(images [N, 32, 32, 3] uint8, labels [N]) of one binary batch file."""
    raw = np.fromfile(path, dtype=np.uint8)
    size = label_bytes + PIXELS
    if raw.size == 0 or raw.size % size:
        raise ValueError(f"{path}: {raw.size} bytes is not a whole number of {size}-byte CIFAR records")
    rec = raw.reshape(-1, size)
    labels = rec[:, keep].astype(np.int64)
    if labels.max() >= classes:
        raise ValueError(f"{path}: label {labels.max()} but only {classes} class names")
    return rec[:, label_bytes:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), labels


def read_stl10(src: Path, split: str, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """(images [N, 96, 96, 3] uint8, labels [N] from 0) of STL-10's labelled ``split``."""
    x, y = src / f"{split}_X.bin", src / f"{split}_y.bin"
    raw, labels = np.fromfile(x, dtype=np.uint8), np.fromfile(y, dtype=np.uint8).astype(np.int64) - 1
    if raw.size == 0 or raw.size % STL10_PIXELS:
        raise ValueError(f"{x}: {raw.size} bytes is not a whole number of {STL10_PIXELS}-byte STL-10 images")
    if raw.size // STL10_PIXELS != labels.size:
        raise ValueError(f"{y}: {labels.size} labels for {raw.size // STL10_PIXELS} images in {x.name}")
    if labels.size and (labels.min() < 0 or labels.max() >= classes):
        raise ValueError(f"{y}: labels must be 1..{classes}")
    # each colour plane column by column: [N, C, W, H] -> [N, H, W, C]
    return raw.reshape(-1, 3, 96, 96).transpose(0, 3, 2, 1), labels


def convert(src: Path, out: Path, merged: bool = False) -> dict[str, int]:
    """Write the folders; returns images written per split folder."""
    kind = detect(src)
    if kind == "stl10":
        names = [n.strip() for n in (src / "class_names.txt").read_text().splitlines() if n.strip()]
        splits = {s: [read_stl10(src, s, len(names))] for s in ("train", "test")}
    else:
        label_bytes, keep, names_file, train, test = LAYOUTS[kind]
        names = [n.strip() for n in (src / names_file).read_text().splitlines() if n.strip()]
        splits = {"train": [read_records(src / f, label_bytes, keep, len(names)) for f in train],
                  "test": [read_records(src / f, label_bytes, keep, len(names)) for f in test]}  # all read first
    if merged:
        splits = {"all": splits["train"] + splits["test"]}
    written = {}
    for split, parts in splits.items():
        images = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        for c in names:
            (out / split / c).mkdir(parents=True, exist_ok=True)
        for i, (img, y) in enumerate(zip(images, labels)):
            Image.fromarray(img).save(out / split / names[y] / f"{i:05d}.png")
        written[split] = len(labels)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="the unpacked binary release (cifar-10-batches-bin, cifar-100-binary or stl10_binary)")
    ap.add_argument("out", type=Path, help="output root: <out>/train, <out>/test (or <out>/all with --merged)")
    ap.add_argument("--merged", action="store_true", help="train and test into one <out>/all (FedVG's split)")
    args = ap.parse_args(argv)
    try:
        written = convert(args.src, args.out, args.merged)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(", ".join(f"{args.out / k}: {n} images" for k, n in written.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
