"""--overwrite never loses a run to bad input or a failing new run, and never deletes anything but a FedSight
run directory: the old run is set aside, deleted once the new run has recorded a round, and put back if the new
run fails before that (in-process and on the Flower path)."""

from __future__ import annotations

import json

import pytest

from fedsight.api import execute
from fedsight.config import validate
from fedsight.registry import COMPONENTS, NoParams
from fedsight.training import Component

from helpers import tiny


def _snapshot(path):
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture()
def old_run(tmp_path):
    execute(validate(tiny(**{"server.rounds": 2})), tmp_path / "r")
    return tmp_path / "r", _snapshot(tmp_path / "r")


def test_bad_input_with_overwrite_leaves_the_old_run_intact(old_run, tmp_path) -> None:
    path, before = old_run
    bad = validate(tiny(**{"server.rounds": 3, "data": {"name": "imagefolder", "train_dir": str(tmp_path / "missing")}}))
    with pytest.raises(Exception, match="missing"):
        execute(bad, path, overwrite=True)
    assert _snapshot(path) == before
    assert not list(tmp_path.glob(".r.replaced"))


class Boom(Component):
    name = "boom"

    def server_round_end(self, sctx, results, weights):
        raise RuntimeError("boom in round 1")


def test_a_new_run_failing_before_its_first_round_puts_the_old_run_back(old_run, tmp_path) -> None:
    path, before = old_run
    if "boom" not in COMPONENTS.names():
        COMPONENTS.register("boom", params=NoParams)(lambda params: Boom())
    with pytest.raises(RuntimeError, match="boom"):
        execute(validate(tiny(**{"server.rounds": 3, "recipe.components": ["boom"]})), path, overwrite=True)
    assert _snapshot(path) == before
    assert not list(tmp_path.glob(".r.replaced"))


def test_overwrite_replaces_a_run_and_leaves_nothing_aside(old_run, tmp_path) -> None:
    path, _ = old_run
    out = execute(validate(tiny(**{"server.rounds": 3})), path, overwrite=True)
    assert out.status == "complete"
    assert json.loads((path / "config.json").read_text())["server"]["rounds"] == 3
    assert not list(tmp_path.glob(".r.replaced"))


def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path) -> None:
    other = tmp_path / "thesis"
    other.mkdir()
    (other / "chapter1.tex").write_text("precious")
    with pytest.raises(FileExistsError, match="not a FedSight run directory"):
        execute(validate(tiny(**{"server.rounds": 1})), other, overwrite=True)
    assert (other / "chapter1.tex").read_text() == "precious" and not (other / "config.json").exists()


def test_resume_sweeps_what_a_killed_writer_left_and_ends_identical(tmp_path) -> None:
    cfg = validate(tiny(**{"server.rounds": 3, "run.checkpoint_keep": 1}))
    whole = execute(cfg, tmp_path / "whole")
    part = tmp_path / "part"
    execute(cfg, part, stop_after=2)
    ck = part / "checkpoints"
    (ck / ".ckpt.abc.tmp").write_bytes(b"half a checkpoint")
    (part / ".status.json.x1.tmp").write_text("{")
    (ck / "round-000001.safetensors").write_bytes(b"orphan of a pruning")
    out = execute(cfg, part, resume=True)
    assert out.status == "complete"
    assert not list(part.rglob("*.tmp")) and not (ck / "round-000001.safetensors").exists()
    assert (whole.run_dir / "model.safetensors").read_bytes() == (part / "model.safetensors").read_bytes()


@pytest.mark.parametrize("verb,name", [("partition", "metrics.jsonl"), ("pretrain", "model.safetensors")])
def test_out_never_writes_into_a_run_directory(old_run, verb, name, tmp_path) -> None:
    import tomli_w
    from typer.testing import CliRunner

    from fedsight.cli import app

    path, before = old_run
    cfg = tmp_path / "c.toml"
    cfg.write_text(tomli_w.dumps(tiny(**{"pretrain.source": "samples"}) if verb == "pretrain" else tiny()))
    res = CliRunner().invoke(app, [verb, str(cfg), "--out", str(path / name)])
    assert res.exit_code == 2 and "inside the run directory" in res.output, res.output
    assert _snapshot(path) == before


def test_a_copied_run_directory_resumes_from_its_new_place(tmp_path) -> None:
    """Where the run directory lies (run.output_dir) is not part of the experiment: a run copied elsewhere and
    run there with its new output_dir resumes (here: is complete) instead of being 'a different config'."""
    import shutil

    execute(validate(tiny(**{"server.rounds": 2, "run.output_dir": str(tmp_path / "a")})), tmp_path / "a" / "r")
    shutil.copytree(tmp_path / "a" / "r", tmp_path / "b" / "r")
    out = execute(validate(tiny(**{"server.rounds": 2, "run.output_dir": str(tmp_path / "b")})), tmp_path / "b" / "r")
    assert out.status == "skipped"


def test_a_torn_last_metrics_line_is_dropped_on_resume_and_said(tmp_path) -> None:
    cfg = validate(tiny(**{"server.rounds": 3}))
    whole = execute(cfg, tmp_path / "whole")
    part = tmp_path / "part"
    execute(cfg, part, stop_after=2)
    with open(part / "metrics.jsonl", "a") as f:
        f.write('{"round": 3, "stage": "federated", "train/lo')  # a crash in the middle of an append
    assert execute(cfg, part, resume=True).status == "complete"
    rows = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    notes = [r for r in rows if r.get("event") == "run_repaired"]
    assert len(notes) == 1 and "torn last line" in notes[0]["note"]
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rs if "event" not in r]  # noqa: E731
    assert strip(rows) == strip(json.loads(x) for x in (whole.run_dir / "metrics.jsonl").read_text().splitlines())


def test_a_damaged_line_before_the_last_is_named(tmp_path) -> None:
    cfg = validate(tiny(**{"server.rounds": 3}))
    part = tmp_path / "part"
    execute(cfg, part, stop_after=2)
    lines = (part / "metrics.jsonl").read_text().splitlines()
    lines[0] = "{not json"
    (part / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: invalid JSON"):
        execute(cfg, part, resume=True)


def test_a_bad_last_line_that_ends_in_a_newline_is_named_not_dropped(tmp_path) -> None:
    """Resume drops what the readers skip (``runs._jsonl``): a torn last line has no newline after it; a finished
    line that is not JSON was not torn by a crash, so it is named and the files are left as they are."""
    cfg = validate(tiny(**{"server.rounds": 3}))
    part = tmp_path / "part"
    execute(cfg, part, stop_after=2)
    path = part / "metrics.jsonl"
    path.write_text(path.read_text() + '{"round": 3, "train/lo\n')
    before = path.read_bytes()
    with pytest.raises(ValueError, match=r"metrics.jsonl:\d+: invalid JSON"):
        execute(cfg, part, resume=True)
    assert path.read_bytes() == before
