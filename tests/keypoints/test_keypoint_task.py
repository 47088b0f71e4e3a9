"""The keypoint task (crops, targets, decoding back to the image, metrics, resolution ladder) and RAF's component."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from fedsight.api import build_task, execute
from fedsight.config import validate
from fedsight.data.keypoints import MPII16, KeypointSet, KeypointSplits
from fedsight.data.partition import ClientSplit
from fedsight.functional.keypoints import transform_points
from fedsight.plugins import load_builtin
from fedsight.recipe.raf import RAF, RAFParams
from fedsight.tasks.keypoints import KeypointParams, KeypointTask, assign_rungs, joints_mse
from fedsight.training import ClientContext
from helpers import close

load_builtin()

LADDER = [[64, 48], [48, 36], [32, 24]]
MODEL = {"name": "vitpose", "patch": 4, "dim": 16, "depth": 1, "heads": 2, "deconv_filters": 8}


def raw_config(tmp_path, **over):
    raw = {
        "seed": 0,
        "run": {"name": "kp", "output_dir": str(tmp_path), "checkpoint_keep": 1, "plots": False},
        "task": {"name": "keypoints", "ladder": LADDER},
        "data": {"name": "builtin_pose", "num_train": 18, "num_test": 6, "image_size": [96, 72]},
        "partition": {"name": "iid", "num_clients": 3, "local_test_fraction": 0.0},
        "model": dict(MODEL),
        "train": {"steps": 2, "batch_size": 4, "lr": 0.001, "weight_decay": 0.01},
        "server": {"rounds": 2, "clients_per_round": 3},
        "recipe": {"components": [{"name": "raf"}, {"name": "fedprox", "mu": 0.01}, {"name": "local_adam"}]},
        "eval": {"every": 2},
    }
    raw.update(over)
    return raw


# -- the resolution ladder ---------------------------------------------------------------------------------


def test_rung_assignments():
    p = KeypointParams(ladder=LADDER)
    assert assign_rungs(p, 5, 0) == [0, 1, 2, 0, 1]
    assert assign_rungs(KeypointParams(ladder=LADDER, resolution="one_high"), 4, 0) == [0, 2, 2, 2]
    assert assign_rungs(KeypointParams(ladder=LADDER, resolution="blocks"), 6, 0) == [0, 0, 1, 1, 2, 2]
    assert assign_rungs(KeypointParams(ladder=LADDER, resolution="all_high"), 3, 0) == [0, 0, 0]
    rand = assign_rungs(KeypointParams(ladder=LADDER, resolution="random"), 50, 1)
    assert rand == assign_rungs(KeypointParams(ladder=LADDER, resolution="random"), 50, 1) and set(rand) == {0, 1, 2}
    assert assign_rungs(KeypointParams(ladder=LADDER, client_rungs=[2, 0]), 2, 0) == [2, 0]
    with pytest.raises(ValueError, match="client_rungs has 2 entries for 3 clients"):
        assign_rungs(KeypointParams(ladder=LADDER, client_rungs=[2, 0]), 3, 0)


@pytest.mark.parametrize("ladder, message", [
    ([[48, 36], [64, 48]], "decrease strictly"),
    ([[64, 48], [50, 36]], "multiples of heatmap_stride"),
    ([[64, 48, 3]], r"every size is \[H, W\]"),
])
def test_bad_ladders_are_config_errors(ladder, message):
    with pytest.raises(ValueError, match=message):
        KeypointParams(ladder=ladder)


def test_default_evaluation_sizes_add_two_unseen_larger_ones():
    assert KeypointParams().sizes() == [(256, 192), (192, 144), (128, 96), (320, 240), (384, 288)]


def test_a_size_the_model_cannot_take_is_named_at_build_time(tmp_path):
    cfg = validate(raw_config(tmp_path, model=dict(MODEL, patch=8)))
    with pytest.raises(ValueError, match="input size 48x36 is not a multiple of 8"):
        build_task(cfg)


# -- crops: joints follow the pixels ----------------------------------------------------------------------


def dot_set(n: int = 6, seed: int = 0) -> KeypointSet:
    """Images with one bright dot per instance at joint 0 (right ankle) and one at joint 5 (left ankle);
    the other joints unlabelled."""
    rng = np.random.default_rng(seed)
    images, joints = [], np.zeros((n, 16, 3), np.float32)
    for i in range(n):
        img = np.zeros((80, 60, 3), np.uint8)
        for j, channel in ((0, 0), (5, 1)):  # right ankle red, left ankle green
            x, y = rng.integers(22, 38), rng.integers(28, 52)
            img[y - 1:y + 2, x - 1:x + 2, channel] = 255
            joints[i, j] = (x, y, 2)
        images.append(img)
    n_ = np.arange(n)
    return KeypointSet(
        skeleton=MPII16, images=images, image=n_, image_id=n_, joints=joints,
        center=np.tile(np.float32([30, 40]), (n, 1)), size=np.tile(np.float32([40, 50]), (n, 1)),
        area=np.full(n, 1500, np.float32), bbox=np.tile(np.float32([10, 15, 40, 50]), (n, 1)),
        head_size=np.full(n, 10, np.float32), labels=np.zeros(n, np.int64), class_names=["dots"])


def dot_task(**params) -> KeypointTask:
    data = dot_set()
    client = ClientSplit(train=np.arange(len(data)), test=np.arange(0))
    model_params = None
    return KeypointTask(KeypointSplits(train=data, tests={"dots": data}), [client], "vitpose", model_params,
                        KeypointParams(ladder=LADDER, **params))


def brightest(img: torch.Tensor, channel: int) -> np.ndarray:
    """(x, y) centroid of the brightest pixels of one channel."""
    c = img[channel]
    ys, xs = torch.nonzero(c >= 0.5 * c.max(), as_tuple=True)
    w = c[ys, xs]
    return np.array([float((xs * w).sum() / w.sum()), float((ys * w).sum() / w.sum())])


def test_augmented_training_crops_keep_joints_on_their_pixels():
    """Random scale, rotation and flips: each dot lands where the transformed joint says, and a flipped crop
    carries the red (right) ankle's dot under the left-ankle channel."""
    task = dot_task(rotation_prob=1.0)
    torch.manual_seed(3)
    flipped = 0
    for _ in range(4):
        x, y = task.train_batch(0, torch.arange(6))
        for b in range(6):
            j0, j5 = y["joints"][b, 0].numpy(), y["joints"][b, 5].numpy()
            red, green = brightest(x[b], 0), brightest(x[b], 1)
            if np.linalg.norm(j0 - red) < 1.0:  # unflipped: joint 0 (right ankle) is the red dot
                assert np.linalg.norm(j5 - green) < 1.0
            else:  # flipped: the red dot is now the left ankle
                flipped += 1
                assert np.linalg.norm(j0 - green) < 1.0 and np.linalg.norm(j5 - red) < 1.0
    assert 0 < flipped < 4 * 6  # both cases happened


