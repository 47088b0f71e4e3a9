"""Run configuration: TOML in, validated typed objects out.

Every section is a pydantic model that forbids unknown keys. Components (dataset, model, partitioner,
server optimizer, weighting, aggregator, sharing, recipe components) are written as a table with
``name`` plus that component's own parameters, or as a bare name string; the allowed parameters come
from the component's registered parameter model, so ``[model] name = "cnn"  widht = 3`` fails with one
line naming ``model.widht`` and the keys ``cnn`` accepts.

A config file may also describe a sweep: ``[sweep] seeds = [0, 1, 2]`` and any number of
``[[variants]]`` tables, each with a ``name`` and sections that are deep-merged over the base config.
"""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, ValidationError, create_model, model_validator

from . import registry as R
from .errors import ConfigError
from .config_messages import format_validation_error
from .config_sections import PARTITION_KEYS  # noqa: F401  (re-exported)
from .config_sections import (  # noqa: F401  (re-exported: fedsight.config is where callers import sections from)
    STAGE_OVERRIDABLE, _SPEC_CACHE, EngineSection, EvalSection, InitSection, PrivacySection,
    RunSection, StageSection, TrainSection, _finite_speeds, _unique_stage_names, spec_type,
)
from .registry import Params
from .rng import check_seed


__all__ = ["ConfigError", "parse_override", "read_toml", "set_path", "validate"]  # sweeps and loading: fedsight.sweep


def _sections() -> dict[str, Any]:
    from .data.server_split import ValidationSection  # the server-held validation set (FedVG)
    from .pretrain import PretrainSection  # the server-held pre-training split (Fed3R's extractor)
    from .data.thesis_protocols import RGBShift  # thesis Table 3.9's domain perturbation

    partition_extra = {
        "num_clients": (int, Field(..., ge=1, description="clients the training pool is split over")),
        "local_test_fraction": (float, Field(0.2, ge=0, lt=1, description="share of each client's examples kept "
                                                                                "as its local test set")),
        "rgb_shift": (RGBShift | None, Field(None, description="thesis Table 3.9: thirds of the clients (and of the "
                                             "test set) get one RGB channel x delta, the others x 1/delta")),
        "global_imbalance": (Literal["A", "B", "C", "D"] | None, Field(None, description=(
            "thesis Table 3.11: keep half the training pool, class groups keeping 50 | 25/75 | 20-80 | 5-95%"))),
    }
    recipe = create_model(
        "RecipeSection",
        __base__=Params,
        weighting=(spec_type(R.WEIGHTINGS), Field("data_size", validate_default=True,
                                                  description="how much each upload counts (fedsight list weightings)")),
        aggregator=(spec_type(R.AGGREGATORS), Field("mean", validate_default=True,
                                                    description="how uploads combine (fedsight list aggregators)")),
        sharing=(spec_type(R.SHARING), Field("global", validate_default=True,
                                             description="which tensors are global or personal (fedsight list sharing)")),
        components=(list[spec_type(R.COMPONENTS)], Field(
            default_factory=list, description="recipe parts, in order (fedsight list components)")),
    )
    server = create_model(
        "ServerSection",
        __base__=Params,
        rounds=(int, Field(..., ge=1, description="communication rounds")),
        clients_per_round=(int | None, Field(None, ge=1, description="clients sampled a round (default: all)")),
        fraction=(float | None, Field(None, gt=0, le=1, description="or: the share of clients sampled a round")),
        optimizer=(spec_type(R.SERVER_OPTIMIZERS), Field("sgd", validate_default=True, description=(
            "applied to the negative weighted delta: sgd (lr 1) = FedAvg; fedadam, fedyogi, ... (fedsight list "
            "optimizers)"))),
        # client failure (in-process; engine.loop.InProcessBackend.train documents the streams)
        min_clients=(int, Field(1, ge=1, description="fewer accepted updates: the round is not aggregated")),
        dropout=(float, Field(0.0, ge=0, lt=1, description="probability a sampled client drops out of a round")),
        speed_sigma=(Annotated[float, AfterValidator(_finite_speeds)],
                     Field(0.0, ge=0, description="stragglers: client speeds ~ LogNormal(0, sigma); at most 20")),
        deadline=(float | None, Field(None, gt=0, description="updates over this many unit-speed steps are lost")),
    )
    return {
        "plugins": (list[str], Field(default_factory=list, description="modules imported before validation, "
                                     "which register models, datasets or recipe parts by name")),
        "seed": (Annotated[int, AfterValidator(check_seed)], Field(0, ge=0)),
        "run": (RunSection, Field(default_factory=RunSection)),
        "task": (spec_type(R.TASKS), Field("classification", validate_default=True)),
        "data": (spec_type(R.DATASETS), ...),
        "partition": (spec_type(R.PARTITIONERS, partition_extra), ...),
        "model": (spec_type(R.MODELS), ...),
        "train": (TrainSection, Field(default_factory=TrainSection)),
        "server": (server, ...),
        "recipe": (recipe, Field(default_factory=recipe)),
        "eval": (EvalSection, Field(default_factory=EvalSection)),
        "engine": (EngineSection, Field(default_factory=EngineSection)),
        "privacy": (PrivacySection, Field(default_factory=PrivacySection)),
        "init": (InitSection, Field(default_factory=InitSection)),
        "stages": (Annotated[list[StageSection], AfterValidator(_unique_stage_names)], Field(default_factory=list)),
        "validation": (ValidationSection, Field(default_factory=ValidationSection)),
        "pretrain": (PretrainSection, Field(default_factory=PretrainSection)),
    }


