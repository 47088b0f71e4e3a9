"""Config error messages: pydantic's validation errors turned into one line per key, naming the key as the
config spells it (``recipe.components[1].lr``, not pydantic's location with discriminator tags) and, for an
unknown key, the keys allowed there."""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Sequence
from typing import Annotated, Any, Union

from pydantic import BaseModel, ValidationError


def _allowed_keys(model_cls: Any, loc: tuple, raw: Any) -> list[str] | None:
    """Walk the model along ``loc`` (minus the last part) and list the fields accepted there."""
    cls = _model_at(model_cls, loc, raw)
    if isinstance(cls, type) and issubclass(cls, BaseModel):  # a component's name is its tag, not a key to offer
        return sorted(k for k, f in cls.model_fields.items()
                      if not (k == "name" and typing.get_origin(f.annotation) is typing.Literal))
    return None


def _model_at(model_cls: Any, loc: tuple, raw: Any) -> Any:
    """The model class reached by walking ``model_cls`` along ``loc`` minus its last part (None where the walk
    leaves the models)."""
    cls = model_cls
    cur = raw
    parts = list(loc[:-1])
    i = 0
    while i < len(parts):
        part = parts[i]
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            return None
        field = cls.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        cur = cur.get(part) if isinstance(cur, dict) else None
        cls = _resolve_model(ann, cur)
        if isinstance(cur, list) and i + 1 < len(parts) and isinstance(parts[i + 1], int):
            cur = cur[parts[i + 1]] if parts[i + 1] < len(cur) else None
            cls = _resolve_model(typing.get_args(ann)[0] if typing.get_args(ann) else ann, cur)
            i += 1
        if isinstance(cur, dict) and i + 1 < len(parts) and parts[i + 1] == cur.get("name"):
            i += 1  # discriminator tag in the location
        i += 1
    return cls


def _unwrap(ann: Any) -> Any:
    while typing.get_origin(ann) is Annotated:
        ann = typing.get_args(ann)[0]
    return ann


def _nameless_table(model_cls: Any, loc: tuple, raw: Any, where: str, source: str) -> str:
    """The line for a component table without ``name`` (``union_tag_not_found`` at ``loc``): a key no component
    of that slot accepts is named as unknown, with what the table expects; else the table is said to lack its
    name."""
    plain = f"{source}: {where} has parameters but no name; name the component too (--set {where}.name=...)"
    parts, index = list(loc), None
    if parts and isinstance(parts[-1], int):  # an entry of a list of components (recipe.components[i])
        index = parts.pop()
    parent = _model_at(model_cls, tuple(parts), raw)
    field = parent.model_fields.get(str(parts[-1])) if isinstance(parent, type) and issubclass(parent, BaseModel) \
        and parts else None
    if field is None:
        return plain
    ann = _unwrap(field.annotation)
    if index is not None:
        ann = _unwrap(typing.get_args(ann)[0]) if typing.get_args(ann) else ann
    members = [m for m in (typing.get_args(ann) if typing.get_origin(ann) in (Union, types.UnionType) else (ann,))
               if isinstance(m, type) and issubclass(m, BaseModel)]
    table: Any = raw
    for part in loc:
        table = table.get(part) if isinstance(table, dict) else table[part] if isinstance(table, list) \
            and isinstance(part, int) and part < len(table) else None
    if not members or not isinstance(table, dict):
        return plain
    accepted = set().union(*(m.model_fields for m in members))
    unknown = [k for k in table if k != "name" and k not in accepted]
    if not unknown:
        return plain
    names = sorted(a for m in members if "name" in m.model_fields
                   for a in typing.get_args(m.model_fields["name"].annotation) if isinstance(a, str))
    return (f"{source}: unknown key '{where}.{unknown[0]}': no component accepts it, and {where} has no name; expected "
            f"{where}.name (one of: {', '.join(names)}) and that component's parameters")


def _resolve_model(ann: Any, raw: Any) -> Any:
    while typing.get_origin(ann) is Annotated:
        ann = typing.get_args(ann)[0]
    if typing.get_origin(ann) in (Union, types.UnionType):
        for member in typing.get_args(ann):
            m = _resolve_model(member, raw)
            if isinstance(m, type) and issubclass(m, BaseModel):
                name_field = m.model_fields.get("name")
                if name_field is None or not isinstance(raw, dict):
                    return m
                if typing.get_args(name_field.annotation) == (raw.get("name"),):
                    return m
        return None
    return ann


