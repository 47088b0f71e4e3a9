"""The built-in plugins: importing a module registers its tasks, datasets, models, partitioners and recipe
parts by name (``fedsight.registry``). Entry points (the CLI, the Python API, config validation, the
Flower apps) call ``load_builtin()`` once; nothing below them imports this module, so the registries'
contents never depend on import order and no plugin imports its consumers."""

from __future__ import annotations

import importlib

BUILTIN = (
    "fedsight.data.classification",
    "fedsight.data.partition",
    "fedsight.data.video",
    "fedsight.data.video_synth",
    "fedsight.data.image_sr",
    "fedsight.data.keypoints",
    "fedsight.data.seg_datasets",
    "fedsight.data.street",
    "fedsight.models",
    "fedsight.tasks.classification",
    "fedsight.tasks.video_sr",
    "fedsight.tasks.image_sr",
    "fedsight.tasks.keypoints",
    "fedsight.tasks.segmentation",
    "fedsight.recipe.aggregators",
    "fedsight.recipe.server_opt",
    "fedsight.recipe.sharing",
    "fedsight.recipe.weighting",
    "fedsight.recipe.robust",
    "fedsight.recipe.norm_sharing",
    "fedsight.recipe.feddyn",
    "fedsight.recipe.scaffold",
    "fedsight.recipe.elastic",
    "fedsight.recipe.fednova",
    "fedsight.recipe.fedprox",
    "fedsight.recipe.fedvg",
    "fedsight.recipe.fedvsr",
    "fedsight.recipe.local_adam",
    "fedsight.recipe.fed3r",
    "fedsight.recipe.oll",
    "fedsight.recipe.personalize",
    "fedsight.recipe.ladd",
    "fedsight.recipe.raf",
    "fedsight.recipe.ladd_adapt",
    "fedsight.recipe.dp_sgd",
    "fedsight.recipe.ppfl",
)

_loaded = False


def load_builtin() -> None:
    """Import every built-in plugin module (idempotent)."""
    global _loaded
    if not _loaded:
        for name in BUILTIN:
            importlib.import_module(name)
        _loaded = True
