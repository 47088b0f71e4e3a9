"""The segmentation task on small in-memory data: batches, evaluation order, losses with auxiliary outputs,
data description; and the street benchmark through a real config."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedsight.data.partition import ClientSplit
from fedsight.data.pipeline import ImageStore, TensorStore
from fedsight.data.segmentation import SegmentationData, SegmentationSet, TensorLabelStore
from fedsight.rng import np_rng
from fedsight.tasks.segmentation import SegmentationParams, SegmentationTask, pixel_loss

IGNORE = 255


class ListStore(ImageStore):
    """Images of different sizes, held as a list (what a folder of mixed-size files looks like)."""

    def __init__(self, images: list[torch.Tensor]):
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    @property
    def shape(self):
        return None

    def get(self, indices):
        return torch.stack([self.images[int(i)] for i in indices])

    def get_one(self, i: int) -> torch.Tensor:
        return self.images[int(i)]


class ListLabels(TensorLabelStore):
    def __init__(self, labels: list[torch.Tensor]):
        self.labels = labels


def make_set(sizes: list[tuple[int, int]], classes: int, seed: int, domains: list[int] | None = None) -> SegmentationSet:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8) for h, w in sizes]
    ys = [torch.randint(0, classes, (h, w), generator=g).to(torch.uint8) for h, w in sizes]
    for y in ys:
        y[0, 0] = IGNORE
    if len({s for s in sizes}) == 1:
        images, labels = TensorStore(torch.stack(xs)), TensorLabelStore(torch.stack(ys))
    else:
        images, labels = ListStore(xs), ListLabels(ys)
    return SegmentationSet(images, labels, np.asarray(domains if domains is not None else [0] * len(sizes)))


def make_task(train: SegmentationSet, clients: list[ClientSplit], tests: dict[str, SegmentationSet] | None = None,
              classes: int = 4, **params) -> SegmentationTask:
    data = SegmentationData(train, tests or {"test": train}, [f"c{i}" for i in range(classes)], ["d0", "d1", "d2"])
    return SegmentationTask(data, clients, "bisenetv2", None, SegmentationParams(**params), seed=3)


def split(*parts: list[int], test: list[list[int]] | None = None) -> list[ClientSplit]:
    return [ClientSplit(np.asarray(p, dtype=np.int64), np.asarray((test or [[]] * len(parts))[k], dtype=np.int64))
            for k, p in enumerate(parts)]


def test_eval_batches_group_images_by_size_in_order_within_the_pixel_budget() -> None:
    sizes = [(8, 10), (6, 6), (8, 10), (6, 6), (8, 10), (5, 7), (8, 10)]
    s = make_set(sizes, 4, 0)
    task = make_task(s, split([0, 1]), crop=(4, 4), eval_pixels=2 * 80)  # at most two 8x10 images a batch
    seen = []
    for x, y in task.eval_batches("test", batch_size=3):
        h, w = x.shape[-2:]
        assert y.shape == (len(x), h, w) and y.dtype == torch.int64
        assert len(x) <= 3 and len(x) * h * w <= max(160, h * w)
        for img, lab in zip(x, y):  # find the image it is, by its pixels
            raw = ((img * task.std[0].cpu() + task.mean[0].cpu()) * 255).round().to(torch.uint8)
            (idx,) = [i for i in range(len(sizes)) if sizes[i] == (h, w) and torch.equal(s.images.get_one(i), raw)]
            assert torch.equal(lab, s.labels.get_one(idx).long())
            seen.append(idx)
    # every image once; sizes in order of first appearance, split order within a size
    assert seen == [0, 2, 4, 6, 1, 3, 5]


def test_a_crop_is_needed_for_training_images_of_several_sizes() -> None:
    s = make_set([(8, 10), (6, 6)], 4, 0)
    with pytest.raises(ValueError, match=r"task.crop must be set: the training images have 2 sizes"):
        make_task(s, split([0, 1]))
    assert make_task(make_set([(8, 10)] * 2, 4, 0), split([0, 1])).crop == (8, 10)


def test_training_batches_follow_the_per_sample_streams_with_any_number_of_workers() -> None:
    from fedsight.data.seg_pipeline import augment_pair

    s = make_set([(12, 16)] * 6, 4, 1)
    clients = split([0, 2, 4], [1, 3, 5])
    batches = [torch.tensor([2, 0]), torch.tensor([1, 2])]
    runs = []
    for workers in (0, 2):
        task = make_task(s, clients, crop=(8, 8), scale=(0.7, 1.4), workers=workers)
        runs.append(list(task.train_batches(1, batches, seed=5, round=3)))
    for (x0, y0), (x1, y1) in zip(*runs):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
    # sample j of step s: pool image clients[1].train[pos] augmented from np_rng(seed, "augment", round, client, s, j)
    task = make_task(s, clients, crop=(8, 8), scale=(0.7, 1.4))
    img, lab = augment_pair(s.images.get_one(5), s.labels.get_one(5), (8, 8), (0.7, 1.4), True,
                            np_rng(5, "augment", 3, 1, 1, 1))
    x, y = runs[0][1]
    assert torch.equal(y[1], lab.long()) and torch.allclose(x[1], task.standardize(img[None])[0])
    # another round draws other crops
    other = list(task.train_batches(1, batches, seed=5, round=4))
    assert not all(torch.equal(a[1], b[1]) for a, b in zip(runs[0], other))


def test_a_batch_of_one_image_trains_with_its_mirror() -> None:
    s = make_set([(8, 8)] * 3, 4, 2)
    task = make_task(s, split([0, 1, 2]), flip=False)
    (x, y), = task.train_batches(0, [torch.tensor([1])])
    assert len(x) == 2 and torch.equal(x[1], x[0].flip(-1)) and torch.equal(y[1], y[0].flip(-1))
    assert torch.equal(y[0], s.labels.get_one(1).long())


def test_auxiliary_outputs_add_their_weighted_losses() -> None:
    torch.manual_seed(0)
    t = torch.randint(0, 4, (2, 8, 8))
    t[0, :3] = IGNORE
    main, a1, a2 = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 4, 4), torch.randn(2, 4, 8, 8)
    task = make_task(make_set([(8, 8)] * 2, 4, 0), split([0, 1]), aux_weight=0.4, ohem=0.5)
    want = pixel_loss(main, t, 0.5) + 0.4 * (pixel_loss(a1, t, 0.5) + pixel_loss(a2, t, 0.5))
    assert task.loss((main, a1, a2), t).item() == pytest.approx(want.item(), rel=1e-6)
    assert task.loss(main, t).item() == pytest.approx(pixel_loss(main, t, 0.5).item(), rel=1e-6)


def test_metrics_use_the_main_output_upsampled_to_the_labels() -> None:
    torch.manual_seed(1)
    task = make_task(make_set([(8, 8)] * 2, 4, 0), split([0, 1]), per_image_miou=True)
    t = torch.randint(0, 4, (2, 8, 8))
    low, aux = torch.randn(2, 4, 4, 4), torch.randn(2, 4, 8, 8)
    state = task.metrics.new_state()
    task.update_metrics(state, (low, aux), t)
    up = F.interpolate(low, size=(8, 8), mode="bilinear", align_corners=False)
    ref = task.metrics.new_state()
    task.update_metrics(ref, up, t)
    assert task.metrics.compute(state) == task.metrics.compute(ref)
    assert task.metrics.compute(state)["loss"] == pytest.approx(F.cross_entropy(up, t).item(), rel=1e-6)


def test_data_description_counts_domains_and_class_pixels_per_client() -> None:
    s = make_set([(6, 6)] * 5, 3, 4, domains=[0, 1, 1, 2, 0])
    task = make_task(s, split([0, 1, 4], [2, 3]), classes=3)
    desc = task.data_description()
    assert desc["client_label_counts"] == [[2, 1, 0], [0, 1, 1]]
    for k, members in enumerate(([0, 1, 4], [2, 3])):
        labels = np.concatenate([s.labels.get_one(i).numpy().ravel() for i in members])
        assert desc["client_class_pixels"][k] == np.bincount(labels[labels != IGNORE], minlength=3).tolist()
    assert desc["pixel_class_names"] == ["c0", "c1", "c2"] and desc["partition_key"] == "domain"


def test_domain_groups_and_sub_splits() -> None:
    train = make_set([(6, 6)] * 4, 3, 5, domains=[0, 1, 0, 1])
    test = make_set([(6, 6)] * 5, 3, 6, domains=[2, 0, 2, 2, 0])
    task = make_task(train, split([0, 2], [1, 3]), tests={"test": test, "unseen": test.subset([0, 2])}, classes=3)
    assert task.test_splits == ("test", "test_unseen")
    groups = task.domain_groups("test")
    assert [(d, m.tolist()) for d, m in groups] == [(0, [1, 4]), (2, [0, 2, 3])]
    # a subset of a split evaluates exactly those images
    (x, y), = task.eval_batches("test", subset=groups[1][1])
    assert [torch.equal(y[i], test.labels.get_one(j).long()) for i, j in enumerate([0, 2, 3])] == [True] * 3
    assert task.client_domain_counts().tolist() == [[2, 0, 0], [0, 2, 0]]
    with pytest.raises(ValueError, match="no evaluation split 'test_rainy'"):
        task._split("test_rainy")


class NoLabels(TensorLabelStore):
    """A label store that fails when read: proves a code path never touches the labels."""

    def get_one(self, i: int) -> torch.Tensor:
        raise AssertionError("a label map was read")


def test_unlabelled_clients_never_read_a_label_for_training() -> None:
    s = make_set([(10, 12)] * 4, 3, 7)
    hidden = SegmentationSet(s.images, NoLabels(s.labels.labels), s.domains)
    task = make_task(hidden, split([0, 1], [2, 3]), classes=3, labels="eval_only", crop=(8, 8), workers=2)
    for x, y in task.train_batches(0, [torch.tensor([0, 1]), torch.tensor([1])], seed=1, round=2):
        assert (y == IGNORE).all() and x.shape[-2:] == (8, 8)
    with pytest.raises(AssertionError, match="a label map was read"):  # evaluation does use them
        next(task.eval_batches("test"))


def test_unlabelled_clients_do_not_train_without_a_self_supervised_term() -> None:
    """The task loss on IGNORE-only batches is 0, so plain FedAvg moves no parameter: nothing of the labels
    leaks into training."""
    from fedsight.api import build_simulation
    from fedsight.config import validate

    raw = {"seed": 0, "task": {"name": "segmentation", "crop": [24, 40], "labels": "eval_only"},
           "data": {"name": "street", "towns": ["suburb"], "conditions": ["clear-day", "rain-day"], "cameras": ["car"],
                    "per_domain": 4, "height": 32, "width": 48, "setting": "none"},
           "partition": {"name": "iid", "num_clients": 2, "local_test_fraction": 0.0},
           "model": {"name": "bisenetv2", "width": 0.25, "head_channels": 16, "aux_channels": 8},
           "train": {"epochs": 1, "batch_size": 2, "lr": 0.5}, "server": {"rounds": 1, "clients_per_round": 2},
           "eval": {"local": False}, "engine": {"threads": 1}}
    sim = build_simulation(validate(raw))
    before = {k: v.clone() for k, v in sim.global_model.named_parameters()}
    sim.run()
    assert all(torch.equal(before[k], v) for k, v in sim.global_model.named_parameters())


def test_client_style_is_the_mean_low_frequency_amplitude_window_of_its_images() -> None:
    s = make_set([(12, 20)] * 5, 3, 8)
    task = make_task(s, split([0, 2, 3], [1, 4]), classes=3, crop=(10, 16))
    windows = []
    for i in (0, 2, 3):
        img = F.interpolate(s.images.get_one(i)[None].float(), size=(10, 16), mode="bilinear", align_corners=False)[0]
        amp = torch.fft.fftshift(torch.fft.fft2(img), dim=(-2, -1)).abs()
        windows.append(amp[:, 4:7, 7:10])  # 3 x 3 around DC (5, 8)
    assert torch.allclose(task.client_style(0, half=1), torch.stack(windows).mean(0), rtol=1e-5)
    assert task.image_styles("test", half=2).shape == (5, 3, 5, 5)
