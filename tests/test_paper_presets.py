"""The paper presets (``examples/paper/*.toml``, docs/paper_presets.md): one config per headline table of each seed
paper at the paper's scale, for a GPU.

CI checks, per preset: the config validates with every variant and grid point; it names the published weights it
expects (a path under ``weights/``, absent in CI, so loading is skipped: the run's ``[init]`` is removed) or says
in its header why it loads none; its header quotes the paper's numbers; docs/paper_presets.md has its row; its data
build from a tiny on-disk fixture of the real layout (``tests/paper_fixtures.py``); its model builds at the
preset's size (on the meta device; the parameter count checked against the published one where there is one),
and the task's model takes one training batch of the fixture to a finite loss. Under the suite's slow flag
(``FEDSIGHT_SLOW=1``) each preset's first variant runs ``--smoke`` on the fixture.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import fedsight
from fedsight.api import build_task
from fedsight.config import read_toml
from fedsight.models import build_model
from fedsight.sweep import expand

from paper_fixtures import overrides

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted((ROOT / "examples" / "paper").glob("*.toml"))
DOC = ROOT / "docs" / "paper_presets.md"

#: published parameter counts of the presets' models at 1000 classes and the classifier's input width, so the count
#: at the preset's number of classes is count - (width + 1) * (1000 - classes): torchvision's model tables
PUBLISHED = {"resnet18_imagenet": (11_689_512, 512), "mobilenetv2": (3_504_872, 1280)}

#: what each preset's model is told about its inputs and outputs on the paper's data (``ModelIO`` fields: the
#: fixture has fewer classes)
IO = {"fedvg_cifar10": {"num_outputs": 10}, "fed3r_cifar100": {"num_outputs": 100},
      "fed3r_gl": {"num_outputs": 2028}, "fed3r_inat": {"num_outputs": 1203},
      "fed3r_inat_rgb_shift": {"num_outputs": 1203}, "fed3r_cifar100_imbalance": {"num_outputs": 100},
      "personalized_gl": {"num_outputs": 2028}, "raf_table2": {"num_outputs": 16},
      "feddrive_cityscapes": {"num_outputs": 19}, "ladd_cityscapes": {"num_outputs": 19},
      "feddrive_idda": {"num_outputs": 16},
      "fedvsr_table1_reds": {"num_outputs": 3, "scale": 4, "num_frames": 30},
      "fedvsr_table1_kinetics": {"num_outputs": 3, "scale": 4, "num_frames": 30},
      "fedvsr_table2_reds": {"num_outputs": 3, "scale": 4, "num_frames": 30},
      "fedvsr_table2_kinetics": {"num_outputs": 3, "scale": 4, "num_frames": 30},
      "ppfl_rdsn_tables": {"num_outputs": 3, "scale": 2}}

#: parameter counts the papers print for their models (rounded as printed: FedVSR's Table 1, 10.8M)
PAPER_COUNTS = {"rvrt": (10.75e6, 10.85e6)}


def _raw(preset: Path) -> dict:
    return read_toml(preset)


def _ids(paths):
    return [p.stem for p in paths]


def test_there_is_a_preset_per_headline_table():
    assert {p.stem for p in PRESETS} == {
        "fedvsr_table1_reds", "fedvsr_table1_kinetics", "fedvsr_table2_reds", "fedvsr_table2_kinetics",
        "ppfl_rdsn_tables", "raf_table2", "fedvg_cifar10", "fed3r_cifar100", "fed3r_cifar100_imbalance", "fed3r_gl",
        "fed3r_inat", "fed3r_inat_rgb_shift", "personalized_gl", "feddrive_cityscapes", "feddrive_idda",
        "ladd_cityscapes"}


@pytest.mark.parametrize("preset", PRESETS, ids=_ids(PRESETS))
def test_preset_validates_with_every_variant(preset):
    raw = _raw(preset)
    specs = expand(raw, preset.name)
    grid = raw.get("sweep", {}).get("grid", {})
    points = math.prod(len(v) for v in grid.values()) if grid else 1
    seeds = len(raw.get("sweep", {}).get("seeds", [0]))
    assert len(specs) == len(raw.get("variants", [None])) * points * seeds
    assert all(s.run_dir.parts[:2] == ("runs", "paper") for s in specs)
    assert {s.config.model.name for s in specs} == {raw["model"]["name"]}


@pytest.mark.parametrize("preset", PRESETS, ids=_ids(PRESETS))
def test_preset_names_its_weights_and_the_papers_numbers(preset):
    text = preset.read_text()
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    assert "\n# Weights:" in header, f"{preset.name}: say which weights it expects (or why none)"
    numbers = re.split(r"^# (?:Paper|Thesis) \(", header, flags=re.M)
    assert len(numbers) == 2, f"{preset.name}: quote the paper's numbers under '# Paper (...' or '# Thesis (...'"
    for variant in _raw(preset).get("variants", []):  # each variant beside its number, or said to have none
        name = re.escape(variant["name"])
        beside = (rf"(?<![\w+]){name}(?![\w+])(?:\s+\([^)\n]*\))?\s+(?:[A-Z]\w*\s+)?\d+\.\d",  # name (note) 12.3
                  rf"(?<![\w+]){name}(?![\w+])[^\n:]*:\s*no [^\n]*number")  # "name, other: no ... number"
        assert any(re.search(b, numbers[1]) for b in beside), \
            f"{preset.name}: no number beside variant {variant['name']!r}"
    weights = _raw(preset).get("init", {}).get("weights")
    if weights is not None:
        assert weights.startswith("weights/") and Path(weights).name in header
        assert not (ROOT / weights).exists()  # published weights are never committed
    row = [line for line in DOC.read_text().splitlines() if line.startswith(f"| [`{preset.stem}`]")]
    assert len(row) == 1, f"docs/paper_presets.md has no row for {preset.stem}"
    cells = row[0].split(" | ")
    assert cells[3].startswith(f"`{_raw(preset)['model']['name']}`"), "the docs' model column is the preset's model"
    if weights is not None:
        assert Path(weights).name in cells[4]


def _published_names(model: torch.nn.Module, layout: str) -> dict[str, torch.Tensor]:
    """The model's state dict under the key names its published checkpoint uses (torchvision's ``resnet*`` and
    ``mobilenet_v2``: ``conv1``/``bn1``/``layerN``/``fc``, ``features.N[.conv]``/``classifier.1``), with
    torchvision's 1000-class classifier, as the file holds it."""
    assert layout == "torchvision", f"no published key names written for layout {layout!r}"
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith("head."):
            cls = "fc" if hasattr(model.backbone, "layer1") else "classifier.1"
            value = torch.zeros(1000, *value.shape[1:]) if value.dim() > 1 else torch.zeros(1000)
            out[key.replace("head.", f"{cls}.", 1)] = value
        else:
            out[re.sub(r"^backbone\.(features\.\d+)\.block\.", r"\1.conv.", key).removeprefix("backbone.")] = value
    return out


