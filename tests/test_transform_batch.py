"""The data-augmentation hook: a component's ``transform_batch`` sees every training batch (and no evaluation
batch) before the model does, in the task's batch format, reproducibly."""

import pytest
import torch

from fedsight import registry as R
from fedsight.api import execute
from fedsight.config import validate
from fedsight.rng import torch_gen
from fedsight.runs import RunDir
from fedsight.training.component import Component
from helpers import tiny

SEEN: list[tuple] = []


class Cutout(Component):
    """Zero one random size x size square of every training image."""

    name = "cutout"

    def __init__(self, size: int = 3):
        self.size = size

    def client_start(self, ctx):
        ctx.scratch[self.name] = torch_gen(ctx.seed, "cutout", ctx.round, ctx.client_id)

    def transform_batch(self, ctx, x, y):
        SEEN.append((tuple(x.shape), tuple(y.shape), ctx.round, ctx.client_id))
        g = ctx.scratch[self.name]
        h, w = x.shape[-2:]
        top = int(torch.randint(0, h - self.size + 1, (1,), generator=g))
        left = int(torch.randint(0, w - self.size + 1, (1,), generator=g))
        x = x.clone()
        x[..., top:top + self.size, left:left + self.size] = 0
        return x, y


@pytest.fixture
def cutout():
    R.COMPONENTS.register("test_cutout", help="cutout for the test")(lambda p: Cutout())
    SEEN.clear()
    yield
    R.COMPONENTS._entries.pop("test_cutout")


def _final(run_dir):
    return RunDir(run_dir).load_latest_checkpoint()[1]["model"]


def test_every_training_batch_and_no_evaluation_batch_passes_the_hook(tmp_path, cutout):
    raw = tiny(**{"server.rounds": 3, "train.steps": 4, "train.epochs": None, "eval.every": 1,
                  "run.checkpoint_keep": 1})
    plain = execute(validate(raw), tmp_path / "plain").run_dir
    assert SEEN == []
    raw["recipe"] = {"components": ["test_cutout"]}
    cfg = validate(raw)
    aug = execute(cfg, tmp_path / "aug").run_dir
    assert len(SEEN) == 3 * 3 * 4  # rounds x clients per round x steps, no evaluation batch
    assert {(x, y) for x, y, *_ in SEEN} <= {((b, 1, 8, 8), (b,)) for b in range(1, 33)}  # digits, batch <= 32
    assert any(not torch.equal(a, b) for a, b in zip(_final(plain).values(), _final(aug).values()))
    execute(cfg, tmp_path / "cut", stop_after=1)
    execute(cfg, tmp_path / "cut", resume=True)
    assert all(torch.equal(v, _final(tmp_path / "cut")[k]) for k, v in _final(aug).items())
