"""Parameter sharing: which entries of the model state are global."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Literal

from pydantic import Field
from torch import nn

from ..metrics import MetricState
from ..registry import SHARING, NoParams, Params
from ..training import EvalContext


class Sharing:
    """Base of parameter-sharing strategies: which state entries are global, and how evaluation
    treats the personal ones."""

    name = "sharing"

    def shared_keys(self, model: nn.Module) -> set[str]:
        raise NotImplementedError

    def eval_context(self, model: nn.Module, ctx: EvalContext) -> contextlib.AbstractContextManager:
        """Wraps every evaluation of ``model`` on ``ctx.split`` (a global test split, a client id or a
        server-held split); may temporarily change the model (FedBN/SiloBN test-time statistics) and must
        restore it on exit. The default does nothing."""
        return contextlib.nullcontext()

    def evaluate(self, model: nn.Module, ctx: EvalContext, run: Callable[[EvalContext], MetricState]) -> MetricState:
        """The metric state of ``model`` on ``ctx.split``: ``run(ctx)`` evaluates a split (the components'
        hooks included). The default runs it once inside ``eval_context``; a sharing may instead evaluate
        parts of the split separately and merge their states (SiloBN's statistics by domain)."""
        with self.eval_context(model, ctx):
            return run(ctx)


class GlobalSharing(Sharing):
    """Every parameter and buffer is global (FedAvg and the FedOpt family)."""

    name = "global"

    def shared_keys(self, model: nn.Module) -> set[str]:
        return set(model.state_dict().keys())


@SHARING.register("global", help="all parameters and buffers are shared")
def _global(params: NoParams) -> GlobalSharing:
    return GlobalSharing()


class LocalSharing(Sharing):
    """Nothing is shared: every client trains and keeps its own copy, starting from the global model
    the first time. As a stage after federated training this is full personalisation by local
    fine-tuning (the thesis's FP phase)."""

    name = "local"

    def shared_keys(self, model: nn.Module) -> set[str]:
        return set()


@SHARING.register("local", help="nothing shared: per-client models from the global start (local fine-tuning)")
def _local(params: NoParams) -> LocalSharing:
    return LocalSharing()


class PersonalParams(Params):
    part: Literal["head", "backbone"] = Field(
        "head",
        description="the personal group: 'head' = Name(psi) (shared extractor, personal classifier), "
        "'backbone' = Name(phi) (shared classifier, personal extractor)",
    )


class PersonalSharing(Sharing):
    """Partial personalisation (thesis Sec. 4.1, after Pillutla et al. 2022): the model splits into shared
    u and personal v. The server sends u, the client trains u and v, uploads only u's delta and keeps v
    in its client state; a client's evaluation uses its own v. With plain SGD this is FedSim (u and v
    updated simultaneously); with the ``fedalt`` component it is FedAlt. ``part = "head"`` is the thesis's
    Name(psi) (classifier personal), ``"backbone"`` is Name(phi) (extractor personal; the backbone's norm
    layers go with it)."""

    name = "personal"

    def __init__(self, part: str = "head"):
        self.part = part

    def shared_keys(self, model: nn.Module) -> set[str]:
        groups = getattr(model, "parameter_groups", None)
        if groups is None:
            raise ValueError(f"recipe.sharing = 'personal': model {type(model).__name__} declares no parameter groups")
        personal = set(groups()[self.part])
        return {k for k in model.state_dict() if k not in personal}


@SHARING.register("personal", params=PersonalParams, requires={"parameter_groups"},
                  help="partial personalisation: a personal head or backbone (FedSim; FedAlt with the fedalt component)")
def _personal(params: PersonalParams) -> PersonalSharing:
    return PersonalSharing(params.part)
