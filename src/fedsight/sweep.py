"""Sweeps: a config's ``[sweep] seeds`` x ``[[variants]]`` x ``grid`` expanded into validated runs, with the
command line's ``--set`` overrides and ``--variant`` selection applied (``load``)."""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationError, create_model, field_validator

from .config import RunSection, parse_override, read_toml, set_path, deep_merge, validate
from .config_messages import format_validation_error
from .errors import ConfigError
from .registry import Params


@dataclass
class RunSpec:
    """One run of a (possibly swept) config."""

    variant: str | None
    seed: int
    config: Any  # the validated Config model
    raw: dict[str, Any]
    #: ``run.output_dir / run.name [/ variant] / seed<N>``
    run_dir: Path


class SweepSection(Params):
    """``seeds`` repeats every run; ``grid`` maps dotted config keys to lists of values and runs every
    combination (e.g. ``grid = {"partition.alpha" = [1.0, 0.1]}``)."""

    seeds: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    grid: dict[str, Annotated[list[Any], Field(min_length=1)]] = Field(default_factory=dict)

    @field_validator("seeds")
    @classmethod
    def _distinct(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) != len(seeds):
            raise ValueError("repeats a seed (the runs would share one directory)")
        return seeds

    @field_validator("grid")
    @classmethod
    def _distinct_values(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for key, values in grid.items():
            labels = [_label(v) for v in values]
            if len(set(labels)) != len(labels):
                raise ValueError(f"grid {key!r} repeats a value (or two values with one label: {labels})")
        return grid


def _label(value: Any) -> str:
    """A grid value as it appears in a run name: characters a directory name must not hold become '-'."""
    return re.sub(r"[^A-Za-z0-9._+-]", "-", str(value)).strip(".") or "-"


def _grid_points(grid: dict[str, list[Any]]) -> list[tuple[str, list[tuple[list[str], Any]]]]:
    """(label, [(path, value), ...]) for every combination; the label names each key by its last part."""
    import itertools

    if not grid:
        return [("", [])]
    keys = list(grid)
    points = []
    for values in itertools.product(*(grid[k] for k in keys)):
        label = ",".join(f"{k.split('.')[-1]}={_label(v)}" for k, v in zip(keys, values))
        points.append((label, [(k.split("."), v) for k, v in zip(keys, values)]))
    return points


def _unknown_keys_of_the_base(base: dict[str, Any], source: str) -> None:
    """A grid switching a component (``partition.name``) drops the base component's parameters at every point,
    and a misspelt one with them: unknown keys are looked for in the base config itself (its other errors may
    be ones the grid fixes)."""
    try:
        validate(base, source)
    except ConfigError as exc:
        unknown = [line for line in str(exc).splitlines() if "unknown key" in line]
        if unknown:
            raise ConfigError("\n".join(unknown)) from None


def _section(name: str, model: Any, raw: Any, source: str) -> Any:
    """One section validated on its own (before the whole config is), its errors spelt as for the whole."""
    wrapper = create_model(name.title(), **{name: (model, ...)})
    try:
        return getattr(wrapper.model_validate({name: raw}), name)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, {name: raw}, wrapper, source)) from None


def validate_base_name(run: Any, source: str) -> str:
    return _section("run", RunSection, run if isinstance(run, dict) else {}, source).name


def _check_overrides(sets: list[tuple[list[str], Any]], sweep: "SweepSection", source: str) -> None:
    """An override the sweep would shadow is an error (never silently lost): one of a grid axis (or a key above or
    below one), and ``seed`` when ``[sweep] seeds`` decides the seeds."""
    for path, _ in sets:
        key = ".".join(path)
        for axis in sweep.grid:
            if key == axis or key.startswith(axis + ".") or axis.startswith(key + "."):
                raise ConfigError(f"--set {key}: {source}'s sweep.grid sets {axis} at every point; change sweep.grid "
                                  f"instead (e.g. --set 'sweep.grid={{\"{axis}\" = [...]}}')")
        if key == "seed" and sweep.seeds:
            raise ConfigError(f"--set seed: {source}'s sweep.seeds = {sweep.seeds} decides the seeds; pass "
                              "--set 'sweep.seeds=[N]' instead")


