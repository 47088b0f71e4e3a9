"""The FedSight config in a Flower run config, one key per config value, so that ``flwr run --run-config``
overrides keys one by one (``--run-config 'fedsight.server.rounds=3'``).

Flower's run config is a flat mapping of str -> bool / int / float / str: the app's
``[tool.flwr.app.config]`` may hold nested tables, which ``flwr`` flattens by joining keys with dots
(``flwr.common.config.flatten_dict``), and ``--run-config`` may change only keys the app already has
(``fuse_dicts``). So the resolved FedSight config goes into the table ``fedsight`` with every scalar as itself
(``fedsight.server.rounds = 4``); what TOML's scalars cannot hold is a JSON string behind the marker ``json:``:
lists (``fedsight.model.channels = "json:[8]"``), ``None`` (``"json:null"``), empty tables and tables whose keys
would not survive the dots (a key with a dot in it), and strings that themselves begin with ``json:``. Every key of
the config is present, so every key can be overridden; a list is overridden with its JSON
(``--run-config 'fedsight.model.channels="json:[16, 16]"'``).

``config_json(run_config)`` turns the (flattened, overridden) run config back into the config's JSON, the form
the ServerApp and ClientApp validate; the one-string form of earlier apps (``fedsight-config``, the whole config as
JSON) is still read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

PREFIX = "fedsight"  # the table (and flat-key prefix) holding the FedSight config
LEGACY = "fedsight-config"  # earlier apps: the whole config as one JSON string
MARK = "json:"
_KEY = re.compile(r"^[A-Za-z0-9_-]+$")  # a key that survives Flower's dot-joining and TOML's bare keys


def _encode(value: Any) -> Any:
    """One config value as a run-config value: a table of encoded values, a scalar, or ``json:``-marked JSON."""
    if isinstance(value, dict) and value and all(isinstance(k, str) and _KEY.match(k) for k in value):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (bool, int, float)) or (isinstance(value, str) and not value.startswith(MARK)):
        return value
    return MARK + json.dumps(value, sort_keys=True)


def config_table(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The ``[tool.flwr.app.config.fedsight]`` table of a resolved config (nested; Flower flattens it)."""
    return {k: _encode(v) for k, v in raw.items()}


def flat_run_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The run-config keys (``fedsight.a.b``) of a resolved config, flattened as Flower flattens an app's table."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            out[prefix] = value

    walk(PREFIX, config_table(raw))
    return out


def _decode(key: str, value: Any) -> Any:
    if isinstance(value, str) and value.startswith(MARK):
        try:
            return json.loads(value[len(MARK):])
        except json.JSONDecodeError as exc:
            raise ValueError(f"run config {key} = {value!r}: not JSON after {MARK!r} ({exc.msg})") from None
    return value


def config_from_run_config(rc: Mapping[str, Any]) -> dict[str, Any]:
    """The FedSight config (a raw dict, not yet validated) of a Flower run config: its ``fedsight.*`` keys
    (flattened, possibly overridden; a nested ``fedsight`` table, as ``tomllib`` reads an app's pyproject, is
    read too), else the ``fedsight-config`` JSON of earlier apps. ``KeyError`` when the run config holds neither."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            flat[prefix] = value

    for k, v in rc.items():
        if k == PREFIX or k.startswith(PREFIX + "."):
            walk(k, v)
    if not flat:
        if LEGACY in rc:
            return json.loads(str(rc[LEGACY]))
        raise KeyError(f"run config has no '{PREFIX}.*' keys (write the app with `fedsight flower app`)")
    raw: dict[str, Any] = {}
    for key in sorted(flat):
        parts = key.split(".")[1:]
        node = raw
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"run config {key}: {'.'.join(parts[:-1])} is a value, not a table")
        node[parts[-1]] = _decode(key, flat[key])
    return raw


def config_json(rc: Mapping[str, Any]) -> str:
    """``config_from_run_config`` as canonical JSON (sorted keys: equal configs give equal text, which the nodes'
    caches key on)."""
    return json.dumps(config_from_run_config(rc), sort_keys=True)
