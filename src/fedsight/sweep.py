"""Sweeps: a config's ``[sweep] seeds`` x ``[[variants]]`` x ``grid`` expanded into validated runs, with the
command line's ``--set`` overrides and ``--variant`` selection applied (``load``)."""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationError, create_model, field_validator

from .config import RunSection, parse_override, read_toml, set_path, deep_merge, validate
from .config_messages import attribute, format_validation_error
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
    #: ``[sweep] share_stages``: runs that begin with the same stages train them once (``fedsight.shared_stages``)
    share_stages: bool = False


class SweepSection(Params):
    """``seeds`` repeats every run; ``grid`` maps dotted config keys to lists of values and runs every
    combination (e.g. ``grid = {"partition.alpha" = [1.0, 0.1]}``)."""

    seeds: list[Annotated[int, Field(ge=0, le=2**63 - 1)]] = Field(default_factory=list)
    grid: dict[str, Annotated[list[Any], Field(min_length=1)]] = Field(default_factory=dict)
    share_stages: bool = Field(
        False, description="runs of the sweep that begin with the same stages (same seed, same config up to the end "
                           "of those stages) train them once: the later ones start from a copy of the first, stopped "
                           "at the stages' last round, and end bit for bit as they would alone (docs/configuration.md)")

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


#: ``--smoke``: local steps a round, the rounds of a run or of each stage
SMOKE_STEPS, SMOKE_ROUNDS = 2, 2


def _get(raw: Any, path: list[str]) -> tuple[bool, Any]:
    """(found, value) at ``path``; a bare component name stands for its table's ``name``."""
    cur = raw
    for i, part in enumerate(path):
        if isinstance(cur, str) and path[i:] == ["name"]:
            return True, cur
        if not isinstance(cur, dict) or part not in cur:
            return False, None
        cur = cur[part]
    return True, cur


def _holds(raw: Any, path: list[str], value: Any) -> bool:
    found, have = _get(raw, path)
    if found and isinstance(value, str) and isinstance(have, dict):  # a component named on the command line
        return have.get("name") == value
    return found and have == value


def _toml(value: Any) -> str:
    """``value`` as ``--set`` reads it back."""
    import tomli_w

    return tomli_w.dumps({"v": value}).split("=", 1)[1].strip()


def _stage_name(st: Any) -> str:
    return st.get("name", "?") if isinstance(st, dict) else "?"


def _stage_rounds(stages: list[Any]) -> int | None:
    rounds = [st.get("rounds") if isinstance(st, dict) else None for st in stages]
    return sum(rounds) if all(isinstance(r, int) and not isinstance(r, bool) for r in rounds) else None


def _is_stage_key(path: list[str]) -> bool:
    """``stages.NAME.key``: a key of the stage called NAME, in every run that has one."""
    return path[0] == "stages" and len(path) >= 2


def _set_stages(r: dict[str, Any], stage_sets: list[tuple[list[str], Any]], found: set[str]) -> None:
    """``stages.NAME.key = value`` into run ``r``'s stages of that name (names found are added to ``found``)."""
    for path, value in stage_sets:
        for st in r.get("stages") or []:
            if _stage_name(st) == path[1]:
                set_path(st, path[2:], value)
                found.add(path[1])


def _shrink(r: dict[str, Any]) -> None:
    """``--smoke``: at most ``SMOKE_ROUNDS`` rounds (a run's, or each stage's), ``SMOKE_STEPS`` local steps a
    round, one evaluation after the last round (no round-0 evaluation), and every component's and dataset's work counts at most their
    declared smoke value (a field's ``json_schema_extra={"smoke": N}``: ``source_pretrain.steps``,
    ``pretrain.epochs``, ``builtin_pose.num_test``)."""
    from . import registry as R
    from .plugins import load_builtin
    from .pretrain import PretrainSection

    load_builtin()  # the parts' declared smoke values: a run's first validation may come after its shrink

    def cap(table: Any, params: Any) -> None:
        if not isinstance(table, dict):
            return
        for name, f in params.model_fields.items():
            limit = (f.json_schema_extra or {}).get("smoke") if isinstance(f.json_schema_extra, dict) else None
            have = table.get(name, f.default)
            if limit is not None and isinstance(have, int) and not isinstance(have, bool):
                table[name] = min(have, limit)

    def shrink_tables(t: dict[str, Any]) -> None:
        if isinstance(t.get("train"), dict):
            for k in ("epochs", "steps", "steps_range"):
                t["train"].pop(k, None)
        if isinstance(t.get("recipe"), dict) and isinstance(t["recipe"].get("components"), list):
            comps = t["recipe"]["components"]
            for i, c in enumerate(comps):
                c = {"name": c} if isinstance(c, str) else c
                if isinstance(c, dict) and isinstance(c.get("name"), str) and c["name"] in R.COMPONENTS.names():
                    cap(c, R.COMPONENTS.get(c["name"]).params)
                    comps[i] = c

    stages = r.get("stages") or []
    follows = isinstance(r.get("server"), dict) and r["server"].get("rounds") == _stage_rounds(stages)
    shrink_tables(r)
    r["train"] = {**(r.get("train") or {}), "steps": SMOKE_STEPS}
    for st in stages:
        if isinstance(st, dict):
            shrink_tables(st)
            if isinstance(st.get("rounds"), int):
                st["rounds"] = min(st["rounds"], SMOKE_ROUNDS)
    server = r.setdefault("server", {})
    if isinstance(server, dict) and isinstance(server.get("rounds"), int):
        server["rounds"] = _stage_rounds(stages) if stages and follows else min(server["rounds"], SMOKE_ROUNDS)
    if isinstance(r.get("pretrain"), dict) and r["pretrain"].get("source", "none") != "none":
        cap(r["pretrain"], PretrainSection)
    for table in (r.get("data"), (r.get("task") or {}).get("source") if isinstance(r.get("task"), dict) else None):
        if isinstance(table, dict) and table.get("name") in R.DATASETS.names():
            cap(table, R.DATASETS.get(table["name"]).params)
    ev = r.setdefault("eval", {})
    if isinstance(ev, dict) and isinstance(server, dict) and isinstance(server.get("rounds"), int):
        ev["every"] = server["rounds"]  # the one evaluation after the last round
    if isinstance(ev, dict):
        ev["initial"] = False
    run = r.setdefault("run", {})
    if isinstance(run, dict):
        run["output_dir"] = str(Path(run.get("output_dir", "runs")) / "smoke")