@pytest.mark.parametrize("capture", [None, (32, 24)])
def test_evaluation_inverse_maps_crop_joints_back_to_the_image(capture):
    task = dot_task()
    data = task.splits.tests["dots"]
    (x, y), = task.instance_batches(data, np.arange(6), (64, 48), 8, capture=capture, mode="bilinear")
    back = transform_points(y["joints"].double(), y["inverse"].double())
    labelled = y["gt"][..., 2] > 0
    assert torch.allclose(back[labelled].float(), y["gt"][..., :2][labelled], atol=1e-3)
    assert x.shape == (6, 3, 64, 48) and y["heatmaps"].shape == (6, 16, 16, 12)


def test_target_heatmaps_decoded_through_the_task_score_full_marks(tmp_path):
    """An oracle whose heatmaps are the targets: every metric at (or, for OKS at low resolution, near) its
    best, at every evaluation size, through decoding, the inverse affine and the merged metric states."""
    task = build_task(validate(raw_config(tmp_path, task={"name": "keypoints", "ladder": [[128, 96], [64, 48]],
                                                          "eval_sizes": [[128, 96]]}, model=dict(MODEL, patch=8))))
    state = task.metrics.new_state()
    for x, y in task.eval_batches("test", 4):
        task.update_metrics(state, y["heatmaps"], y)
    m = task.metrics.compute(state)
    assert m["pck"] == 100.0 and m["pckh"] > 97.0 and m["ap50"] == 100.0 and m["loss"] == 0.0
    # a useless predictor (all joints at the crop centre) scores far lower
    state = task.metrics.new_state()
    for x, y in task.eval_batches("test", 4):
        task.update_metrics(state, torch.ones_like(y["heatmaps"]) * 0.1, y)
    bad = task.metrics.compute(state)
    assert bad["pckh"] < 20 and bad["ap"] < 5


# -- RAF ------------------------------------------------------------------------------------------------------


