"""``street``: the built-in driving-scene benchmark, FedDrive's IDDA protocol on generated scenes.

Domains are (town, condition, camera) triples, as IDDA's (town, weather, vehicle): ``towns`` of
``fedsight.data.street_scenes.TOWNS`` (six layouts, one of them the rural ``"rural"`` town with no sidewalks),
``conditions`` ``"<weather>-<time>"`` (IDDA's ClearNoon, ClearSunset and HardRainNoon are ``clear-day``,
``clear-dusk`` and ``rain-day``) and ``cameras`` (``car``, or the higher, pitched ``bus``). Every domain has
``per_domain`` scenes of ``height`` x ``width`` pixels and 13 classes.

``setting`` picks the unseen test domains as FedDrive's IDDA settings do (thesis Table 5.1): ``"country"`` =
every domain of the rural town, ``"rainy"`` = every rainy domain, ``"bus"`` = every bus-camera domain,
``"none"`` = no unseen domain. Of every other (seen) domain the last ``test_fraction`` of the scenes form the
seen test set (IDDA: 1/5, 12 of 60) and the rest the training pool. The run's ``test`` set is the seen test
set; the unseen domains are the extra test set ``unseen`` (metrics ``test_unseen/*``).

The data are a fixed dataset: they depend on the parameters and ``data_seed`` only, never on the run seed,
so runs with different seeds train on the same images. Rendering takes about 10-40 ms per 128 x 256 scene
per core; ``workers`` render domains in parallel processes, and ``cache`` names a folder where the rendered
arrays are kept (one ``.npz`` per parameter set) for later runs. In one process, the last datasets rendered
are also kept in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedsight.data.segmentation import SegmentationData, SegmentationSet, TensorLabelStore
from fedsight.registry import DATASETS, Params

__all__ = ["StreetParams", "load_street", "render_domains"]

CONDITIONS = ("clear-day", "clear-dusk", "clear-night", "rain-day", "rain-dusk", "rain-night", "fog-day", "fog-dusk",
              "fog-night")


class StreetParams(Params):
    towns: list[str] = Field(["downtown", "suburb", "rural", "industrial", "oldtown", "boulevard"],
                             description="towns (fedsight.data.street_scenes.TOWNS)")
    conditions: list[Literal[CONDITIONS]] = Field(  # type: ignore[valid-type]
        ["clear-day", "clear-dusk", "rain-day"], description="weather-time conditions (IDDA: ClearNoon, ClearSunset, "
        "HardRainNoon)")
    cameras: list[Literal["car", "bus"]] = Field(["car", "bus"], description="camera mounts")
    per_domain: int = Field(20, ge=2, description="scenes per domain (IDDA: 60)", json_schema_extra={"smoke": 4})
    test_fraction: float = Field(0.2, gt=0, lt=1, description="share of a seen domain's scenes in the seen test set")
    setting: Literal["country", "rainy", "bus", "none"] = Field(
        "country", description="unseen test domains: the rural town, rainy conditions, the bus camera, or none")
    height: int = Field(64, ge=16, description="image height in pixels")
    width: int = Field(128, ge=16, description="image width in pixels")
    data_seed: int = Field(0, ge=0, description="seed of the scenes (independent of the run seed)")
    workers: int = Field(0, ge=0, description="processes rendering domains in parallel (0: this process)")
    cache: str | None = Field(None, description="folder keeping rendered datasets (.npz) for later runs")

    def model_post_init(self, context: object) -> None:
        from fedsight.data.street_scenes import TOWNS

        unknown = [t for t in self.towns if t not in TOWNS]
        if unknown:
            raise ValueError(f"unknown town {unknown[0]!r}; choose from {', '.join(TOWNS)}")
        for what, items in (("towns", self.towns), ("conditions", self.conditions), ("cameras", self.cameras)):
            if not items or len(set(items)) != len(items):
                raise ValueError(f"{what} must list at least one entry, each once")


def _domains(p: StreetParams) -> list[tuple[str, str, str]]:
    return [(t, c, cam) for t in p.towns for c in p.conditions for cam in p.cameras]


def _render_domain(job: tuple[int, str, str, str, int, int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    from fedsight.data.street_scenes import Appearance, render_scene

    d, town, condition, camera, n, h, w, seed = job
    weather, time = condition.split("-")
    app = Appearance(weather=weather, time=time, camera=camera)
    pairs = [render_scene(town, app, h, w, seed, key=(town, condition, camera, i)) for i in range(n)]
    return np.stack([a for a, _ in pairs]), np.stack([b for _, b in pairs])


def render_domains(p: StreetParams) -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 ``[D, n, H, W, 3]`` and label maps ``[D, n, H, W]`` of every domain (``_domains`` order).
    A scene's layout is keyed by (town, condition, camera, index), so a domain's scenes do not depend on
    which other domains are rendered."""
    jobs = [(d, t, c, cam, p.per_domain, p.height, p.width, p.data_seed) for d, (t, c, cam) in enumerate(_domains(p))]
    if p.workers > 0 and len(jobs) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        from ..lifeline import die_with_parent

        # the workers end with this process even if it is SIGKILLed; they start in this thread, which waits for them
        with ProcessPoolExecutor(min(p.workers, len(jobs)), mp_context=multiprocessing.get_context("spawn"),
                                 initializer=die_with_parent, initargs=(os.getpid(), True)) as ex:
            out = list(ex.map(_render_domain, jobs))
    else:
        out = [_render_domain(j) for j in jobs]
    return np.stack([a for a, _ in out]), np.stack([b for _, b in out])


