"""``fedsight schema``: the config's JSON Schema (draft 2020-12), for TOML editors (Taplo, VS Code's Even Better
TOML: a ``#:schema ./fedsight.schema.json`` first line in the config, or a ``[[rule]]`` in ``.taplo.toml``).

Generated from the config model itself (``fedsight.config.config_model``, pydantic's ``model_json_schema``), so
it follows the registries: every dataset, model, partitioner, task and recipe part registered when it is written
has its own parameters, chosen by the table's ``name`` (the schema's ``discriminator``). What pydantic's schema
does not know is added here: a component may be written as its bare name (``optimizer = "sgd"``), and a config
file has ``[sweep]`` and ``[[variants]]`` beside the run's sections.

What it does not cover (``fedsight run`` still checks all of it, one line naming the key): the checks across
keys (``server.clients_per_round`` against ``partition.num_clients``, what a recipe part needs from the task and
the model), the components that ``plugins`` modules register, a variant's tables below its top-level keys
(they are merged over the base config, so they may be partial: only their top-level names are checked), a
grid's keys and values, and values only checked at run time (files that must exist, devices)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

#: the schema's dialect
DIALECT = "https://json-schema.org/draft/2020-12/schema"


def _bare_names(node: Any) -> Any:
    """Every discriminated union of components (a ``discriminator`` with a ``mapping``) also accepts the bare
    name of one of its components, as the config does (``fedsight.config.spec_type``)."""
    if isinstance(node, list):
        return [_bare_names(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _bare_names(v) for k, v in node.items()}
    disc = node.get("discriminator")
    if isinstance(disc, dict) and isinstance(disc.get("mapping"), dict) and "oneOf" in node:
        union = {"oneOf": node.pop("oneOf"), "discriminator": node.pop("discriminator")}
        names = {"type": "string", "enum": sorted(disc["mapping"])}
        node["anyOf"] = [names, union]
    return node


def config_schema() -> dict[str, Any]:
    """The JSON Schema of a FedSight TOML config file, as a dict."""
    from pydantic import BaseModel, create_model

    from .config import config_model
    from .sweep import SweepSection

    model: type[BaseModel] = config_model()
    schema = _bare_names(model.model_json_schema())
    sweep = _bare_names(create_model("Sweep", sweep=(SweepSection, ...)).model_json_schema())
    schema.setdefault("$defs", {}).update(sweep.get("$defs", {}))
    props = schema["properties"]
    props["sweep"] = {**sweep["properties"]["sweep"], "description": "repeat every run for each seed, and run every "
                      "combination of the grid's values (dotted config keys)"}
    top = sorted([*props, "name"])
    props["variants"] = {
        "type": "array", "description": "named variants of the base config: each table is merged over it",
        "items": {"type": "object", "required": ["name"], "propertyNames": {"enum": top},
                  "properties": {"name": {"type": "string", "minLength": 1}}},
    }
    return {"$schema": DIALECT, "title": "FedSight config", **{k: v for k, v in schema.items() if k != "title"}}


def write(out: Path, force: bool = False) -> Path:
    """Write ``config_schema()`` to ``out`` as indented JSON, by temp + rename (``fedsight.safe_write``)."""
    from .safe_write import atomic_write_text

    text = json.dumps(copy.deepcopy(config_schema()), indent=1, sort_keys=False) + "\n"
    atomic_write_text(out, text)
    return out