def _unreached(r: dict[str, Any], sets: list[tuple[list[str], Any]], what: str, grid: bool) -> str | None:
    """Why an override (``--set``, or a grid point's key) does not reach run ``r`` or one of its stages, or None.
    A stage's own value of a key shadows the run's (``config.stage_configs`` merges the stage over it)."""
    from .config import STAGE_OVERRIDABLE

    stages = r.get("stages") or []
    for path, value in sets:
        key = ".".join(path)
        said = f"sweep.grid {key}" if grid else f"--set {key}"
        if path == ["server", "rounds"] and stages and _stage_rounds(stages) != value:
            plan = " + ".join(f"{_stage_name(st)} {st.get('rounds') if isinstance(st, dict) else '?'}"
                              for st in stages)
            return (f"{said}: {what} runs in stages ({plan} rounds), whose rounds make server.rounds; shorten a "
                    "stage with --set stages.NAME.rounds=N (server.rounds follows), or run it with --smoke")
        if path[0] not in STAGE_OVERRIDABLE or path == ["server", "rounds"]:
            continue
        base = {k: v for k, v in r.items() if k != "stages"}
        for st in stages:
            if not isinstance(st, dict):
                continue
            merged = deep_merge(base, {k: st[k] for k in STAGE_OVERRIDABLE if k in st})
            if not _holds(merged, path, value):
                name = _stage_name(st)
                return (f"{said}: stage {name!r} of {what} sets {key} itself, so the value would not reach "
                        f"it; set it there too: --set stages.{name}.{key}={_toml(value)}")
    return None


def _check_run_dir(run_dir: Path, output_dir: str, source: str) -> None:
    """The output-path guard (``fedsight.safe_write.check_run_dir``) for a run directory of the config, at config
    time: a ``ConfigError`` naming ``run.output_dir`` and why, before any run of the sweep starts."""
    from .errors import OutputPathError
    from .safe_write import check_run_dir

    try:
        check_run_dir(run_dir, f"{source}: run.output_dir = {output_dir!r}")
    except OutputPathError as exc:
        raise ConfigError(str(exc)) from None