def _key(p: StreetParams) -> str:
    spec = {k: v for k, v in p.model_dump().items() if k not in ("workers", "cache", "setting", "test_fraction")}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


@lru_cache(maxsize=2)
def _rendered(spec: str, workers: int) -> tuple[np.ndarray, np.ndarray]:
    """The arrays of the scenes ``spec`` (parameters with everything that does not change pixels set to fixed
    values, so the in-memory cache serves every setting); ``workers`` render them."""
    p = StreetParams.model_validate_json(spec).model_copy(update={"workers": workers})
    if p.cache is not None:
        path = Path(p.cache) / f"street-{_key(p)}.npz"
        if path.is_file():
            try:
                with np.load(path) as z:
                    images, labels = z["images"], z["labels"]
                if images.shape[:2] == (len(_domains(p)), p.per_domain):
                    return images, labels
            except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
                pass  # a damaged (truncated, empty, foreign) cache file is rendered anew
        images, labels = render_domains(p)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
        np.savez(tmp, images=images, labels=labels)
        os.replace(tmp, path)
        return images, labels
    return render_domains(p)


def _unseen(p: StreetParams, domain: tuple[str, str, str]) -> bool:
    town, condition, camera = domain
    return {"country": town == "rural", "rainy": condition.startswith("rain"), "bus": camera == "bus",
            "none": False}[p.setting]


@DATASETS.register("street", params=StreetParams, task="segmentation",
                   help="generated driving scenes (13 classes): towns x conditions x cameras, seen/unseen domains")
def load_street(params: StreetParams, *, seed: int) -> SegmentationData:
    """The benchmark of ``params`` (module docstring); the run ``seed`` is not used."""
    del seed
    from fedsight.data.street_scenes import CLASSES

    domains = _domains(params)
    unseen = [d for d, dom in enumerate(domains) if _unseen(params, dom)]
    if len(unseen) == len(domains):
        raise ValueError(f"data.setting = {params.setting!r} leaves no seen domain among {len(domains)}; add towns, "
                         "conditions or cameras")
    pixels = params.model_copy(update={"setting": "none", "test_fraction": 0.5, "workers": 0})
    images, labels = _rendered(pixels.model_dump_json(), params.workers)
    n = params.per_domain
    n_test = max(1, int(round(params.test_fraction * n)))
    if n_test >= n:
        raise ValueError(f"data.test_fraction = {params.test_fraction} leaves no training scene of {n} per domain")
    names = ["/".join(d) for d in domains]
    flat_x = torch.from_numpy(images.reshape(-1, params.height, params.width, 3)).permute(0, 3, 1, 2)
    flat_y = torch.from_numpy(labels.reshape(-1, params.height, params.width))
    ids = np.repeat(np.arange(len(domains)), n)
    scene = np.tile(np.arange(n), len(domains))
    is_unseen = np.isin(ids, unseen)
    parts = {"train": ~is_unseen & (scene < n - n_test), "test": ~is_unseen & (scene >= n - n_test), "unseen": is_unseen}

    def make(mask: np.ndarray) -> SegmentationSet:
        from fedsight.data.pipeline import TensorStore

        idx = torch.from_numpy(np.flatnonzero(mask))
        return SegmentationSet(TensorStore(flat_x[idx].contiguous()), TensorLabelStore(flat_y[idx].contiguous()),
                               ids[mask], [f"{names[d]}/{s:03d}" for d, s in zip(ids[mask], scene[mask])])

    tests = {"test": make(parts["test"])}
    if unseen:
        tests["unseen"] = make(parts["unseen"])
    return SegmentationData(train=make(parts["train"]), tests=tests, class_names=list(CLASSES), domain_names=names)