def config_model() -> type[BaseModel]:
    """The Config model for the components registered now (rebuilt when registries change)."""
    from .plugins import load_builtin

    load_builtin()

    key = ("config", *(tuple(r.names()) for r in _ALL_REGISTRIES()))
    if key not in _SPEC_CACHE:
        cfg = create_model("Config", __base__=Params, **_sections())

        def _check(self: Any) -> Any:
            s = self.server
            if s.clients_per_round is not None and s.fraction is not None:
                raise ValueError("set either server.clients_per_round or server.fraction, not both")
            family = self.task.name
            for section, reg in (("data", R.DATASETS), ("model", R.MODELS)):
                entry = reg.get(getattr(self, section).name)
                if entry.task_family != family:
                    raise ValueError(
                        f"{section}.name = {entry.name!r} is a {entry.task_family} {reg.kind}, but task is {family!r}; "
                        f"{reg.kind}s for {family}: {', '.join(e.name for e in reg.entries() if e.task_family == family)}"
                    )
            for key in ("rgb_shift", "global_imbalance"):  # thesis ch. 3 protocols of the classification pool
                if getattr(self.partition, key) is not None and family != "classification":
                    raise ValueError(f"partition.{key} applies to classification data; task is {family!r}")
            v = self.validation
            if v.source == "dataset" and v.dataset is not None:  # V is a split of a dataset of this task
                entry = R.DATASETS.get(v.dataset["name"])
                if entry.task_family != family:
                    raise ValueError(
                        f"validation.dataset.name = {entry.name!r} is a {entry.task_family} dataset, but task is "
                        f"{family!r}; datasets for {family}: "
                        f"{', '.join(e.name for e in R.DATASETS.entries() if e.task_family == family)}")
            if self.stages and sum(st.rounds for st in self.stages) != s.rounds:
                raise ValueError(
                    f"server.rounds = {s.rounds} but the stages' rounds sum to {sum(st.rounds for st in self.stages)}"
                )
            if s.min_clients > (per := s.clients_per_round or self.partition.num_clients):
                raise ValueError(f"server.min_clients = {s.min_clients} exceeds the clients sampled per round ({per})")
            if s.clients_per_round is not None and s.clients_per_round > self.partition.num_clients:
                raise ValueError(
                    f"server.clients_per_round = {s.clients_per_round} exceeds partition.num_clients = {self.partition.num_clients}"
                )
            return self

        cfg = create_model("Config", __base__=cfg, __validators__={"_check": model_validator(mode="after")(_check)})
        _SPEC_CACHE[key] = cfg
    return _SPEC_CACHE[key]