@contextlib.contextmanager
def _blaming(source: str, blame: Sequence[tuple[str, str]]) -> Iterator[None]:
    """A ConfigError raised inside, its lines about a key an override set blamed on that override
    (``fedsight.config_messages.attribute``): the file does not hold the value the message quotes."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(attribute(str(exc), source, blame)) from None


def _picks(pattern: str, name: str) -> bool:
    """``--variant PATTERN`` picks the variant called ``name``: the name itself, or a shell-style pattern of it."""
    return name == pattern or fnmatch.fnmatchcase(name, pattern)


def expand(raw: dict[str, Any], source: str, overrides: Sequence[str] = (), only: Sequence[str] = (),
           typed: Sequence[tuple[list[str], Any]] = (), smoke: bool = False) -> list[RunSpec]:
    """Apply ``--set`` overrides, then expand ``[sweep] seeds`` x ``[[variants]]`` x ``grid`` into validated runs.

    Precedence: the command line wins. An override applies to the base config and again over every variant
    (a variant's own value of the key is replaced) and every grid point and seed. ``stages.NAME.key=value`` sets
    a key of the stage called NAME in every run that has one (``stages.adapt.rounds=5``: a run whose
    ``server.rounds`` was its stages' sum follows). An override that cannot reach every run is an error naming
    the key and what to write instead: a key the sweep would shadow (a grid axis, or ``seed`` next to
    ``sweep.seeds``), a key a stage sets itself, ``server.rounds`` of a staged run, a stage no run has.
    ``only``: run just these variants (``--variant``), by name or shell-style pattern (``fnmatch``: ``fedavg_dct_*``),
    in the config's order. ``typed``: overrides already parsed, as (key
    path, value) (the Python API's keyword arguments). ``smoke``: every run shrunk to a smoke test (``_shrink``)
    at the first seed, under ``run.output_dir/smoke``."""
    raw = copy.deepcopy(raw)
    parsed = [parse_override(text) for text in overrides] + [(list(p), v) for p, v in typed]
    said = [f"--set {t.strip()}" for t in overrides] + [f"override {'.'.join(p)}={_toml(v)}" for p, v in typed]
    blame = [(".".join(p), who) for (p, _), who in zip(parsed, said) if not _is_stage_key(p)]
    stage_sets = [(p, v) for p, v in parsed if _is_stage_key(p)]
    sets = [(p, v) for p, v in parsed if not _is_stage_key(p)]
    for path, _ in stage_sets:
        if len(path) < 3:
            raise ConfigError(f"--set {'.'.join(path)}: name a key of the stage, e.g. --set stages.{path[1]}.rounds=2")
    for path, value in sets:
        set_path(raw, path, value)
    sweep_raw = raw.pop("sweep", {})
    variants_raw = raw.pop("variants", [])
    with _blaming(source, blame):
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
    unknown = [n for n in only if not any(_picks(n, name) for name in names)]
    if unknown:
        what = "matches no variant of" if any(c in unknown[0] for c in "*?[") else "is no variant of"
        raise ConfigError(f"--variant {unknown[0]}: {what} {source}"
                          f" (it has: {', '.join(names) or 'none'})")
    if only:
        variants_raw = [v for v in variants_raw if any(_picks(n, v["name"]) for n in only)]
    if isinstance(seed := raw.get("seed", 0), bool) or not isinstance(seed, int):
        raise ConfigError(f"{source}: seed = {seed!r} is not an integer")
    seeds = (sweep.seeds or [seed])[:1 if smoke else None]
    variants = variants_raw or [None]
    base_name = validate_base_name(raw.get("run"), source)
    mine = [(p, v) for p, v in sets if p[0] not in ("sweep", "variants", "seed") and p != ["run", "name"]]
    found: set[str] = set()
    specs = []
    for v in variants:
        base = raw if v is None else deep_merge(raw, {k: val for k, val in v.items() if k != "name"})
        if v is not None:
            for path, value in sets:  # the command line wins over the variant
                if path[0] not in ("sweep", "variants"):
                    set_path(base, path, value)
        if any(k.endswith(".name") for k in sweep.grid):
            with _blaming(source, blame):
                _unknown_keys_of_the_base(base, source)
        for label, point_sets in _grid_points(sweep.grid):
            point = copy.deepcopy(base)
            for path, value in point_sets:
                set_path(point, path, value)
            what = ", ".join(x for x in (v and f"variant {v['name']}", label) if x)
            follows = (isinstance(point.get("server"), dict)
                       and point["server"].get("rounds") == _stage_rounds(point.get("stages") or []))
            _set_stages(point, stage_sets, found)
            if follows and not any(p == ["server", "rounds"] for p, _ in sets):
                point["server"]["rounds"] = _stage_rounds(point.get("stages") or [])
            for overrides_, grid in ((mine, False), (point_sets, True)):
                if why := _unreached(point, overrides_, f"{source} ({what})" if what else source, grid):
                    raise ConfigError(why)
            if smoke:
                _shrink(point)
            for seed in seeds:
                r = copy.deepcopy(point)
                r["seed"] = seed
                parts = [base_name] + ([v["name"]] if v is not None else []) + ([label] if label else [])
                if len(parts) > 1:
                    name = parts[1] if v is not None else base_name
                    r["run"] = {**r.get("run", {}), "name": f"{name}[{label}]" if label else name}
                with _blaming(source, blame):
                    cfg = validate(r, f"{source} ({what})" if what else source)
                run_dir = Path(cfg.run.output_dir).joinpath(*parts, f"seed{seed}")
                _check_run_dir(run_dir, cfg.run.output_dir, f"{source} ({what})" if what else source)
                specs.append(RunSpec(v["name"] if v else None, seed, cfg, r, run_dir, sweep.share_stages))
    missing = sorted({p[1] for p, _ in stage_sets} - found)
    if missing:
        have = sorted({_stage_name(st) for s in specs for st in s.raw.get("stages") or []})
        raise ConfigError(f"--set stages.{missing[0]}: no run of {source} has a stage named {missing[0]!r}"
                          f" (stages: {', '.join(have) or 'none'})")
    return specs


def load(path: str | Path, overrides: Sequence[str] = (), only: Sequence[str] = (), smoke: bool = False) -> list[RunSpec]:
    return expand(read_toml(path), str(path), overrides, only, smoke=smoke)
