"""Classification over an ImageFolder read from disk on demand: the same images as an eager read, the
same batches and results whatever the number of decoding workers, augmentation from the documented
per-sample stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from fedsight.api import build_task, execute
from fedsight.config import validate
from fedsight.data.pipeline import RandomCropFlip, sample_generator

from helpers import tiny


def write_tree(root, classes=("a", "b", "c"), per_class=12, size=10, seed=0):
    rng = np.random.default_rng(seed)
    for k, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            img = np.clip(rng.normal(60 + 60 * k, 40, (size, size, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(img).save(root / name / f"{i:03d}.png")


def cfg_for(root, tmp_path, **over):
    data = {"name": "imagefolder", "train_dir": str(root), "image_size": 8, "test_fraction": 0.25, **over}
    return validate(tiny(**{"data": data, "model.channels": [4], "partition.num_clients": 4,
                            "server.clients_per_round": 2, "server.rounds": 2, "train.batch_size": 4,
                            "run.output_dir": str(tmp_path / "runs"), "engine.threads": 1}))


def test_lazy_batches_are_the_eager_images_standardised(tmp_path):
    write_tree(tmp_path / "tree")
    task = build_task(cfg_for(tmp_path / "tree", tmp_path))
    assert task.pool_x is None  # nothing decoded up front
    pool = task.splits.train.materialize()  # the pool as the eager loader reads it
    mean = pool.x.mean(dim=(0, 2, 3), keepdim=True)
    std = pool.x.std(dim=(0, 2, 3), keepdim=True)
    torch.testing.assert_close(task.mean, mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(task.std, std, rtol=0, atol=1e-6)
    for c in range(task.num_clients):
        pos = torch.arange(task.num_train_examples(c))
        x, y = task.train_batch(c, pos)
        order = task.clients[c].train
        torch.testing.assert_close(x, (pool.x[order] - mean) / std, rtol=0, atol=1e-5)
        assert torch.equal(y, pool.y[order])
    xs = torch.cat([x for x, _ in task.eval_batches("test", 5)])
    test = task.splits.test.materialize()
    torch.testing.assert_close(xs, (test.x - mean) / std, rtol=0, atol=1e-5)


def test_crop_flip_draws_each_sample_from_its_own_stream(tmp_path):
    write_tree(tmp_path / "tree")
    task = build_task(cfg_for(tmp_path / "tree", tmp_path, augment="crop_flip", crop_pad=2, workers=2))
    c, seed, rnd = 1, 7, 3
    steps = [torch.tensor([3, 0, 2]), torch.tensor([1, 4])]
    got = list(task.train_batches(c, steps, seed=seed, round=rnd))
    aug = RandomCropFlip(2)
    start = task._train_slice(c).start
    changed = 0
    for step, (pos, (x, y)) in enumerate(zip(steps, got)):
        raw = task.pool.store.get(pos.numpy() + start)
        want = torch.stack([aug(img, sample_generator(seed, "augment", rnd, c, step, j)) for j, img in enumerate(raw)])
        torch.testing.assert_close(x, task.pool.standardize(want), rtol=0, atol=0)
        assert torch.equal(y, task.train_batch(c, pos)[1])
        changed += int((x != task.train_batch(c, pos)[0]).flatten(1).any(1).sum())
    assert changed > 0  # augmentation does change images (and train_batch reads them as they are)


@pytest.mark.parametrize("augment", ["none", pytest.param("crop_flip", marks=pytest.mark.slow)])  # FEDSIGHT_SLOW=1
def test_results_do_not_depend_on_the_number_of_workers(tmp_path, augment):
    write_tree(tmp_path / "tree")
    models = []
    for workers in (0, 1, 2):
        cfg = cfg_for(tmp_path / "tree", tmp_path / f"w{workers}", augment=augment, workers=workers)
        execute(cfg, tmp_path / f"run{workers}")
        models.append(load_file(str(tmp_path / f"run{workers}" / "model.safetensors")))
    for other in models[1:]:
        assert all(torch.equal(models[0][k], other[k]) for k in models[0])