def _display_loc(loc: tuple, raw: Any) -> str:
    out: list[str] = []
    cur = raw
    for part in loc:
        if isinstance(cur, dict) and part not in cur and cur.get("name") == part:
            continue  # discriminator tag
        if isinstance(part, int):
            out[-1:] = [f"{out[-1]}[{part}]"] if out else [f"[{part}]"]
        else:
            out.append(str(part))
        if isinstance(cur, dict):
            cur = cur.get(part)
        elif isinstance(cur, list) and isinstance(part, int) and part < len(cur):
            cur = cur[part]
        else:
            cur = None
    return ".".join(out) or "(top level)"


def format_validation_error(exc: ValidationError, raw: dict[str, Any], model_cls: Any, source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        where = _display_loc(loc, raw)
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(model_cls, loc, raw)
            hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
            lines.append(f"{source}: unknown key '{where}'{hint}")
        elif err["type"] == "missing":
            lines.append(f"{source}: missing required key '{where}'")
        elif err["type"] == "union_tag_not_found":  # a component table without its name
            lines.append(_nameless_table(model_cls, loc, raw, where, source))
        else:
            msg = err["msg"].removeprefix("Value error, ")
            value = err.get("input")
            shown = f" = {value!r}" if isinstance(value, (int, float, str, bool)) else ""
            if not shown and (msg.startswith(f"{where}.") or (not loc and _KEY.search(msg))):
                lines.append(f"{source}: {msg}")  # a section's or the config's check that names its keys itself
            else:
                lines.append(f"{source}: {where}{shown}: {msg}")
    return "\n".join(lines)


#: a config key as messages spell it: ``server.clients_per_round``, ``recipe.components[1].lr``, or a quoted
#: unknown key (``unknown key 'foo'``, which may have no dot)
_KEY = re.compile(r"(?<![\w.])[a-z_][a-z0-9_]*(?:\[\d+\])?(?:\.[a-z_][a-z0-9_]*(?:\[\d+\])?)+(?![\w(])")
_QUOTED = re.compile(r"unknown key '([^']+)'")


def _plain(key: str) -> str:
    return re.sub(r"\[\d+\]", "", key)


def blamed(body: str, overrides: Sequence[tuple[str, str]]) -> str | None:
    """The override (as the user wrote it: ``--set key=value``) that set a key ``body`` names: the first key named
    (in the message's order) that an override set, itself or a table above it (``--set server.optimizer=fedadam``
    for an error in ``server.optimizer.lr``); or, for a message about a whole table (``model: Input tag 'nope'
    ...``), an override inside that table whose value the message quotes. None when no key the message names came
    from an override."""
    keys = [m.group(1) for m in _QUOTED.finditer(body)] + [m.group(0) for m in _KEY.finditer(body)]
    keys.sort(key=body.find)
    for key in map(_plain, keys):
        for path, shown in overrides:
            if key == path or key.startswith(path + "."):
                return shown
    missing = re.match(r"missing required key '([^']+)'", body)
    if missing:  # a table an override wrote into lacks a key: `--set privacy.central_dp.clipping_norm=1` made it
        parent = _plain(missing.group(1)).rpartition(".")[0]
        for path, shown in overrides:
            if parent and path.rpartition(".")[0] == parent:
                return shown
    table = re.match(r"([a-z_][a-z0-9_.\[\]]*)(?:: | = )", body)
    if table:
        for path, shown in overrides:
            value = shown.partition("=")[2].strip().strip("'\"")
            if path.startswith(_plain(table.group(1)) + ".") and value and value in body:
                return shown
    return None


def attribute(message: str, source: str, overrides: Sequence[tuple[str, str]]) -> str:
    """``message``'s lines (each ``SOURCE...: text``, as ``fedsight.config.validate`` writes them for ``source``)
    with a line whose keys came from an override blamed on it: ``--set server.clients_per_round=50 on
    examples/quickstart.toml (variant fedavg): server.clients_per_round = 50 exceeds partition.num_clients = 20``
    instead of blaming the file for a value it does not hold. ``overrides``: (dotted key, as the user wrote it)."""
    if not overrides:
        return message
    out = []
    for line in message.splitlines():
        head, sep, body = line.partition(": ")
        if sep and head.startswith(source) and (who := blamed(body, overrides)) is not None:
            line = f"{' '.join(who.split())} on {head}: {body}"  # (a value typed over several lines: one line)
        out.append(line)
    return "\n".join(out)
