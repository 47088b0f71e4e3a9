"""``report.html`` (issue 45, item 2): one self-contained file beside report.md, grouped by task, with the tables
and their 95% CIs, curves, partition heat maps and each run's pictures; escaped text, no script, no network; and
opened in a real headless Chromium (Debian's package): it loads, logs no console error, requests nothing but the
file and its data: URIs, and every picture decodes (naturalWidth > 0). Checked for a tiny sweep trained here
(``fedsight run``, as the quickstart) and for a folder of mixed tasks written as the engines write runs."""

from __future__ import annotations

import base64
import io
import json
import re
import sys
from pathlib import Path

import pytest
import tomli_w
from typer.testing import CliRunner

from fedsight.cli import app
from fedsight.reporting import report

sys.path.insert(0, str(Path(__file__).parent))
from browser import CHROMIUM, check_page  # noqa: E402
from helpers import tiny  # noqa: E402

runner = CliRunner()
needs_chromium = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                    reason=f"{CHROMIUM} is absent (apt-get install chromium; .ci/run installs it)")


def _png(width: int, height: int, color: tuple[int, int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


def _run(root: Path, rel: str, name: str, task: str, data: str, seed: int, rows: list[dict], metrics: dict,
         primary: str, *, counts: list[list[int]] | None = None, pictures: dict[str, bytes] | None = None,
         lr: float = 0.1) -> Path:
    d = root / rel
    d.mkdir(parents=True)
    cfg = {"seed": seed, "run": {"name": name, "output_dir": "runs"}, "task": {"name": task}, "data": {"name": data},
           "partition": {"name": "iid", "num_clients": 3}, "model": {"name": "m"}, "server": {"rounds": 2}, "train": {"lr": lr}}
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "run.json").write_text(json.dumps({"format": 1, "primary": primary, "metrics": metrics,
                                            "sessions": [{"backend": "in-process"}]}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"stage": "fed", **r}) + "\n" for r in rows))
    if counts is not None:
        (d / "partition.json").write_text(json.dumps({"client_label_counts": counts, "class_names": ["a", "b"]}))
    for rel_png, data_png in (pictures or {}).items():
        (d / "plots" / rel_png).parent.mkdir(parents=True, exist_ok=True)
        (d / "plots" / rel_png).write_bytes(data_png)
    return d


def mixed_folder(root: Path) -> list[Path]:
    """Classification (2 groups x 2 seeds, one with a name to escape), segmentation and SR runs with partitions
    and pictures under plots/ and plots/visuals/."""
    cls_m = {"test/acc": True, "test/loss": False, "time/*": False}
    dirs = []
    for name, acc, lr in (("fedavg", 0.7, 0.1), ('prox<b>&"x"', 0.8, 0.2)):
        for s in (0, 1):
            rows = [{"round": r, "test/acc": acc - 0.1 / r + s / 100, "test/loss": 1 - acc, "time/round_s": 1.0}
                    for r in (1, 2)]
            dirs.append(_run(root, f"cls/{len(dirs)}", name, "classification", "digits", s, rows, cls_m, "test/acc",
                             counts=[[5, 1], [0, 6], [3, 3]], pictures={"curves.png": _png(300, 200, (20, 90, 200))}, lr=lr))
    seg = [{"round": r, "test/miou": 0.3 * r, "time/round_s": 2.0} for r in (1, 2)]
    dirs.append(_run(root, "seg/0", "ladd", "segmentation", "street", 0, seg, {"test/miou": True, "time/*": False},
                     "test/miou", counts=[[9, 1], [1, 9], [5, 5]],
                     pictures={"visuals.png": _png(400, 150, (200, 60, 20)), "class_distribution.png": _png(200, 100, (0, 0, 0))}))
    sr = [{"round": r, "test/psnr": 25.0 + r, "time/round_s": 3.0} for r in (1, 2)]
    dirs.append(_run(root, "sr/0", "fedavg", "image_sr", "builtin_sr", 0, sr, {"test/psnr": True, "time/*": False},
                     "test/psnr", pictures={"visuals.png": _png(320, 240, (30, 160, 60)),
                                            "visuals/image0_gt.png": _png(48, 48, (250, 250, 250))}))
    return dirs


