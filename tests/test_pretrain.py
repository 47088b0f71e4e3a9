"""The server's pre-training split and pre-trained feature extractor (``[pretrain]``, fedsight.pretrain).

Splits are checked on a synthetic .npz whose images carry their own pool index in two pixels, so which
example went where is read back from the data itself; class sizes are counted by hand; pre-training is
checked against a plain torch.optim.SGD loop written here from the documented procedure."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tomli_w
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from fedsight.api import build_simulation, build_task
from fedsight.cli import app
from fedsight.config import ConfigError, validate
from fedsight.models.base import load_weights, save_weights
from fedsight.pretrain import load_backbone, pretrain, pretrain_weights_path, sidecar_path
from fedsight.rng import derive_seed, torch_gen

from helpers import tiny

#: examples per class of the synthetic training pool; 0.25 * 26 = 6.5 and 0.25 * 34 = 8.5 test round-half-up
COUNTS = [20, 26, 34, 41, 48]


def tagged_npz(path, counts=COUNTS, n_test=30, seed=0):
    """An .npz whose training image i holds i in pixels (0, 0) and (0, 1) (low and high byte)."""
    rng = np.random.default_rng(seed)
    y = rng.permutation(np.repeat(np.arange(len(counts)), counts))
    n = len(y)
    x = rng.integers(0, 256, size=(n, 8, 8), dtype=np.uint8)
    x[:, 0, 0] = np.arange(n) % 256
    x[:, 0, 1] = np.arange(n) // 256
    xt = rng.integers(0, 256, size=(n_test, 8, 8), dtype=np.uint8)
    yt = np.arange(n_test) % len(counts)
    np.savez(path, train_images=x, train_labels=y, test_images=xt, test_labels=yt)
    return y


def tagged_cfg(path, **over):
    raw = tiny(**{"data": {"name": "npz", "path": str(path)},
                  "partition": {"name": "iid", "num_clients": 4, "local_test_fraction": 0.2},
                  "pretrain.source": "samples", "pretrain.epochs": 1, **over})
    return validate(raw)


def tags(task, x):
    """Pool indices read back from standardised images."""
    raw = (x[:, 0, 0, :2] * task.std[0, 0, 0, 0] + task.mean[0, 0, 0, 0]) * 255
    idx = torch.round(raw).long()
    return (idx[:, 0] + 256 * idx[:, 1]).numpy()


# -- the server's split ------------------------------------------------------------------------------


def test_split_is_disjoint_from_every_client_and_from_validation(tmp_path):
    y = tagged_npz(tmp_path / "d.npz")
    cfg = tagged_cfg(tmp_path / "d.npz", **{"validation.source": "carve", "validation.fraction": 0.1})
    task = build_task(cfg)
    pre = tags(task, task.pretrain_x)
    val = tags(task, task.val_x)
    clients = [tags(task, task.pool_x[sl]) for c in range(task.num_clients)
               for sl in (task._train_slice(c), task._test_slice(c))]
    held = np.concatenate(clients)
    assert len(set(pre)) == len(pre) and len(set(held)) == len(held)
    assert not set(pre) & set(held) and not set(pre) & set(val) and not set(val) & set(held)
    assert sorted(np.concatenate([pre, val, held])) == list(range(len(y)))  # nothing lost, nothing invented
    np.testing.assert_array_equal(task.pretrain_y.numpy(), y[pre])  # labels travel with their images
    # the split is drawn out of what V left; about a 0.3 share of each class
    after_val = np.bincount(y[np.concatenate([pre, held])], minlength=5)
    np.testing.assert_array_equal(np.bincount(y[pre], minlength=5), np.floor(0.3 * after_val + 0.5))
    desc = task.data_description()["pretrain"]
    assert desc["size"] == len(pre) and desc["class_counts"] == np.bincount(y[pre], minlength=5).tolist()


def test_stratified_sizes_by_hand_and_classes_restrict(tmp_path):
    tagged_npz(tmp_path / "d.npz")
    task = build_task(tagged_cfg(tmp_path / "d.npz", **{"pretrain.fraction": 0.25}))
    # round(0.25 * [20, 26, 34, 41, 48]) with halves up: 5, 6.5 -> 7, 8.5 -> 9, 10.25 -> 10, 12
    assert task.pretrain_class_counts() == [5, 7, 9, 10, 12]
    assert np.bincount(task.pool_y.numpy()).tolist() == [20 - 5, 26 - 7, 34 - 9, 41 - 10, 48 - 12]  # all clients
    task = build_task(tagged_cfg(tmp_path / "d.npz", **{"pretrain.fraction": 0.25, "pretrain.classes": [3, 1]}))
    assert task.pretrain_class_counts() == [0, 7, 0, 10, 0]
    assert np.bincount(task.pool_y.numpy()).tolist() == [20, 19, 34, 31, 48]
    # the draw is a function of the seed
    a = tags(task, task.pretrain_x)
    b = build_task(tagged_cfg(tmp_path / "d.npz", **{"pretrain.fraction": 0.25, "pretrain.classes": [1, 3]}))
    c = build_task(tagged_cfg(tmp_path / "d.npz", **{"pretrain.fraction": 0.25, "pretrain.classes": [1, 3], "seed": 1}))
    assert sorted(a) == sorted(tags(b, b.pretrain_x)) and sorted(a) != sorted(tags(c, c.pretrain_x))


def test_bad_pretrain_settings_are_clear_errors(tmp_path):
    tagged_npz(tmp_path / "d.npz")
    with pytest.raises(ConfigError, match=r"pretrain\.classes.*out of range.*5 classes"):
        build_task(tagged_cfg(tmp_path / "d.npz", **{"pretrain.classes": [1, 5]}))
    with pytest.raises(ValueError, match=r"pretrain\.fraction.*all 20 pool example\(s\) of class 0"):
        build_task(tagged_cfg(tmp_path / "d.npz", **{"pretrain.fraction": 0.99}))
    for key, value in (("pretrain.fraction", 1.0), ("pretrain.classes", []), ("pretrain.classes", [2, 2]),
                       ("pretrain.source", "imagenet"), ("pretrain.epochs", 0)):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            tagged_cfg(tmp_path / "d.npz", **{key: value})


# -- pre-training --------------------------------------------------------------------------------------


def test_pretraining_matches_plain_sgd_and_is_bit_identical(tmp_path):
    cfg = validate(tiny(**{"pretrain.source": "samples", "pretrain.epochs": 2, "pretrain.batch_size": 50}))
    task = build_task(cfg)
    r1 = pretrain(cfg, task, out=tmp_path / "a.safetensors")
    r2 = pretrain(cfg, build_task(cfg), out=tmp_path / "b.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    # reference: the documented procedure as a plain loop (init stream, per-epoch shuffle, SGD)
    torch.manual_seed(derive_seed(cfg.seed, "pretrain-init"))
    ref = task.build_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    x, y = task.pretrain_x, task.pretrain_y
    n = len(y)
    assert n == 434  # round(0.3 * n_c) of the 1,437 digits training images
    # one pass covers every example once; a single-example tail joins the batch before it
    for bs, sizes in ((50, [50] * 8 + [34]), (433, [434]), (217, [217, 217])):
        got = list(task.pretrain_batches(bs, torch.Generator().manual_seed(1)))
        assert [len(yb) for _, yb in got] == sizes
        assert sorted(torch.cat([yb for _, yb in got]).tolist()) == sorted(y.tolist())
    losses = []
    for epoch in range(2):
        perm = torch.randperm(n, generator=torch_gen(cfg.seed, "pretrain-shuffle", epoch))
        total = 0.0
        for s in range(0, n, 50):  # 434 = 8 * 50 + 34: no single-example tail
            idx = perm[s : s + 50]
            loss = F.cross_entropy(ref(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        losses.append(total / n)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "a.safetensors"))
    assert set(saved) == set(ref.parameter_groups()["backbone"])  # phi only, no head
    assert not any(k.startswith("head.") for k in saved)
    for k, v in saved.items():
        torch.testing.assert_close(v, ref.state_dict()[k], rtol=1e-5, atol=1e-6)
    meta = json.loads(sidecar_path(tmp_path / "a.safetensors").read_text())
    np.testing.assert_allclose(meta["train_loss"], losses, rtol=1e-5)
    ref.eval()
    with torch.no_grad():
        acc = float((ref(task.test_x).argmax(1) == task.test_y).double().mean())
    assert meta["test"]["acc"] == pytest.approx(acc, abs=1e-6) and r1.test["acc"] == pytest.approx(acc, abs=1e-6)
    assert meta["num_examples"] == 434 and meta["pretrain"]["epochs"] == 2 and r2.train_loss == r1.train_loss


def test_run_loads_the_backbone_keeps_the_seeded_head_and_reuses_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = validate(tiny(**{"pretrain.source": "samples", "pretrain.epochs": 1}))
    sim = build_simulation(cfg)
    path = pretrain_weights_path(cfg)
    assert path.parent == tmp_path.joinpath("runs", "pretrained").relative_to(tmp_path) and path.is_file()
    from safetensors.torch import load_file

    saved = load_file(str(path))
    state = sim.global_model.state_dict()
    assert set(saved) == set(sim.global_model.parameter_groups()["backbone"])
    for k, v in saved.items():
        assert torch.equal(state[k], v), k
    plain = build_simulation(validate(tiny())).global_model.state_dict()  # the same seed without [pretrain]
    for k in sim.global_model.parameter_groups()["head"]:
        assert torch.equal(state[k], plain[k]), k
    assert not torch.equal(state["backbone.0.weight"], plain["backbone.0.weight"])
    # the same setup (other training/recipe settings) shares the file and does not pre-train again
    other = validate(tiny(**{"pretrain.source": "samples", "pretrain.epochs": 1, "train.lr": 0.3, "server.rounds": 2}))
    assert pretrain_weights_path(other) == path
    assert pretrain_weights_path(validate(tiny(**{"pretrain.source": "samples", "pretrain.epochs": 1, "seed": 1}))) != path
    assert pretrain_weights_path(validate(tiny(**{"pretrain.source": "samples", "pretrain.epochs": 2}))) != path

    def refuse(*a, **k):
        raise AssertionError("pre-trained again")

    monkeypatch.setattr("fedsight.pretrain.pretrain", refuse)
    again = build_simulation(other)
    assert torch.equal(again.global_model.state_dict()["backbone.0.weight"], saved["backbone.0.weight"])
    # init.weights wins over the pre-trained extractor
    save_weights(plain_model := build_simulation(validate(tiny(**{"seed": 5}))).global_model, tmp_path / "init.safetensors")
    won = build_simulation(validate(tiny(**{"pretrain.source": "samples", "init.weights": "init.safetensors"})))
    for k, v in plain_model.state_dict().items():
        assert torch.equal(won.global_model.state_dict()[k], v), k


def test_corrupt_or_mismatched_weights_name_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(ValueError, match="junk.safetensors.*not a readable"):
        build_simulation(validate(tiny(**{"pretrain.source": "samples", "pretrain.weights": "junk.safetensors"})))
    # an extractor of another architecture: wrong shapes
    wide = validate(tiny(**{"pretrain.source": "samples", "pretrain.epochs": 1, "model.channels": [4],
                            "pretrain.weights": "wide.safetensors"}))
    pretrain(wide, build_task(wide))
    with pytest.raises(ValueError, match=r"wide\.safetensors.*shapes"):
        build_simulation(validate(tiny(**{"pretrain.source": "samples", "pretrain.weights": "wide.safetensors"})))
    # a file with only the head: backbone entries missing
    model = build_simulation(validate(tiny())).global_model
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k.startswith("head.")}, "head.safetensors")
    with pytest.raises(ValueError, match=r"head\.safetensors.*missing backbone entries"):
        load_backbone(model, "head.safetensors")
    # load_weights(strict=False) refuses a file that matches none of the model's keys
    save_file({"encoder.weight": torch.zeros(3)}, "other.safetensors")
    with pytest.raises(ValueError, match=r"other\.safetensors.*none of its 1 entries"):
        load_weights(model, "other.safetensors", strict=False)
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        load_backbone(model, "nope.safetensors")


def test_pretrained_features_beat_random_features_for_nearest_class_mean(tmp_path):
    """Nearest-class-mean on the clients' training data, scored on the global test set: the extractor
    trained on the server's split must give better features than the seeded random one."""
    cfg = validate(tiny(**{"pretrain.source": "samples", "pretrain.epochs": 10}))
    task = build_task(cfg)
    res = pretrain(cfg, task, out=tmp_path / "p.safetensors")
    torch.manual_seed(derive_seed(cfg.seed, "init"))
    model = task.build_model().eval()

    def ncm() -> float:
        with torch.no_grad():
            f, yy = model.features(task.pool_x), task.pool_y
            means = torch.stack([f[yy == c].mean(0) for c in range(task.num_classes)])
            pred = torch.cdist(model.features(task.test_x), means).argmin(1)
        return float((pred == task.test_y).double().mean())

    random_acc = ncm()
    load_backbone(model, res.path)
    assert ncm() > random_acc + 0.05
    assert res.test["acc"] > 0.3  # its own head, 10 classes