def expand(raw: dict[str, Any], source: str, overrides: Sequence[str] = (), only: Sequence[str] = (),
           typed: Sequence[tuple[list[str], Any]] = ()) -> list[RunSpec]:
    """Apply ``--set`` overrides, then expand ``[sweep] seeds`` x ``[[variants]]`` x ``grid`` into validated runs.

    Precedence: the command line wins. An override applies to the base config and again over every variant
    (a variant's own value of the key is replaced); one the sweep would shadow (a grid axis, or ``seed`` next
    to ``sweep.seeds``) is an error. ``only``: run just these variants (``--variant``), by name. ``typed``: overrides
    already parsed, as (key path, value) (the Python API's keyword arguments)."""
    raw = copy.deepcopy(raw)
    sets = [parse_override(text) for text in overrides] + [(list(p), v) for p, v in typed]
    for path, value in sets:
        set_path(raw, path, value)
    sweep_raw = raw.pop("sweep", {})
    variants_raw = raw.pop("variants", [])
    sweep = _section("sweep", SweepSection, sweep_raw, source)
    if not isinstance(variants_raw, list) or not all(isinstance(v, dict) for v in variants_raw):
        raise ConfigError(f"{source}: variants must be an array of tables ([[variants]])")
    names = []
    for i, v in enumerate(variants_raw):
        name = v.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{source}: variants[{i}].name is required (a non-empty string)")
        if name in names:
            raise ConfigError(f"{source}: variants[{i}].name = {name!r} is used twice")
        names.append(name)
    _check_overrides(sets, sweep, source)
    unknown = [n for n in only if n not in names]
    if unknown:
        raise ConfigError(f"--variant {unknown[0]}: {source} has no such variant"
                          f" (it has: {', '.join(names) or 'none'})")
    if only:
        variants_raw = [v for v in variants_raw if v["name"] in only]
    if isinstance(seed := raw.get("seed", 0), bool) or not isinstance(seed, int):
        raise ConfigError(f"{source}: seed = {seed!r} is not an integer")
    seeds = sweep.seeds or [seed]
    variants = variants_raw or [None]
    base_name = validate_base_name(raw.get("run"), source)
    specs = []
    for v in variants:
        base = raw if v is None else deep_merge(raw, {k: val for k, val in v.items() if k != "name"})
        if v is not None:
            for path, value in sets:  # the command line wins over the variant
                if path[0] not in ("sweep", "variants"):
                    set_path(base, path, value)
        if any(k.endswith(".name") for k in sweep.grid):
            _unknown_keys_of_the_base(base, source)
        for label, sets in _grid_points(sweep.grid):
            point = copy.deepcopy(base)
            for path, value in sets:
                set_path(point, path, value)
            for seed in seeds:
                r = copy.deepcopy(point)
                r["seed"] = seed
                parts = [base_name] + ([v["name"]] if v is not None else []) + ([label] if label else [])
                if len(parts) > 1:
                    name = parts[1] if v is not None else base_name
                    r["run"] = {**r.get("run", {}), "name": f"{name}[{label}]" if label else name}
                what = ", ".join(x for x in (v and f"variant {v['name']}", label) if x)
                cfg = validate(r, f"{source} ({what})" if what else source)
                run_dir = Path(cfg.run.output_dir).joinpath(*parts, f"seed{seed}")
                specs.append(RunSpec(v["name"] if v else None, seed, cfg, r, run_dir))
    return specs


def load(path: str | Path, overrides: Sequence[str] = (), only: Sequence[str] = ()) -> list[RunSpec]:
    return expand(read_toml(path), str(path), overrides, only)
