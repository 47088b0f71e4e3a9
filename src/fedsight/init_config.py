"""``fedsight init TASK``: a commented starting config for each task, one that runs as written.

The choices (which dataset, model and partitioner, how many clients and rounds) are ``STARTS``: small built-in
data and compact models, so ``fedsight run FILE --smoke`` takes seconds and a full run minutes on a laptop CPU.
The comments are not written by hand: each key's comment is its pydantic ``Field`` description (and, for a
choice, the values it allows), read from the config model and the registries when the file is written, so they
cannot go stale. Under each section's chosen keys, its other keys are listed commented out at their defaults,
so a user sees what exists without a trip to the docs; the sections a starting point leaves out (privacy,
validation, pretrain, stages, init, plugins) are named at the end with where they are documented."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .errors import ConfigError

#: per task: the tables it starts from (the rest of each section stays at its defaults), and its doc page
STARTS: dict[str, tuple[dict[str, Any], str]] = {
    "classification": ({
        "task": {"name": "classification"},
        "data": {"name": "digits"},  # scikit-learn's 8x8 digits: ships with scikit-learn
        "partition": {"name": "dirichlet", "alpha": 0.3, "num_clients": 10, "local_test_fraction": 0.2},
        "model": {"name": "cnn"},
        "train": {"epochs": 1, "batch_size": 32, "lr": 0.05},
        "server": {"rounds": 20, "clients_per_round": 5, "optimizer": "sgd"},
        "eval": {"every": 5},
    }, "docs/tasks.md"),
    "segmentation": ({
        "task": {"name": "segmentation", "crop": [48, 96]},
        "data": {"name": "street", "per_domain": 4, "height": 64, "width": 128},
        "partition": {"name": "iid", "num_clients": 6, "local_test_fraction": 0.0},
        "model": {"name": "bisenetv2", "width": 0.5, "head_channels": 64, "aux_channels": 32},
        "train": {"epochs": 1, "batch_size": 8, "lr": 0.05, "momentum": 0.9},
        "server": {"rounds": 10, "clients_per_round": 3},
        "eval": {"every": 5, "local": False},
        "engine": {"threads": 1},
    }, "docs/segmentation.md"),
    "image_sr": ({
        "task": {"name": "image_sr"},
        "data": {"name": "builtin_sr", "scale": 2, "patch_size": 12, "test_max_side": 128},
        "partition": {"name": "iid", "num_clients": 4, "local_test_fraction": 0.0},
        "model": {"name": "edsr", "features": 16, "blocks": 2},
        "train": {"steps": 10, "batch_size": 8, "lr": 0.001},
        "server": {"rounds": 10, "clients_per_round": 4},
        "recipe": {"components": [{"name": "local_adam"}]},
        "eval": {"every": 5, "local": False},
        "engine": {"threads": 1},
    }, "docs/image_sr.md"),
    "video_sr": ({
        "task": {"name": "video_sr", "crop_border": 0},
        "data": {"name": "synthetic_video", "clips_per_source": 2, "test_clips_per_source": 1, "clip_length": 6,
                 "frame_size": 64, "scale": 4, "num_frames": 3, "patch_size": 16},
        "partition": {"name": "iid", "num_clients": 4, "local_test_fraction": 0.0},
        "model": {"name": "basicvsr", "channels": 16, "blocks": 2, "align": "none", "upsampler": "direct"},
        "train": {"steps": 4, "batch_size": 4, "lr": 0.002},
        "server": {"rounds": 10, "clients_per_round": 4},
        "recipe": {"components": [{"name": "local_adam"}]},
        "eval": {"every": 5, "local": False},
        "engine": {"threads": 1},
    }, "docs/video_sr.md"),
    "keypoints": ({
        "task": {"name": "keypoints", "ladder": [[64, 48], [32, 24]], "resolution": "cycle"},
        "data": {"name": "builtin_pose", "num_train": 120, "num_test": 40, "image_size": [128, 96]},
        "partition": {"name": "iid", "num_clients": 4, "local_test_fraction": 0.0},
        "model": {"name": "simplebaseline"},
        "train": {"steps": 4, "batch_size": 16, "lr": 0.001},
        "server": {"rounds": 10, "clients_per_round": 4},
        "recipe": {"components": [{"name": "local_adam"}]},
        "eval": {"every": 5},
        "engine": {"threads": 1},
    }, "docs/keypoints.md"),
}

#: sections written, in this order; the others are named in the closing comment
SECTIONS = ("run", "task", "data", "partition", "model", "train", "server", "recipe", "eval", "engine")
#: where the sections a starting point leaves out are documented
LEFT_OUT = {"privacy": "docs/flower.md", "validation": "docs/fedvg.md", "pretrain": "docs/fed3r.md",
            "stages": "docs/recipes.md", "init": "docs/fed3r.md", "plugins": "docs/api.md",
            "sweep / variants": "docs/cli.md"}
WIDTH = 100


def tasks() -> list[str]:
    return sorted(STARTS)


def _toml(value: Any) -> str:
    """A TOML value (inline): strings as JSON-quoted basic strings, tables inline."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)) and not (isinstance(value, float) and not math.isfinite(value)):
        return repr(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value), ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items() if v is not None) + " }"
    if isinstance(value, BaseModel):
        return _toml(value.model_dump(mode="json", exclude_none=True))
    raise TypeError(f"no TOML form for {value!r}")


