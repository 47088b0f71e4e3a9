"""Model families; importing this package registers them in ``fedsight.registry.MODELS``."""

from __future__ import annotations

from typing import Any

from fedsight.models import bisenetv2, cnn, deeplab, imagenet_resnet, mobilenetv2, pose, rdsn, resnet, vit, vitpose_official, vsr  # noqa: F401  (registration side effect)
from fedsight.models import basicvsr_basicsr  # noqa: F401  (registration: BasicSR's BasicVSR)
from fedsight.models import rdsn_etc  # noqa: F401,E402  (registration: the RDSN authors' network)
from fedsight.models import rvrt  # noqa: F401,E402  (registration: RVRT, the authors' layout)
from fedsight.models.base import FedModel, ModelIO, load_weights, save_weights
from fedsight.registry import MODELS, Params, build

__all__ = ["FedModel", "ModelIO", "build_model", "load_weights", "save_weights"]


def build_model(
    name: str, params: dict[str, Any] | Params | None = None, *, io: ModelIO | None = None, **io_fields: Any
) -> FedModel:
    """Build the registered model ``name`` with validated ``params`` for ``io`` (or a ``ModelIO`` of
    ``io_fields``; a classification model's ``num_classes`` is its ``num_outputs``)."""
    if io is None:
        if "num_classes" in io_fields:
            io_fields["num_outputs"] = io_fields.pop("num_classes")
        io_fields.setdefault("family", MODELS.get(name).task_family)
        io = ModelIO(**io_fields)
    return build(MODELS, name, params, io=io)