def _ALL_REGISTRIES() -> list[R.Registry[Any]]:
    return [R.TASKS, R.MODELS, R.DATASETS, R.PARTITIONERS, R.WEIGHTINGS, R.SERVER_OPTIMIZERS, R.AGGREGATORS, R.COMPONENTS, R.SHARING]


# -- loading ---------------------------------------------------------------------------------------


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML config, read by ``fedsight.safe_read.read_toml`` (a regular file of bounded size, strict UTF-8,
    nesting and digit limits): every failure is one ConfigError naming the file."""
    from .safe_read import read_toml as bounded

    return bounded(path)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` with a TOML value (``3``, ``0.1``, ``true``, ``"x"``, ``[1, 2]``); bare words
    are strings."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value")
    key, value = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"--set {text!r}: empty key")
    try:
        parsed = tomllib.loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value.strip()
    except ValueError as exc:  # an integer past Python's digit limit
        raise ConfigError(f"--set {key}: an integer of more than 4,300 digits") from None
    return key.split("."), parsed


def set_path(raw: dict[str, Any], path: list[str], value: Any) -> None:
    cur = raw
    for part in path[:-1]:
        nxt = cur.get(part)
        if isinstance(nxt, str):  # bare component name -> table
            nxt = {"name": nxt}
        if not isinstance(nxt, dict):
            nxt = {}
        cur[part] = nxt
        cur = nxt
    if path[-1] == "name" and path[:-1] != ["run"] and isinstance(cur.get("name"), str) and cur.get("name") != value:
        # switching component: drop the old component's parameters ([run] has a name but is no component)
        for k in list(cur):
            if k != "name" and k not in PARTITION_KEYS:
                del cur[k]
    cur[path[-1]] = value


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        b = out.get(k)
        if isinstance(b, str) and isinstance(v, dict):
            b = {"name": b}
        if isinstance(b, dict) and isinstance(v, dict):
            if "name" in v and b.get("name") != v["name"] and k != "run":
                keep = {kk: vv for kk, vv in b.items() if kk in PARTITION_KEYS}
                out[k] = {**keep, **copy.deepcopy(v)}
            else:
                out[k] = deep_merge(b, v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def validate(raw: dict[str, Any], source: str = "config") -> BaseModel:
    """A validated config: every section's keys and values, then every recipe part's and option's
    requirements against what the task, the model and the config provide (``fedsight.capabilities``),
    then every stage as a config of its own. The modules ``raw["plugins"]`` names are imported first
    (``fedsight.plugins.load_plugins``): the names they register are valid in the rest of the config."""
    from .plugins import load_plugins

    load_plugins(raw.get("plugins", []), source)
    cls = config_model()
    try:
        cfg = cls.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, raw, cls, source)) from None
    from .model_selection import selection_problems

    problems = unmet_requirements(cfg) + part_problems(cfg) + model_problems(cfg) + selection_problems(cfg)
    if problems:
        raise ConfigError("\n".join(f"{source}: {p}" for p in problems))
    stage_configs(cfg, source)  # every stage must be a valid config too
    return cfg


def _parts(cfg: Any) -> list[tuple[str, R.Registry[Any], Any]]:
    """(config key, registry, spec) of every recipe part and the server optimizer."""
    rc = cfg.recipe
    parts = [("recipe.weighting", R.WEIGHTINGS, rc.weighting), ("recipe.aggregator", R.AGGREGATORS, rc.aggregator),
             ("recipe.sharing", R.SHARING, rc.sharing), ("server.optimizer", R.SERVER_OPTIMIZERS, cfg.server.optimizer)]
    return parts + [(f"recipe.components[{i}]", R.COMPONENTS, c) for i, c in enumerate(rc.components)]


def part_problems(cfg: Any) -> list[str]:
    """What each part's registered ``check(spec, cfg)`` finds wrong between its parameters and the rest of the
    config (e.g. Krum's ``byzantine`` against the clients a round samples): one line naming both keys."""
    out = []
    for where, reg, spec in _parts(cfg):
        check = reg.get(spec.name).meta.get("check")
        if check is not None and (why := check(spec, cfg)):
            out.append(f"{where}: {why}")
    return out


def model_problems(cfg: Any) -> list[str]:
    """Construction errors that depend on the model's parameters alone: group-norm group counts that do not
    divide a layer's channels. Found by building the model on the meta device (no memory, no data) for a
    placeholder input and output; any other construction error is left to the real build, which knows the
    data's shapes."""
    if getattr(cfg.model, "norm", None) != "group":
        return []
    import torch

    from .models import build_model
    from .models.layers import NormGroupsError
    from .tasks.base import component_params

    try:
        with torch.device("meta"):
            build_model(cfg.model.name, component_params(cfg.model), in_channels=3, num_outputs=2, image_size=32)
    except NormGroupsError as exc:
        return [f"model.group_norm_groups = {cfg.model.group_norm_groups}: {exc}"]
    except Exception:  # noqa: BLE001 - placeholder shapes; the real build reports its own errors
        pass
    return []


def requirements(cfg: Any) -> list[Any]:
    """What a validated config's recipe parts, sections and options need (``capabilities.Requirement``)."""
    from .capabilities import Requirement, resolve

    out = []
    for where, reg, spec in _parts(cfg):
        needs = resolve(reg.get(spec.name).requires, spec)
        if needs:
            out.append(Requirement(f"{where} = {spec.name!r}", needs))
    t = cfg.train
    if t.temperature != 1.0:
        out.append(Requirement(f"train.temperature = {t.temperature}", frozenset({"class_logits"})))
    if t.freeze:
        out.append(Requirement(f"train.freeze = {list(t.freeze)}", frozenset({"parameter_groups"})))
    v = cfg.validation
    if v.source != "none":
        out.append(Requirement(f"validation.source = {v.source!r}", frozenset({"server_split"})))
    if v.imbalance is not None:
        out.append(Requirement(f"validation.imbalance = {v.imbalance}", frozenset({"class_labels"})))
    if cfg.eval.oll:
        out.append(Requirement("eval.oll = true", frozenset({"class_labels", "linear_head"})))
    if cfg.eval.class_split:
        out.append(Requirement(f"eval.class_split = {cfg.eval.class_split}", frozenset({"class_labels"})))
    if cfg.eval.select == "best":  # selection is on validation data, never on test
        out.append(Requirement("eval.select = 'best'", frozenset({"val_split"})))
    if cfg.pretrain.source != "none":
        out.append(Requirement(f"pretrain.source = {cfg.pretrain.source!r}",
                               frozenset({"server_split", "class_labels", "parameter_groups"})))
    return out


def provided(cfg: Any) -> tuple[dict[str, frozenset[str]], dict[str, str]]:
    """What the task, the model and the config sections of a validated config provide, and how to name
    each provider in a message."""
    from .capabilities import resolve

    task_spec = R.TASKS.get(cfg.task.name).meta["spec"](cfg.task)
    model = R.MODELS.get(cfg.model.name)
    config = {"val_split"} if cfg.validation.source != "none" else set()
    return (
        {"task": task_spec.provides, "model": resolve(model.provides, cfg.model), "config": frozenset(config)},
        {"task": f"task {cfg.task.name!r}", "model": f"model {cfg.model.name!r} (with these parameters)"},
    )


def unmet_requirements(cfg: Any) -> list[str]:
    """One line per requirement of ``cfg`` that its task, model or sections do not meet."""
    from .capabilities import missing

    have, names = provided(cfg)
    return missing(requirements(cfg), have, names)


def stage_configs(cfg: Any, source: str = "config") -> list[tuple[str, int, Any]]:
    """(name, rounds, validated config) of each ``[[stages]]`` entry: the base config with the
    stage's override tables deep-merged in and ``server.rounds`` set to the stage's rounds."""
    if not cfg.stages:
        return []
    base = cfg.model_dump(mode="json")
    base.pop("stages")
    out = []
    for i, st in enumerate(cfg.stages):
        raw = deep_merge(base, dict(st.model_extra or {}))
        raw["server"] = {**raw.get("server", {}), "rounds": st.rounds}
        out.append((st.name, st.rounds, validate(raw, f"{source} (stages[{i}] {st.name})")))
    return out