# -- command line ------------------------------------------------------------------------------------------


def test_cli_pretrain_then_run_uses_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    raw = tiny(**{"pretrain.source": "samples", "pretrain.epochs": 1, "server.rounds": 1})
    raw["sweep"] = {"seeds": [0, 1]}
    (tmp_path / "c.toml").write_text(tomli_w.dumps(raw))
    res = runner.invoke(app, ["pretrain", "c.toml"])
    assert res.exit_code == 0, res.output
    files = sorted((tmp_path / "runs" / "pretrained").glob("*.safetensors"))
    assert len(files) == 2 and res.output.count("test acc") == 2  # one extractor per seed
    meta = json.loads(sidecar_path(files[0]).read_text())
    assert f"{meta['test']['acc']:.4f}" in res.output
    stamps = [f.stat().st_mtime_ns for f in files]
    again = runner.invoke(app, ["pretrain", "c.toml"])
    assert again.exit_code == 0 and again.output.count("already pre-trained") == 2
    res = runner.invoke(app, ["run", "c.toml", "--set", "sweep.seeds=[0]"])
    assert res.exit_code == 0, res.output
    assert [f.stat().st_mtime_ns for f in files] == stamps  # loaded, not re-trained
    part = json.loads((tmp_path / "runs/tiny/seed0/partition.json").read_text())
    assert part["pretrain"]["size"] == 434
    res = runner.invoke(app, ["pretrain", "c.toml", "--out", "one.safetensors"])
    assert res.exit_code == 2 and "--out" in res.output
    res = runner.invoke(app, ["pretrain", "c.toml", "--set", "sweep.seeds=[3]", "--out", "one.safetensors"])
    assert res.exit_code == 0 and (tmp_path / "one.safetensors").is_file()
    assert "pretrain.weights=one.safetensors" in res.output.replace("\n", "")
    res = runner.invoke(app, ["pretrain", "c.toml", "--set", "pretrain.source=none"])
    assert res.exit_code == 2 and "pretrain.source" in res.output
    res = runner.invoke(app, ["pretrain", "--help"])
    assert res.exit_code == 0 and "--out" in res.output and "server" in res.output
