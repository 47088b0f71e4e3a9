"""Name -> component registries with typed parameters.

Every pluggable piece (dataset, model, partitioner, recipe part, task) is registered under a name with a
pydantic model describing its parameters. Configs name a component and give its parameters; the
parameters are validated against that model at the edge (``fedsight.config``), so nothing below the CLI
sees an untyped dict.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, model_validator

T = TypeVar("T")


class Params(BaseModel):
    """Base class of every component's parameter model: unknown keys are errors, no float may be inf or NaN
    (``lr = inf`` used to train), and no value is coerced across types (strict mode: ``rounds = "2"``,
    ``lr = true`` or ``nesterov = "yes"`` are errors; an integer where a float is expected is the one
    widening allowed). TOML has arrays and strings but no tuples or paths, so a list given for a tuple field
    and a string given for a path field are taken as written (their elements are still checked strictly)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _toml_shapes(cls, data: Any) -> Any:
        conv = _shape_fields(cls)
        if not conv or not isinstance(data, dict):
            return data
        out = dict(data)
        for key, kind in conv.items():
            v = out.get(key)
            if kind is tuple and isinstance(v, list):
                out[key] = tuple(v)
            elif kind is Path and isinstance(v, str):
                out[key] = Path(v)
        return out


def _bare(ann: Any) -> set[Any]:
    """The origins a field annotation admits (``Annotated`` and unions unwrapped)."""
    while typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return set().union(*(_bare(a) for a in typing.get_args(ann)))
    return {typing.get_origin(ann) or ann}


@cache
def _shape_fields(cls: type[BaseModel]) -> dict[str, type]:
    out: dict[str, type] = {}
    for name, f in cls.model_fields.items():
        kinds = _bare(f.annotation)
        if tuple in kinds and list not in kinds:
            out[f.alias or name] = tuple
        elif any(isinstance(k, type) and issubclass(k, Path) for k in kinds):
            out[f.alias or name] = Path
    return out


def literal_choices(ann: Any) -> tuple[Any, ...]:
    """The values a ``Literal`` field annotation allows (through ``Annotated`` and ``Optional``; ``None`` left
    out): what ``fedsight list`` shows beside a choice parameter's default, and ``fedsight init``'s comments.
    Empty for any other annotation."""
    while typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    if typing.get_origin(ann) is typing.Literal:
        return typing.get_args(ann)
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return tuple(v for a in typing.get_args(ann) for v in literal_choices(a))
    return ()


def off_but_set(section: BaseModel, table: str, why: str) -> None:
    """A section switched off by ``source = "none"`` whose other keys differ from their defaults: a ValueError
    naming the first such key and ``source`` (its value would silently do nothing; a dump's defaults pass)."""
    import json

    unused = [k for k, f in type(section).model_fields.items()
              if k != "source" and getattr(section, k) != f.get_default(call_default_factory=True)]
    if unused:
        raise ValueError(f"{table}.{unused[0]} = {json.dumps(getattr(section, unused[0]))} is set but {table}.source "
                         f'= "none" ({why}); set {table}.source or remove {table}.{unused[0]}')


class NoParams(Params):
    pass


@dataclass(frozen=True)
class Entry(Generic[T]):
    name: str
    factory: T
    params: type[Params]
    help: str
    #: for datasets and models: the task family they serve (None = "classification")
    task: str | None = None
    #: capabilities (``fedsight.capabilities``) this part needs: a set, or a function of its params
    requires: Any = None
    #: capabilities this part provides (models): a set, or a function of its params
    provides: Any = None
    #: kind-specific declarations (a task's ``spec``; the metrics a part logs, ``metrics``)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def task_family(self) -> str:
        return self.task or "classification"


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}

    def register(
        self, name: str, params: type[Params] = NoParams, help: str = "", task: str | None = None, *,
        requires: Any = None, provides: Any = None, **meta: Any,
    ) -> Callable[[T], T]:
        """Register ``factory(params, **context)`` under ``name``. ``requires`` / ``provides``: the
        capabilities it needs or has (a set, or a function of the validated params); ``meta``: other
        declarations (a task's ``spec``, the ``metrics`` a recipe part logs)."""

        def deco(obj: T) -> T:
            old = self._entries.get(name)
            rerun = old is not None and (getattr(old.factory, "__module__", None), getattr(old.factory, "__qualname__", None)) \
                == (getattr(obj, "__module__", None), getattr(obj, "__qualname__", None))
            if old is not None and not rerun:  # the same definition again (a notebook cell run twice) replaces it
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            doc = help or (getattr(obj, "__doc__", None) or "").strip().split("\n")[0]
            self._entries[name] = Entry(name, obj, params, doc, task, requires, provides, dict(meta))
            return obj

        return deco

    def get(self, name: str) -> Entry[T]:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry[T]]:
        return [self._entries[n] for n in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def answers_to(self, word: str) -> bool:
        """Whether ``word`` names this registry on the command line (``fedsight list WORD``): its kind, singular or
        plural, with spaces, hyphens or underscores ("server_optimizers", "server-optimizer"), or the kind's last
        word ("optimizers", "components", "sharing"), the words ``fedsight list`` prints as its headings."""
        w = word.strip().lower().replace("-", " ").replace("_", " ")
        w = " ".join(w.split())
        forms = {self.kind, self.kind.split()[-1]}
        return any(w in (f, f + "s") for f in forms)


def build(registry: Registry[Any], name: str, params: Params | dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """Instantiate ``name`` from ``registry`` with validated params plus extra keyword context."""
    entry = registry.get(name)
    if params is None or isinstance(params, dict):
        params = entry.params(**(params or {}))
    return entry.factory(params, **kwargs)


MODELS: Registry[Any] = Registry("model")
DATASETS: Registry[Any] = Registry("dataset")
PARTITIONERS: Registry[Any] = Registry("partitioner")
TASKS: Registry[Any] = Registry("task")
WEIGHTINGS: Registry[Any] = Registry("weighting")
SERVER_OPTIMIZERS: Registry[Any] = Registry("server optimizer")
AGGREGATORS: Registry[Any] = Registry("aggregator")
COMPONENTS: Registry[Any] = Registry("recipe component")
SHARING: Registry[Any] = Registry("parameter sharing")
STAGES: Registry[Any] = Registry("stage")

#: run facts (``Server.facts``) a finished run reports on: fact name -> ``fn(run_dir, facts, task)`` writing
#: plots or files into the run directory (e.g. LADD's style clusters); called when the run has that fact
FACT_REPORTS: dict[str, Any] = {}
