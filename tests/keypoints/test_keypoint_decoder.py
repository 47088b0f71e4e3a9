"""RAF's plain argmax decoding (issue 47; the RAF paper: each joint's coordinate is the argmax of its heatmap)
beside the default SimpleBaseline decoding (flip test, quarter-pixel shift), on synthetic heatmaps whose
answers are written out here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedsight.config import ConfigError, validate
from fedsight.tasks.keypoints import KeypointParams
from test_keypoint_task import dot_task, raw_config

STRIDE = 4  # KeypointParams' default heatmap_stride


def synthetic_heatmap() -> torch.Tensor:
    """One instance, 16 joints on a 16 x 12 map; joint 0 peaks at (x=5, y=6) with a higher right (x=6) and
    lower upper (y=5) neighbour, so the quarter-pixel shift moves it to (5.25, 6.25)."""
    hm = torch.zeros(1, 16, 16, 12)
    hm[0, 0, 6, 5] = 1.0
    hm[0, 0, 6, 6], hm[0, 0, 6, 4] = 0.6, 0.2
    hm[0, 0, 7, 5], hm[0, 0, 5, 5] = 0.5, 0.1
    hm[0, 1:, 3, 3] = 0.5  # the other joints somewhere with a positive maximum
    return hm


def identity() -> torch.Tensor:
    return torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])


@pytest.mark.parametrize("decoder,expected", [("argmax", (5.0, 6.0)), ("simplebaseline", (5.25, 6.25))])
def test_decoders_on_a_synthetic_heatmap(decoder: str, expected: tuple[float, float]) -> None:
    task = dot_task(decoder=decoder)
    hm = synthetic_heatmap()
    pred = task.decode(hm, identity(), (16 * STRIDE, 12 * STRIDE))
    # heatmap pixel -> input pixel: times the stride, then the (identity) inverse crop
    assert pred[0, 0, :2].tolist() == [expected[0] * STRIDE, expected[1] * STRIDE]
    assert pred[0, 0, 2].item() == 1.0 and pred[0, 1, :2].tolist() == [3 * STRIDE, 3 * STRIDE]


class Asymmetric(nn.Module):
    """Heatmaps peaking at the input's brightest column, counting its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        col = x.mean(dim=(1, 2)).argmax(-1)  # [B]
        hm = torch.zeros(x.shape[0], 16, x.shape[-2] // STRIDE, x.shape[-1] // STRIDE)
        hm[torch.arange(x.shape[0]), :, 2, col // STRIDE] = 1.0
        return hm


def test_argmax_runs_no_flip_test_and_the_default_does() -> None:
    x = torch.zeros(1, 3, 64, 48)
    x[..., 8] = 1.0
    plain, model = dot_task(decoder="argmax"), Asymmetric()
    out = plain.predict(model, x)
    assert model.calls == 1 and out[0, 0, 2].argmax().item() == 2  # column 8 -> heatmap column 2, unaveraged
    default, model = dot_task(), Asymmetric()
    out = default.predict(model, x)
    assert model.calls == 2 and out[0, 0, 2].max().item() == 0.5  # the mirror's peak is elsewhere: averaged
    assert KeypointParams().decoder == "simplebaseline" and KeypointParams().use_flip_test


@pytest.mark.parametrize("field", ["flip_test", "refine"])
def test_argmax_with_flip_test_or_refine_set_is_a_config_error(tmp_path, field: str) -> None:
    raw = raw_config(tmp_path)
    raw["task"] = dict(raw["task"], decoder="argmax", **{field: True})
    with pytest.raises(ConfigError, match=f"decoder = 'argmax' is the plain argmax .*it has no {field}"):
        validate(raw)
    raw["task"][field] = False  # false agrees with it
    assert validate(raw).task.decoder == "argmax"
