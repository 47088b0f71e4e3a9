"""A small CNN for small images (8x8 sklearn digits up to 64x64), any number of input channels.

Each block is 3x3 conv -> norm -> ReLU, followed by 2x2 max-pool while the spatial size is still >= 4.
The last feature map is average-pooled to a fixed 2x2 grid and flattened, so the feature size does not
depend on the image size, then a Linear+ReLU (``hidden`` units) gives the features.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field
from torch import nn
from torch.nn.modules.utils import _pair

from fedsight.models.base import FedModel, ModelIO, norm_capabilities, state_keys
from fedsight.models.layers import init_weights, norm_layer
from fedsight.registry import MODELS, Params

POOL_GRID = 2


class GridPool(nn.AdaptiveAvgPool2d):
    """``nn.AdaptiveAvgPool2d`` that passes a feature map already of the output size through untouched (the
    average of one element is that element, bit for bit, and so is its gradient) instead of running the pooling
    kernel: 8x8 digits reach the 2x2 grid after two poolings, and there the kernel cost about 5% of a vectorised
    round of 50 clients (``docs/performance.md``)."""

    def __init__(self, output_size: int):
        super().__init__(output_size)
        self.grid = _pair(output_size)

    def forward(self, x):
        return x if tuple(x.shape[-2:]) == self.grid else super().forward(x)


class CNNParams(Params):
    channels: tuple[Annotated[int, Field(gt=0)], ...] = Field((32, 64), min_length=1)
    hidden: int = Field(128, gt=0)
    norm: Literal["batch", "group", "none"] = "none"
    group_norm_groups: int = Field(2, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)


class CNN(FedModel):
    def __init__(self, p: CNNParams, *, num_classes: int, in_channels: int, image_size: int):
        super().__init__()
        layers: list[nn.Module] = []
        size, prev = image_size, in_channels
        for ch in p.channels:
            layers += [
                nn.Conv2d(prev, ch, 3, padding=1, bias=p.norm == "none"),
                norm_layer(p.norm, ch, p.group_norm_groups),
                nn.ReLU(inplace=True),
            ]
            if size >= 4:
                layers.append(nn.MaxPool2d(2))
                size //= 2
            prev = ch
        layers += [
            GridPool(POOL_GRID),
            nn.Flatten(),
            nn.Linear(prev * POOL_GRID * POOL_GRID, p.hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(p.dropout),
        ]
        self.backbone = nn.Sequential(*layers)
        self.feature_dim = p.hidden
        self.head = nn.Linear(p.hidden, num_classes)
        init_weights(self)

    def blocks(self) -> dict[str, list[str]]:
        """One block per conv -> norm -> ReLU (-> pool) unit, one for the feature Linear, and the head."""
        out: dict[str, list[str]] = {}
        name = None
        for i, m in enumerate(self.backbone):
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                name = f"backbone.{i}"
                out[name] = []
            if name is not None:
                out[name] += state_keys(m, f"backbone.{i}")
        out["head"] = state_keys(self.head, "head")
        return out


def _provides(p: CNNParams) -> frozenset[str]:
    return frozenset({"parameter_groups", "linear_head"}) | norm_capabilities(p.norm)


@MODELS.register("cnn", params=CNNParams, help="small CNN for 8x8 to 64x64 images", provides=_provides)
def cnn(p: CNNParams, *, io: ModelIO) -> FedModel:
    return CNN(p, num_classes=io.num_outputs, in_channels=io.in_channels, image_size=io.image_size or 32)
