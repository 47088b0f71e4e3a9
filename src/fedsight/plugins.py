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
    "fedsight.data.seg_ladd_datasets",
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
    "fedsight.recipe.fedrdn",
    "fedsight.recipe.personalize",
    "fedsight.recipe.ladd",
    "fedsight.recipe.raf",
    "fedsight.recipe.ladd_adapt",
    "fedsight.recipe.dp_sgd",
    "fedsight.recipe.ppfl",
    "fedsight.recipe.ppfl_accept",
)

_loaded = False


def load_builtin() -> None:
    """Import every built-in plugin module (idempotent)."""
    global _loaded
    if not _loaded:
        for name in BUILTIN:
            importlib.import_module(name)
        _loaded = True


def load_plugins(modules: object, source: str = "config") -> None:
    """Import the user's plugin modules (a config's ``plugins = ["my_models", "lab.fl_parts"]``), whose
    ``@MODELS.register(...)`` (etc.) calls add names the config may then use. A module is looked up on
    ``sys.path`` and in the current directory (the ``fedsight`` command's own path does not hold it). A module
    that is missing or fails to import is a ``ConfigError`` naming it; importing one twice does nothing."""
    import os
    import sys

    from .errors import ConfigError

    if not isinstance(modules, list) or not all(isinstance(m, str) and m for m in modules):
        raise ConfigError(f"{source}: plugins = {modules!r}: expected a list of module names")
    cwd = os.getcwd()
    for name in modules:
        added = cwd not in sys.path
        if added:
            sys.path.append(cwd)
        try:
            importlib.import_module(name)
        except Exception as exc:  # any failure of the user's module: one line naming it
            raise ConfigError(f"{source}: plugins: cannot import {name!r} ({type(exc).__name__}: {exc})") from None
        finally:
            if added:
                sys.path.remove(cwd)
