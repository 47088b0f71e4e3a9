"""Renaming a checkpoint's keys by rules: the one step every published-weights layout (``fedsight.weights``,
``weights_pose``, ``weights_sr``) shares."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch


def rename_keys(state: Mapping[str, torch.Tensor], rules: Iterable[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Each key through the first ``(pattern, replacement)`` rule whose pattern matches it (``re.sub`` once); keys
    no rule matches keep their name (and are reported as unplaced when the model has no such key)."""
    compiled = [(re.compile(p), r) for p, r in rules]
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        for pat, rep in compiled:
            if pat.match(k):
                k = pat.sub(rep, k, count=1)
                break
        out[k] = v
    return out
