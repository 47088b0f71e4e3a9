"""Segmentation metrics and losses against independent references: scikit-learn's confusion matrix and
Jaccard index, PyTorch's cross-entropy, and a plain NumPy top-k for hard-negative mining."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import accuracy_score, confusion_matrix, jaccard_score

from fedsight.tasks.segmentation import pixel_loss, segmentation_metrics

IGNORE = 255
SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def maps(draw, max_classes: int = 6):
    """(predictions, targets, num_classes): [B, H, W] maps with some ignored target pixels."""
    c = draw(st.integers(2, max_classes))
    b, h, w = draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    t = rng.integers(0, c, (b, h, w))
    t[rng.random((b, h, w)) < draw(st.floats(0, 0.5))] = IGNORE
    p = rng.integers(0, c, (b, h, w))
    return torch.from_numpy(p), torch.from_numpy(t), c


def names(c: int) -> list[str]:
    return [f"class {i}" for i in range(c)]


def state_of(metrics, batches):
    """A metric state over (preds, targets) batches, fed through the confusion matrix and the per-image
    metric (the segmentation task's update path without a model)."""
    state = metrics.new_state()
    by_name = {m.name: m for m in metrics.metrics}
    for p, t in batches:
        by_name["cm"].update(state, p, t)
        if "miou_img" in by_name:
            by_name["miou_img"].update_images(state, p, t)
    return state


@SETTINGS
@given(case=maps())
def test_miou_pixel_accuracy_and_class_iou_equal_scikit_learn(case) -> None:
    p, t, c = case
    valid = t != IGNORE
    if not valid.any():
        return
    yt, yp = t[valid].numpy(), p[valid].numpy()
    metrics = segmentation_metrics(names(c), per_image=False)
    out = metrics.compute(state_of(metrics, [(p, t)]))
    present = sorted(set(yt.tolist()) | set(yp.tolist()))
    ref = jaccard_score(yt, yp, labels=present, average=None)
    assert out["miou"] == pytest.approx(float(np.mean(ref)), abs=1e-12)
    assert out["pixel_acc"] == pytest.approx(accuracy_score(yt, yp), abs=1e-12)
    for k, iou in zip(present, ref):
        assert out[f"iou/class_{k}"] == pytest.approx(float(iou), abs=1e-12)
    # a class in neither targets nor predictions has no IoU (eq. 5.9's 0/0), hence no entry
    assert {k for k in out if k.startswith("iou/")} == {f"iou/class_{k}" for k in present}
    # the confusion-matrix identity: IoU_c = TP / (TP + FP + FN) from scikit-learn's matrix
    cm = confusion_matrix(yt, yp, labels=list(range(c)))
    tp = np.diag(cm)
    union = cm.sum(0) + cm.sum(1) - tp
    assert out["miou"] == pytest.approx(float(np.mean(tp[union > 0] / union[union > 0])), abs=1e-12)


@SETTINGS
@given(case=maps(), cuts=st.lists(st.integers(0, 3), min_size=1, max_size=4))
def test_merged_client_states_equal_the_pooled_one(case, cuts) -> None:
    """Images dealt to clients, one state per client, merged: the same mIoU as one state over all images
    (the sum of confusion matrices), never the mean of per-client mIoUs."""
    p, t, c = case
    metrics = segmentation_metrics(names(c), per_image=True)
    bounds = sorted({0, len(p), *[min(k, len(p)) for k in cuts]})
    clients = [state_of(metrics, [(p[a:b], t[a:b])]) for a, b in zip(bounds, bounds[1:]) if b > a]
    pooled = metrics.compute(state_of(metrics, [(p, t)]))
    merged = metrics.compute(metrics.merge(clients))
    assert merged.keys() == pooled.keys()
    for k in pooled:
        assert merged[k] == pytest.approx(pooled[k], abs=1e-12), k
    # merging goes through the plain tensors too (the Flower wire)
    again = metrics.compute(metrics.merge([metrics.state_from(s.tensors()) for s in clients]))
    assert again == merged


def test_pooled_miou_differs_from_the_mean_of_client_mious() -> None:
    # client 0: a perfect image of class 0; client 1: all of class 1 predicted as 0
    t = torch.tensor([[[0, 0]], [[1, 1]]])
    p = torch.tensor([[[0, 0]], [[0, 0]]])
    metrics = segmentation_metrics(names(2), per_image=False)
    a, b = state_of(metrics, [(p[:1], t[:1])]), state_of(metrics, [(p[1:], t[1:])])
    per_client = [metrics.compute(a)["miou"], metrics.compute(b)["miou"]]  # 1.0 and 0.0
    pooled = metrics.compute(metrics.merge([a, b]))["miou"]  # IoU_0 = 2/4, IoU_1 = 0
    assert per_client == [1.0, 0.0] and pooled == pytest.approx(0.25)


@SETTINGS
@given(case=maps())
def test_per_image_miou_is_the_mean_of_scikit_learn_image_scores(case) -> None:
    """Thesis eq. 5.10: mean over images of eq. 5.9, each over the classes in that image's target or
    prediction; images with no labelled pixel are left out."""
    p, t, c = case
    metrics = segmentation_metrics(names(c), per_image=True)
    out = metrics.compute(state_of(metrics, [(p, t)]))
    scores = []
    for pi, ti in zip(p, t):
        keep = ti != IGNORE
        if not keep.any():
            continue
        yt, yp = ti[keep].numpy(), pi[keep].numpy()
        present = sorted(set(yt.tolist()) | set(yp.tolist()))
        scores.append(float(np.mean(jaccard_score(yt, yp, labels=present, average=None))))
    if scores:
        assert out["miou_img"] == pytest.approx(float(np.mean(scores)), abs=1e-12)
    else:
        assert "miou_img" not in out


# ------------------------------------------------------------------------------------------------ loss


@st.composite
def logits_targets(draw):
    c = draw(st.integers(2, 5))
    b, h, w = draw(st.integers(1, 3)), draw(st.integers(2, 7)), draw(st.integers(2, 7))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    logits = torch.from_numpy(rng.normal(size=(b, c, h, w)) * 3).float()
    t = rng.integers(0, c, (b, h, w))
    t[rng.random((b, h, w)) < draw(st.floats(0, 0.9))] = IGNORE
    return logits, torch.from_numpy(t)


@SETTINGS
@given(case=logits_targets())
def test_pixel_loss_is_the_mean_cross_entropy_over_labelled_pixels(case) -> None:
    logits, t = case
    got = pixel_loss(logits, t)
    if (t != IGNORE).any():
        assert got.item() == pytest.approx(F.cross_entropy(logits, t, ignore_index=IGNORE).item(), rel=1e-5)
    else:
        assert got.item() == 0.0


@SETTINGS
@given(case=logits_targets(), frac=st.sampled_from([0.1, 0.25, 0.5, 1.0]))
def test_ohem_averages_the_hardest_labelled_pixels_of_every_image(case, frac: float) -> None:
    logits, t = case
    got = pixel_loss(logits, t, ohem=frac)
    ce = F.cross_entropy(logits, t, ignore_index=IGNORE, reduction="none").numpy()
    k = max(1, math.floor(frac * t.shape[1] * t.shape[2]))
    chosen = []
    for i in range(len(t)):
        valid = ce[i][t[i].numpy() != IGNORE]
        chosen += sorted(valid.tolist(), reverse=True)[:k]
    want = float(np.mean(chosen)) if chosen else 0.0
    assert got.item() == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_ohem_with_every_pixel_ignored_still_has_a_gradient_path() -> None:
    logits = torch.randn(2, 3, 4, 4, requires_grad=True)
    loss = pixel_loss(logits, torch.full((2, 4, 4), IGNORE), ohem=0.25)
    loss.backward()
    assert loss.item() == 0.0 and logits.grad is not None and not logits.grad.any()


def test_low_resolution_logits_are_upsampled_bilinearly_before_the_loss() -> None:
    torch.manual_seed(0)
    logits, t = torch.randn(2, 4, 5, 6), torch.randint(0, 4, (2, 10, 12))
    up = F.interpolate(logits, size=(10, 12), mode="bilinear", align_corners=False)
    assert pixel_loss(logits, t).item() == pytest.approx(F.cross_entropy(up, t).item(), rel=1e-6)
