"""Federated classification splits published as CSV files: the splits of Hsu, Qi & Brown, "Federated Visual
Classification with Real-World Data Distribution" (ECCV 2020; google-research ``federated_vision_datasets``):
Landmarks-User-160k (GLDv2), iNaturalist-User-120k and iNaturalist-Geo-100/300/1k/3k, the splits the thesis's
chapters 3-4 use (Table 3.1), and the personalisation splits derived from them (Table 4.1).

**Format** (the release's README): the training split is ``federated_train*.csv`` with the columns ``user_id``
(one federated client per distinct value: a numerical id, a geo cell or an author), ``image_id`` (the image's id
in the source dataset) and ``class`` (the paper's class label), iNaturalist adding ``label`` (the source
dataset's own label); the test split is ``test.csv``, the same columns without ``user_id``. Columns are found by
their header names, in any order; extra columns are kept for ``image_pattern``. The images come from the source
datasets (not distributed with the splits): ``image_pattern`` maps a row to its file under ``root`` with
Python's ``str.format`` over the row's columns, e.g. GLDv2's ``train/{image_id[0]}/{image_id[1]}/{image_id[2]}/
{image_id}.jpg``.

**Clients.** Users keep the order of their first row in the CSV; each is one client of ``partition.name =
"predefined"``. ``min_images`` drops the users with fewer training images (and their images), as the thesis's
personalisation splits do: Pers-Users-160k keeps the Landmarks-User-160k users with at least 50 images (823
users), Pers-Geo-100 the iNaturalist-Geo-100 users with at least 10 (2,714); their local train/test split (about
45% test) is ``partition.local_test_fraction``. The thesis also drops the global test set for those splits: the
loader still needs a ``test_csv``, and the thesis's numbers are then the ``local/*`` metrics.

**Classes.** The distinct ``class`` values of both files, sorted (numerically when every value is an integer),
are the model's classes 0..C-1, named by their values: the release's contiguous ids map to themselves.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import torch
from pydantic import Field

from fedsight.data.base import DatasetSplits, StoredDataset
from fedsight.data.classification import StoredImageParams, file_store
from fedsight.registry import DATASETS


class FederatedCSVParams(StoredImageParams):
    root: str = Field(description="the folder image_pattern's paths are relative to (the source dataset's images)")
    train_csv: str = Field(description="the training split: federated_train*.csv with user_id, image_id, class")
    test_csv: str = Field(description="the test split: test.csv with image_id, class")
    image_pattern: str = Field("{image_id}.jpg", description="an image's path under root, str.format over its CSV "
                               "row, e.g. 'train/{image_id[0]}/{image_id[1]}/{image_id[2]}/{image_id}.jpg' (GLDv2)")
    min_images: int = Field(1, ge=1, description="drop users with fewer training images (thesis Table 4.1: "
                            "Pers-Users-160k 50, Pers-Geo-100 10)")


def _read_rows(path: str, needed: tuple[str, ...], what: str) -> list[dict[str, str]]:
    """The rows of the CSV at ``path`` as dicts; one line naming the file (and the row) when it cannot be used."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"federated_csv: {what} {path!r} does not exist")
    with file.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in needed if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"federated_csv: {what} {path!r} has no column {', '.join(missing)} "
                             f"(its header: {', '.join(reader.fieldnames or []) or 'none'})")
        rows = list(reader)
    for line, row in enumerate(rows, start=2):
        empty = [c for c in needed if not (row.get(c) or "").strip()]
        if empty:
            raise ValueError(f"federated_csv: {what} {path!r} line {line}: empty {', '.join(empty)}")
    if not rows:
        raise ValueError(f"federated_csv: {what} {path!r} has no rows")
    return rows


def _paths(rows: list[dict[str, str]], p: FederatedCSVParams, what: str) -> list[Path]:
    out = []
    for line, row in enumerate(rows, start=2):
        try:
            rel = p.image_pattern.format(**row)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"federated_csv: data.image_pattern {p.image_pattern!r} does not fit {what} line "
                             f"{line}: {type(exc).__name__}: {exc}") from None
        path = Path(p.root) / rel
        if not path.is_file():
            raise FileNotFoundError(f"federated_csv: {what} line {line}: image {str(path)!r} does not exist "
                                    f"(data.root + data.image_pattern)")
        out.append(path)
    return out


def _class_order(values: set[str]) -> list[str]:
    try:
        return sorted(values, key=int)
    except ValueError:
        return sorted(values)


@DATASETS.register("federated_csv", params=FederatedCSVParams,
                   help="Hsu et al.'s federated CSV splits (Landmarks-User-160k, iNaturalist-User-120k / Geo-*): "
                        "one predefined client per user_id")
def load_federated_csv(params: FederatedCSVParams, *, seed: int) -> DatasetSplits:
    """The training pool in the order of its users (each user's images in CSV order) with ``client_of`` (the
    predefined split), and the test set; images read lazily, as ``imagefolder`` does."""
    del seed
    train_rows = _read_rows(params.train_csv, ("user_id", "image_id", "class"), "data.train_csv")
    test_rows = _read_rows(params.test_csv, ("image_id", "class"), "data.test_csv")
    users: dict[str, list[dict[str, str]]] = {}
    for row in train_rows:
        users.setdefault(row["user_id"], []).append(row)
    kept = {u: rows for u, rows in users.items() if len(rows) >= params.min_images}
    if not kept:
        raise ValueError(f"federated_csv: no user of data.train_csv {params.train_csv!r} has data.min_images = "
                         f"{params.min_images} images (the largest has {max(map(len, users.values()))})")
    pool = [row for rows in kept.values() for row in rows]
    client_of = np.repeat(np.arange(len(kept)), [len(rows) for rows in kept.values()])
    classes = _class_order({r["class"] for r in pool} | {r["class"] for r in test_rows})
    index = {c: i for i, c in enumerate(classes)}
    loader = params.loader_spec()

    def stored(rows: list[dict[str, str]], what: str) -> StoredDataset:
        y = torch.tensor([index[r["class"]] for r in rows], dtype=torch.int64)
        return StoredDataset(file_store(_paths(rows, params, what), params), y, len(classes), classes, loader)

    return DatasetSplits(train=stored(pool, "data.train_csv"), test=stored(test_rows, "data.test_csv"),
                         client_of=client_of, client_names=list(kept))