def _data_pngs(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


def test_report_html_of_mixed_tasks_is_one_escaped_self_contained_file(tmp_path: Path) -> None:
    rep = report(mixed_folder(tmp_path / "runs"), tmp_path / "rep", baseline="fedavg")
    page = (tmp_path / "rep" / "report.html").read_text()
    assert [s.title for s in rep.sections] == ["classification on digits", "segmentation on street",
                                               "image_sr on builtin_sr"]
    for s in rep.sections:  # a section each, in order, with its own table only
        assert f'<section id="s-{s.slug}"><h2>{s.title}</h2>' in page
        n, m = len(s.table.groups), len(s.runs)  # the contents' counts in words ("1 run", not "1 runs")
        assert f"{n} group{'s' * (n != 1)}, {m} run{'s' * (m != 1)}</li>" in page
    cls = page[page.index('<section id="s-classification-on-digits">'):page.index('<section id="s-segmentation')]
    assert "test/acc ↑" in cls and "test/miou" not in cls and "test/psnr" not in cls
    assert "95% CI" in cls and re.search(r"<td class=(better|worse|noise)>", cls)  # paired comparisons
    assert "prox&lt;b&gt;&amp;&quot;x&quot;" in page and "<b>" not in page  # run names escaped
    assert "<script" not in page.lower() and not re.search(r"(src|href)=\"(?!data:|#)", page)
    pngs = _data_pngs(page)
    assert all(p.startswith(b"\x89PNG\r\n\x1a\n") for p in pngs)
    # 3 curves + 2 distinct partitions (the classification runs share one) + 4 + 2 + 2 run pictures
    assert len(pngs) == 3 + 2 + 4 + 2 + 2
    assert page.count("<figcaption>Partition of ") == 2 and "Partition of fedavg, prox&lt;b&gt;" in page
    assert "plots/visuals/image0_gt.png" in page  # pictures in a sub-folder of plots/ too, after visuals.png
    assert page.index("<figcaption>plots/visuals.png") < page.index("<figcaption>plots/visuals/image0_gt.png")
    assert "The baseline fedavg is not among these runs" in page  # segmentation has no group fedavg


def test_pictures_beyond_a_runs_share_are_listed_not_inlined(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fedsight.reporting import html

    monkeypatch.setattr(html, "MAX_IMAGES_PER_RUN", 1)
    pics = {"a.png": _png(10, 10, (0, 0, 0)), "b.png": _png(10, 10, (9, 9, 9)), "c.png": b"not a png"}
    d = _run(tmp_path, "r", "x", "classification", "digits", 0, [{"round": 1, "test/acc": 0.5}], {"test/acc": True},
             "test/acc", pictures=pics)
    report([d], tmp_path / "rep")
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "<figcaption>plots/a.png" in page and "not inlined: plots/b.png (more than 1 pictures" in page
    monkeypatch.setattr(html, "MAX_IMAGES_PER_RUN", 12)
    report([d], tmp_path / "rep2")
    page = (tmp_path / "rep2" / "report.html").read_text()
    assert "not inlined: plots/c.png (not a readable PNG" in page and "<figcaption>plots/b.png" in page


def test_pictures_over_the_size_limits_are_listed_not_inlined(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The 4 MiB a picture and 16 MiB of run pictures a report (shrunk here to the test's pictures' sizes): a
    picture over the first is listed, and once the second is spent the runs' own curves go before task pictures."""
    from fedsight.reporting import html

    small, big = _png(10, 10, (0, 0, 0)), _png(200, 200, (7, 9, 250))
    pics = {"visuals.png": small, "big.png": big, "curves.png": small}
    d = _run(tmp_path, "r", "x", "classification", "digits", 0, [{"round": 1, "test/acc": 0.5}], {"test/acc": True},
             "test/acc", pictures=pics)
    monkeypatch.setattr(html, "MAX_IMAGE_BYTES", len(big) - 1)
    report([d], tmp_path / "rep")
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "not inlined: plots/big.png (not a readable PNG" in page
    assert "<figcaption>plots/visuals.png" in page and "<figcaption>plots/curves.png" in page
    monkeypatch.setattr(html, "MAX_IMAGE_BYTES", 4 << 20)
    monkeypatch.setattr(html, "MAX_RUN_IMAGE_BYTES", len(small) + len(big))  # the two task pictures, not the curves
    report([d], tmp_path / "rep2")
    page = (tmp_path / "rep2" / "report.html").read_text()
    assert "<figcaption>plots/visuals.png" in page and "<figcaption>plots/big.png" in page
    assert "not inlined: plots/curves.png (the report&#x27;s" in page and "of run pictures are spent" in page  # escaped


def _assert_renders(path: Path, n_images: int) -> None:
    page = check_page(path)
    assert page.title.startswith("FedSight comparison") and page.text_chars > 500
    assert page.errors == [], page.errors
    assert all(u.startswith(("file:", "data:")) for u in page.requests), page.requests
    assert len(page.images) == n_images
    broken = [(alt, w, h) for complete, w, h, alt, _ in page.images if not complete or w <= 0 or h <= 0]
    assert not broken, broken


@needs_chromium
def test_report_html_of_a_tiny_sweep_renders_in_chromium(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The quickstart's shape (two variants x two seeds on digits), shrunk: the report.html `fedsight run` writes
    beside report.md renders in Chromium (tiny runs draw no plots of their own: they are most of their time; the
    mixed folder's test has run pictures)."""
    monkeypatch.chdir(tmp_path)
    raw = tiny(**{"server.rounds": 1, "eval.every": 1, "run.name": "quick", "partition.num_clients": 4,
                  "server.clients_per_round": 2})
    raw["sweep"] = {"seeds": [0, 1]}
    raw["variants"] = [{"name": "fedavg"}, {"name": "fedadam", "server": {"optimizer": {"name": "fedadam", "lr": 0.01}}}]
    (tmp_path / "q.toml").write_text(tomli_w.dumps(raw))
    res = runner.invoke(app, ["run", "q.toml"])
    assert res.exit_code == 0, res.output
    assert "runs/quick/report.html" in res.output
    text = (tmp_path / "runs/quick/report.html").read_text()
    assert "Compared with the baseline fedavg" in text and "95% CI" in text
    assert text.count("<figcaption>Partition of fedavg, fedadam") == 2  # each seed deals its own; variants share it
    assert text.count("This run wrote no pictures under plots/.") == 4
    _assert_renders(tmp_path / "runs/quick/report.html", 1 + 1 + 2)  # the curves, the cost figure, two partitions


@needs_chromium
def test_report_html_of_mixed_tasks_renders_in_chromium(tmp_path: Path) -> None:
    """Also: the report of one task into the same --out first, whose curves.png the mixed report (a curves figure
    per section) removes, as its own unchanged file."""
    mixed_folder(tmp_path / "runs")
    one = runner.invoke(app, ["report", str(tmp_path / "runs/sr"), "--out", str(tmp_path / "rep")])
    assert one.exit_code == 0 and (tmp_path / "rep/curves.png").is_file(), one.output
    res = runner.invoke(app, ["report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    assert "report.html" in res.output and not (tmp_path / "rep/curves.png").exists()
    assert sorted(p.name for p in (tmp_path / "rep").glob("curves*.png")) == [
        "curves-classification-on-digits.png", "curves-image-sr-on-builtin-sr.png", "curves-segmentation-on-street.png"]
    _assert_renders(tmp_path / "rep" / "report.html", 3 + 2 + 4 + 2 + 2)


@needs_chromium
def test_the_browser_check_sees_broken_pictures_and_console_errors(tmp_path: Path) -> None:
    """The check itself can fail: a picture that does not decode and a script's console.error are caught."""
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><head><title>FedSight comparison</title><link rel=icon href="data:,">'
                   '</head><body><p>' + "x" * 600 + '</p><img alt="bad" src="data:image/png;base64,iVBORw0KGgo=">'
                   '<script>console.error("boom")</script></body></html>')
    page = check_page(bad)
    assert any("boom" in e for e in page.errors)
    assert [w for _, w, _, _, _ in page.images] == [0]