def _comment(text: str, indent: str = "") -> list[str]:
    """``text`` as comment lines of at most ``WIDTH`` columns."""
    import textwrap

    return [f"{indent}# {line}" for line in textwrap.wrap(" ".join(text.split()), WIDTH - len(indent) - 2,
                                                          break_long_words=False, break_on_hyphens=False)]


def _about(field: Any) -> str:
    from .registry import literal_choices

    text = (field.description or "").strip()
    choices = literal_choices(field.annotation)
    if len(choices) > 1 and not all(f"{c}" in text for c in choices):
        listed = f"one of: {', '.join(map(str, choices))}"
        text = f"{text} ({listed})" if text else listed
    return text.replace("``", "")


def _section_model(name: str, table: dict[str, Any]) -> type[BaseModel] | None:
    """The pydantic model of config section ``name`` holding ``table`` (a component's parameters for the
    component sections, chosen by its ``name``)."""
    from .config import config_model
    from .config_messages import _resolve_model

    field = config_model().model_fields.get(name)
    model = _resolve_model(field.annotation, table) if field is not None else None
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _default_line(key: str, field: Any) -> str | None:
    """A commented-out ``key = default`` line, or None for a key without a TOML default (required, unset)."""
    default = field.get_default(call_default_factory=True)
    if default is None or field.is_required():
        return None
    if isinstance(default, BaseModel) and "name" in type(default).model_fields:
        default = default.name  # a component at its defaults: its name stands for it
    try:
        return f"# {key} = {_toml(default)}"
    except TypeError:
        return None


def _section_lines(name: str, table: dict[str, Any]) -> list[str]:
    model = _section_model(name, table)
    doc = (model.__doc__ or "").strip().split("\n\n")[0].replace("``", "") if model is not None else ""
    lines = ["", f"[{name}]"] + (_comment(doc) if doc and name not in ("task", "data", "model", "partition")
                                 else [])
    if name in ("task", "data", "model", "partition") and model is not None:
        from . import registry as R

        reg = {"task": R.TASKS, "data": R.DATASETS, "model": R.MODELS, "partition": R.PARTITIONERS}[name]
        lines += _comment(f"{table['name']}: {reg.get(table['name']).help} (others: fedsight list {reg.kind}s)")
    fields = model.model_fields if model is not None else {}
    for key, value in table.items():
        about = _about(fields[key]) if key in fields and key != "name" else ""
        lines += _comment(about) + [f"{key} = {_toml(value)}"]
    rest = [(k, f) for k, f in fields.items() if k not in table and k != "name"]
    shown = [(k, f, line) for k, f in rest if (line := _default_line(k, f)) is not None]
    if shown:
        lines.append("# other keys, at their defaults:")
        for key, field, line in shown:
            about = _about(field)
            if about and len(line) + len(about) + 4 <= WIDTH:
                lines.append(f"{line}  # {about}")
            else:
                lines += _comment(about) + [line]
    return lines


def render(task: str, out_name: str = "fedsight.toml") -> str:
    """The commented config of ``task`` (a ConfigError naming the tasks for another name)."""
    from . import __version__

    if task not in STARTS:
        raise ConfigError(f"fedsight init {task}: no such task; choose one of: {', '.join(tasks())}")
    start, doc = STARTS[task]
    raw = {"seed": 0, "run": {"name": task, "output_dir": "runs"}, **start}
    lines = [f"# FedSight starting point for {task} (`fedsight init {task}`, fedsight {__version__}).",
             "# A smoke test (2 rounds, 2 local steps, into runs/smoke), then the run:",
             f"#   fedsight run {out_name} --smoke",
             f"#   fedsight run {out_name}    # then open runs/{task}/seed0/summary.md",
             f"# The task's guide: {doc}. Every key: `fedsight schema` (a JSON schema for TOML",
             "# editors, docs/cli.md); every dataset, model and recipe part, with its parameters: `fedsight list`.",
             "# Active keys are this starting point's choices; commented keys are defaults you may change.",
             "", "# the seed of every random choice (partition, sampling, initialisation); repeat runs with",
             "# [sweep] seeds = [0, 1, 2] for a mean and its spread", "seed = 0"]
    for name in SECTIONS:
        if name in raw:
            lines += _section_lines(name, raw[name])
    lines += ["", "# Sections left at their defaults here, and where they are documented:"]
    lines += [f"#   [{k}]: {v}" if "/" not in k else f"#   {k}: {v}" for k, v in LEFT_OUT.items()]
    return "\n".join(lines) + "\n"


def write(task: str, out: Path) -> Path:
    """Write ``render(task)`` to ``out``; an existing file (or anything at that path) is a ConfigError naming it,
    and nothing is written (created exclusively, so a file appearing meanwhile is not replaced either)."""
    text = render(task, out.name)
    if out.exists() or out.is_symlink():
        raise ConfigError(f"{out}: exists; fedsight init never replaces a file (choose another --out, or remove it)")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: no folder {out.parent}")
    try:
        with open(out, "x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        raise ConfigError(f"{out}: exists; fedsight init never replaces a file (choose another --out, or remove it)") \
            from None
    return out