class SizeModel(nn.Module):
    """Heatmaps ``scale * base[size]``: a separate scale for the native input and for the lower rungs."""

    def __init__(self, bases: dict[tuple[int, int], torch.Tensor], native: tuple[int, int]):
        super().__init__()
        self.bases, self.native = bases, native
        self.a = nn.Parameter(torch.tensor(1.0))  # native (teacher) branch
        self.b = nn.Parameter(torch.tensor(1.0))  # lower-rung (student) branch

    def forward(self, x):
        size = tuple(x.shape[-2:])
        return (self.a if size == self.native else self.b) * self.bases[size].expand(x.shape[0], -1, -1, -1)


def raf_context(task, model, client=0):
    return ClientContext(client_id=client, round=1, model=model, global_params={}, num_examples=6, task=task)


def test_kd_is_zero_when_the_student_is_the_downsampled_teacher_and_never_trains_the_teacher():
    task = dot_task(client_rungs=[1])  # native 48x36: one rung below, 32x24 (heatmaps 12x9 -> 8x6)
    assert task.rungs_below(0) == [(32, 24)]
    small = torch.rand(1, 16, 4, 3)
    student = small.repeat_interleave(2, -2).repeat_interleave(2, -1)  # 8x6, exactly nearest-upsampled to...
    teacher = student.repeat_interleave(3, -2).repeat_interleave(3, -1)[..., ::2, ::2]  # ...12x9 (nearest x1.5)
    assert torch.equal(torch.nn.functional.interpolate(student, size=(12, 9), mode="nearest"), teacher)
    model = SizeModel({(48, 36): teacher, (32, 24): student}, (48, 36))
    x = torch.rand(2, 3, 48, 36)
    ctx = raf_context(task, model)
    ctx.inputs = x
    targets = {"weight": torch.ones(2, 16), "joints": torch.rand(2, 16, 2) * 30}
    raf = RAF(RAFParams(upsample="nearest", kd_weights="all"))
    assert raf.loss_term(ctx, model(x), targets).item() == 0.0
    with torch.no_grad():
        model.b.fill_(1.5)
    term = raf.loss_term(ctx, model(x), targets)
    term.backward()
    assert float(term) > 0 and model.b.grad.abs() > 0
    assert model.a.grad is None or float(model.a.grad) == 0.0  # the teacher is behind a stop-gradient
    # alpha scales the term linearly (eq. 6); the authors' code ignores alpha
    doubled = RAF(RAFParams(upsample="nearest", kd_weights="all", alpha=2.0)).loss_term(ctx, model(x), targets)
    assert float(doubled) == pytest.approx(2 * float(term), rel=1e-6)
    code = [RAF(RAFParams(mode="code", alpha=a)).loss_term(ctx, model(x), targets) for a in (1.0, 5.0)]
    assert float(code[0]) == float(code[1]) > float(term)  # + the ground-truth loss of the lower rung


def test_the_lowest_rung_trains_plainly_and_the_cascade_sums_over_rungs():
    task = dot_task(client_rungs=[2])
    model = SizeModel({}, (32, 24))
    ctx = raf_context(task, model)
    ctx.inputs = torch.rand(2, 3, 32, 24)
    assert RAF().loss_term(ctx, torch.zeros(2, 16, 8, 6), {"weight": torch.ones(2, 16)}) is None
    # a top-rung client distils twice (48x36 from 64x48, 32x24 from 48x36): eq. 5 sums the two terms
    task = dot_task(client_rungs=[0])
    bases = {(64, 48): torch.rand(1, 16, 16, 12), (48, 36): torch.rand(1, 16, 12, 9), (32, 24): torch.rand(1, 16, 8, 6)}
    model = SizeModel(bases, (64, 48))
    ctx = raf_context(task, model)
    ctx.inputs = torch.rand(2, 3, 64, 48)
    w = {"weight": torch.ones(2, 16), "joints": torch.zeros(2, 16, 2)}
    up = lambda t, s: torch.nn.functional.interpolate(t, size=s, mode="bilinear", align_corners=False)  # noqa: E731
    expected = (joints_mse(up(bases[(48, 36)], (16, 12)), bases[(64, 48)], torch.ones(1, 16))
                + joints_mse(up(bases[(32, 24)], (12, 9)), bases[(48, 36)], torch.ones(1, 16)))
    got = RAF(RAFParams(kd_weights="all")).loss_term(ctx, model(ctx.inputs), w)
    assert float(got) == pytest.approx(float(expected), rel=1e-5)


def test_a_federated_raf_run_reports_every_resolution(tmp_path):
    cfg = validate(raw_config(tmp_path))
    out = execute(cfg, tmp_path / "run")
    assert out.status == "complete"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in rows if "event" not in r][-1]
    for split in ("test", "test_48x36", "test_32x24", "test_80x60", "test_96x72"):
        for m in ("pckh", "pck", "ap", "loss"):
            assert np.isfinite(final[f"{split}/{m}"]), f"{split}/{m}"
    part = json.loads((tmp_path / "run" / "partition.json").read_text())
    assert part["client_rungs"] == [0, 1, 2] and part["client_sizes"] == LADDER