@pytest.mark.parametrize("preset", PRESETS, ids=_ids(PRESETS))
def test_preset_init_places_every_key_of_the_published_checkpoint(preset, monkeypatch):
    """The published file is not in CI: a state dict with its key names (and its 1000-class classifier) stands in,
    and the preset's ``[init]`` (layout, exclude, strict) must place every key of it into the preset's model."""
    raw = _raw(preset)
    if "init" not in raw:
        pytest.skip(f"{preset.stem} loads no published weights (its header says why)")
    from fedsight import weights as W

    params = {k: v for k, v in raw["model"].items() if k != "name"}
    init = raw["init"]
    if init["layout"] == "kair":  # RVRT starts from the SPyNet its release trains from: basic_module.* alone
        from fedsight.models.spynet import SpyNet

        published = {k: torch.randn(v.shape) for k, v in SpyNet().state_dict().items()}
    else:
        donor = build_model("mobilenetv2" if raw["model"]["name"] == "deeplabv3_mobilenetv2" else raw["model"]["name"],
                            {"cifar_stem": False} if "mobilenet" in raw["model"]["name"] else params,
                            num_outputs=1000, in_channels=3)  # DeepLab's backbone: the ImageNet MobileNetV2's
        published = _published_names(donor, init["layout"])
    monkeypatch.setattr(W, "read_checkpoint", lambda path: dict(published))
    model = build_model(raw["model"]["name"], params, in_channels=3, **IO[preset.stem])
    loaded = W.load_checkpoint(model, init["weights"], init["layout"], strict=init.get("strict", True),
                               exclude=init.get("exclude", ()))
    if init["layout"] == "kair":
        assert set(loaded) == {f"spynet.{k}" for k in published}
    else:
        assert len(loaded) == len(published) - 2  # all but the classifier (weight, bias)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in loaded.items())


