"""Capabilities: what tasks, models and config sections provide, and what recipe parts require.

A recipe part (component, weighting, sharing, aggregator, server optimizer), a config section or a
``train`` option may need something only some tasks or models have: class labels (Fed3R, OLL), class
logits (the softmax temperature), normalisation statistics (SiloBN), a server-held validation set
(FedVG). Each declares what it requires; tasks, models and the config declare what they provide;
``missing`` compares the two before anything is built, so an incompatible combination fails at config
time with a message naming both sides instead of failing in round 1 (or silently doing something else).

Every capability has one kind of provider:

* ``task``: declared by the task class (``Task.provides``);
* ``model``: declared by the model's registry entry as a function of its parameters (the conformance
  suite checks each declaration against the built model, ``fedsight.models.base.detect_capabilities``);
* ``config``: switched on by a config section (``[validation] source``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Capability:
    name: str
    kind: str  # "task" | "model" | "config"
    #: what it means, as read in "X needs <description>"
    description: str
    #: for config capabilities: how to switch it on
    hint: str = ""


CAPABILITIES: dict[str, Capability] = {
    c.name: c
    for c in (
        Capability("class_labels", "task", "a class label for every example in one fixed label space"),
        Capability("class_logits", "task", "class logits as model outputs (a softmax over classes, per example or per pixel)"),
        Capability("server_split", "task", "server-held splits carved out of the training pool"),
        Capability("image_outputs", "task", "images as model outputs and targets"),
        Capability("visuals", "task", "visual examples of predictions"),
        Capability("soft_targets", "task", "outputs that are distributions or heatmaps (distillation targets)"),
        Capability("styles", "task", "per-client and per-image style vectors (low-frequency amplitude windows) and "
                   "a labelled source set on the server for source pre-training"),
        Capability("domains", "task", "a domain (city, town, weather, camera) for every image, and per-domain "
                   "evaluation of test sets"),
        Capability("resolution_ladder", "task", "a native input resolution per client from a resolution ladder, "
                   "and heatmap targets at any rung"),
        Capability("parameter_groups", "model", "declared parameter groups (backbone, head, norm)"),
        Capability("linear_head", "model", "a linear classifier head on a feature vector"),
        Capability("norm_layers", "model", "normalisation layers"),
        Capability("norm_stats", "model", "normalisation layers with running statistics (BatchNorm)"),
        Capability(
            "val_split", "config", "a server-held validation set",
            'set validation.source = "carve" (e.g. with validation.fraction = 0.1) or "dataset" (with validation.dataset)',
        ),
    )
}

#: what a registry entry declares: a fixed set, or a function of the entry's validated parameters
Declared = frozenset[str] | Callable[[Any], Iterable[str]]


def resolve(declared: Declared | None, params: Any) -> frozenset[str]:
    """A declaration's capability names for ``params``; unknown names are a programming error."""
    if declared is None:
        return frozenset()
    names = frozenset(declared(params) if callable(declared) else declared)
    unknown = sorted(names - set(CAPABILITIES))
    if unknown:
        raise KeyError(f"unknown capabilities {unknown}; known: {sorted(CAPABILITIES)}")
    return names


@dataclass(frozen=True)
class Requirement:
    """``who`` (e.g. ``recipe.weighting = 'fedvg'``) needs every capability in ``needs``."""

    who: str
    needs: frozenset[str]


def missing(requirements: Iterable[Requirement], provided: dict[str, frozenset[str]], providers: dict[str, str]) -> list[str]:
    """One message per unmet need. ``provided`` maps a provider kind ("task", "model", "config") to what
    it provides; ``providers`` names each kind's provider for the message (``task 'video_sr'``)."""
    out = []
    for req in requirements:
        for cap in sorted(req.needs):
            c = CAPABILITIES[cap]
            if cap in provided.get(c.kind, frozenset()):
                continue
            if c.kind == "config":
                out.append(f"{req.who} needs {c.description} ({cap}): {c.hint}")
            else:
                out.append(f"{req.who} needs {c.description} ({cap}), which {providers.get(c.kind, c.kind)} does not provide")
    return out