# -- RAF in vectorised training ------------------------------------------------------------------------------------


def _raf_rounds(tmp_path, vectorize, model, raf):
    """Two rounds of five clients at three rungs (two at the top, two in the middle, one at the bottom), 1 to 3
    steps of a batch of 4 over 6-7 crops each (short batches), RAF + FedProx, SGD with momentum."""
    from fedsight.api import build_simulation

    raw = raw_config(tmp_path, model=model, engine={"vectorize": vectorize})
    raw["data"]["num_train"] = 32
    raw["partition"]["num_clients"] = 5
    raw["server"]["clients_per_round"] = 5
    raw["train"] = {"steps": None, "epochs": None, "steps_range": [1, 3], "batch_size": 4, "lr": 0.01,
                    "momentum": 0.9, "weight_decay": 0.01}
    # (not local_adam: the key projection's bias gets no gradient through the softmax but rounding, which Adam
    # scales up to steps of the rate, in either engine differently)
    raw["recipe"]["components"] = [{"name": "raf", **raf}] if raf is not None else []
    raw["recipe"]["components"].append({"name": "fedprox", "mu": 0.01})
    sim = build_simulation(validate(raw))
    assert sim.task.rungs == [0, 1, 2, 0, 1]
    rows = [sim.run_round(r)[0] for r in (1, 2)]
    return sim, rows


@pytest.mark.parametrize("model, raf", [
    (MODEL, {}),  # ViTPose: LayerNorm, attention, the paper's default RAF
    # SimpleBaseline: every rung's forward updates the BatchNorm statistics, in order
    ({"name": "simplebaseline", "depth": 18, "width": 4, "deconv_filters": 8}, {"mode": "code", "teacher": "native"}),
    (dict(MODEL, norm="group"), {"kd_weights": "all", "upsample": "nearest", "alpha": 0.5}),
    # stochastic depth (without RAF, which runs the model again: refused below): each client's masks from its stream
    (dict(MODEL, depth=3, drop_path=0.5), None),
], ids=["vitpose", "simplebaseline-code", "vitpose-groupnorm", "vitpose-drop-path-no-raf"])
def test_raf_trains_vectorised_as_sequentially(tmp_path, model, raf, monkeypatch):
    """RAF's extra forwards of the lower rungs (``VectorStep.forward_term``) under vmap: each client's weights,
    BatchNorm statistics (every rung's forward updates them, in order), objective and FLOPs as its sequential
    training leaves them, with short batches padded and masked."""
    import fedsight.training.vectorized as V

    calls = []
    monkeypatch.setattr(V, "_vmapped_step", lambda *a, _f=V._vmapped_step: calls.append(a[-2]) or _f(*a))
    seq, seq_rows = _raf_rounds(tmp_path / "s", False, model, raf)
    assert not calls
    vec, vec_rows = _raf_rounds(tmp_path / "v", True, model, raf)
    assert vec.runtime.vectorizes(5) and True in calls and False in calls  # padded steps and full ones
    a, b = seq.global_model.state_dict(), vec.global_model.state_dict()
    for k in a:
        if a[k].is_floating_point():
            close(b[k], a[k], atol=2e-6, rtol=1e-4)
        else:
            assert torch.equal(a[k], b[k]), k  # BatchNorm's batch counts: one a forward
    for ra, rb in zip(seq_rows, vec_rows):
        assert ra["train/loss"] == pytest.approx(rb["train/loss"], rel=1e-5)
        assert ra["cost/flops"] == rb["cost/flops"] > 0



def test_raf_with_a_model_drawing_dropout_noise_is_not_vectorised(tmp_path):
    """Vectorised training draws a client's dropout (stochastic depth) masks before the step for one forward; RAF's
    forwards of the lower rungs would draw more: ``true`` refuses the pair before the run, naming both."""
    from fedsight.api import build_simulation
    from fedsight.config import ConfigError

    raw = raw_config(tmp_path, model=dict(MODEL, depth=2, drop_path=0.2), engine={"vectorize": True})
    with pytest.raises(ConfigError, match="component 'raf' runs the model again .* dropout noise \\(DropPath\\)"):
        build_simulation(validate(raw))
    raw["recipe"]["components"] = [{"name": "local_adam"}]
    assert build_simulation(validate(raw)).runtime.vectorizes(3)