@pytest.mark.parametrize("preset", PRESETS, ids=_ids(PRESETS))
def test_preset_model_at_paper_size(preset):
    raw = _raw(preset)
    params = {k: v for k, v in raw["model"].items() if k != "name"}
    with torch.device("meta"):
        model = build_model(raw["model"]["name"], params, in_channels=3, **IO[preset.stem])
    count = sum(p.numel() for p in model.parameters())
    if raw["model"]["name"] in PUBLISHED:
        total, width = PUBLISHED[raw["model"]["name"]]
        assert count == total - (width + 1) * (1000 - IO[preset.stem]["num_outputs"])
    if raw["model"]["name"] in PAPER_COUNTS:
        low, high = PAPER_COUNTS[raw["model"]["name"]]
        assert low <= count <= high
    assert count > 1_000_000  # the paper's model, not a CPU stand-in


def _fast_trunc_normal(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
    """``torch.nn.init.trunc_normal_`` drawn as a clamped normal: the same support and nearly the same values,
    without the inverse-error-function pass that takes 6 s for ViT-S's 22M weights on a CPU."""
    with torch.no_grad():
        return tensor.normal_(mean, std, generator=generator).clamp_(a, b)


@pytest.mark.parametrize("preset", PRESETS, ids=_ids(PRESETS))
def test_preset_data_build_from_its_layout_and_train_one_batch(preset, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.nn.init, "trunc_normal_", _fast_trunc_normal)
    raw = _raw(preset)
    raw.pop("init", None)  # the published weights are not in CI
    first = raw.get("variants", [{}])[0].get("name")
    specs = expand(raw, preset.name, only=[first] if first else (), typed=[(k.split("."), v) for k, v in
                                                                           overrides(raw, tmp_path).items()])
    cfg = specs[0].config
    if getattr(cfg.data, "split_file", None) is not None:  # a published client split fixes the clients
        assert cfg.partition.name == "predefined"
    task = build_task(cfg)
    assert task.num_clients == cfg.partition.num_clients and task.num_train_examples(0) > 0
    torch.manual_seed(0)
    model = task.build_model()
    assert type(model).__module__.startswith("fedsight.models")
    inputs, targets = task.train_batch(0, torch.arange(min(2, task.num_train_examples(0))))
    loss = task.loss(model(inputs), targets)
    assert torch.isfinite(loss)


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS, ids=_ids(PRESETS))
def test_preset_runs_under_smoke_on_its_fixture(preset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = _raw(preset)
    raw.pop("init", None)
    first = raw.get("variants", [{}])[0].get("name")
    grid = raw.get("sweep", {}).get("grid", {})
    over = {**overrides(raw, tmp_path / "data"), "run.output_dir": "out",
            **({"sweep.grid": {k: v[:1] for k, v in grid.items()}} if grid else {})}
    results = fedsight.run(raw, smoke=True, variants=[first] if first else (), **over)
    for res in results if isinstance(results, list) else [results]:
        assert res.status == "complete", res.run_dir
        assert any(k.startswith("test/") for k in res.history[-1])


# -- examples/paper/cifar_folders.py: the CIFAR binary release into the presets' image folders -------------------

def _cifar_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("cifar_folders", ROOT / "examples" / "paper" / "cifar_folders.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _records(path: Path, labels: list[list[int]], seed: int) -> list[bytes]:
    """Binary CIFAR records: the label bytes, then 3 x 1024 pixel bytes (red, green, blue planes, row-major)."""
    rng = np.random.default_rng(seed)
    pixels = [rng.integers(0, 256, 3072, dtype=np.uint8).tobytes() for _ in labels]
    path.write_bytes(b"".join(bytes(lab) + px for lab, px in zip(labels, pixels)))
    return pixels


def _pixel_planes(png: Path) -> bytes:
    """A written PNG back in CIFAR's byte order (channel planes, row-major), read independently of the script."""
    arr = np.asarray(Image.open(png))
    return b"".join(arr[:, :, k].tobytes() for k in range(3))


def test_cifar10_binary_release_into_merged_class_folders(tmp_path):
    src = tmp_path / "cifar-10-batches-bin"
    src.mkdir()
    (src / "batches.meta.txt").write_text("airplane\nautomobile\nbird\n\n")
    expect = []  # (class, pixels) in file order: train batches 1..5, then test
    for k, name in enumerate([f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]):
        labels = [[k % 3], [(k + 1) % 3]]
        expect += list(zip([lab[0] for lab in labels], _records(src / name, labels, k)))
    assert _cifar_script().main([str(src), str(tmp_path / "out"), "--merged"]) == 0
    names = ["airplane", "automobile", "bird"]
    for i, (label, pixels) in enumerate(expect):
        assert _pixel_planes(tmp_path / "out" / "all" / names[label] / f"{i:05d}.png") == pixels
    assert sum(1 for _ in (tmp_path / "out").rglob("*.png")) == len(expect)


def test_cifar100_keeps_the_fine_label_and_splits_train_test(tmp_path):
    src = tmp_path / "cifar-100-binary"
    src.mkdir()
    (src / "fine_label_names.txt").write_text("apple\naquarium_fish\nbaby\n")
    train = _records(src / "train.bin", [[7, 2], [7, 0]], 0)  # coarse label 7 is not a class: the fine one is kept
    test = _records(src / "test.bin", [[1, 1]], 1)
    assert _cifar_script().main([str(src), str(tmp_path / "out")]) == 0
    assert _pixel_planes(tmp_path / "out" / "train" / "baby" / "00000.png") == train[0]
    assert _pixel_planes(tmp_path / "out" / "train" / "apple" / "00001.png") == train[1]
    assert _pixel_planes(tmp_path / "out" / "test" / "aquarium_fish" / "00000.png") == test[0]


def test_cifar_truncated_file_is_one_line_and_writes_nothing(tmp_path, capsys):
    src = tmp_path / "cifar-100-binary"
    src.mkdir()
    (src / "fine_label_names.txt").write_text("apple\n")
    _records(src / "train.bin", [[0, 0]], 0)
    (src / "test.bin").write_bytes(b"\x00" * 100)
    assert _cifar_script().main([str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(src / "test.bin") in err and "3074-byte" in err
    assert not (tmp_path / "out").exists()
    assert _cifar_script().main([str(tmp_path), str(tmp_path / "out")]) == 2  # not a CIFAR folder
    assert "neither CIFAR-10's" in capsys.readouterr().err


def test_stl10_binary_release_into_train_test_class_folders(tmp_path, capsys):
    """STL-10's files hold each colour plane column by column (its reference reader transposes): an image written
    that way comes back upright, labels 1..10 become class folders, and a label/image count mismatch is one line."""
    src = tmp_path / "stl10_binary"
    src.mkdir()
    (src / "class_names.txt").write_text("airplane\nbird\ncar\n")
    rng = np.random.default_rng(0)
    images = {s: rng.integers(0, 256, (n, 96, 96, 3), dtype=np.uint8) for s, n in (("train", 3), ("test", 1))}
    labels = {"train": [3, 1, 2], "test": [2]}
    for split, imgs in images.items():
        (src / f"{split}_X.bin").write_bytes(b"".join(np.asfortranarray(im[:, :, k]).tobytes(order="F")
                                                      for im in imgs for k in range(3)))
        (src / f"{split}_y.bin").write_bytes(bytes(labels[split]))
    assert _cifar_script().main([str(src), str(tmp_path / "out")]) == 0
    names = ["airplane", "bird", "car"]
    for split, imgs in images.items():
        for i, (im, lab) in enumerate(zip(imgs, labels[split])):
            assert np.array_equal(np.asarray(Image.open(tmp_path / "out" / split / names[lab - 1] / f"{i:05d}.png")), im)
    (src / "test_y.bin").write_bytes(bytes([1, 2]))
    assert _cifar_script().main([str(src), str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "test_y.bin: 2 labels for 1 images" in err and not (tmp_path / "out2").exists()


def test_the_cost_script_prints_a_row_for_every_preset(capsys, monkeypatch):
    """``python benchmarks/paper_presets_cost.py`` (docs/paper_presets.md's times): one row per preset file, each an
    estimate or the paper's reported time (a preset added without either stopped the script with a KeyError)."""
    import sys

    root = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    sys.modules.pop("paper_presets_cost", None)
    import paper_presets_cost

    paper_presets_cost.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| `")]
    presets = sorted(p.stem for p in (root / "examples" / "paper").glob("*.toml"))
    assert [re.match(r"\| `([^`]+)`", line).group(1) for line in rows] == presets
    assert all("GPU-hours" in line or "the paper:" in line for line in rows)
