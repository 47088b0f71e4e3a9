"""Resume verifies what it reads: a damaged checkpoint is skipped and said, a run with no intact checkpoint is
never silently retrained from round 0, tensors that do not fit the model are named, an interrupted run says so,
and a status that is not what FedSight writes is refused. Every refusal leaves the run directory as it was."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from fedsight.api import execute
from fedsight.config import validate
from fedsight.errors import RunFileError

from helpers import tiny

PLAIN = tiny(**{"server.rounds": 3, "run.checkpoint_keep": 3})
CFG = tiny(**{"server.rounds": 3, "run.checkpoint_keep": 3, "recipe.components": ["scaffold"]})  # c_i on disk


def _snapshot(path):
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _rows(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows if "event" not in r]


def _events(run_dir, kind):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("event") == kind]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    path = tmp_path_factory.mktemp("whole") / "r"
    execute(validate(CFG), path)
    return path


@pytest.fixture()
def part(tmp_path):
    path = tmp_path / "part"
    execute(validate(CFG), path, stop_after=2)
    return path


@pytest.fixture()
def plain(tmp_path):
    whole, part = tmp_path / "whole", tmp_path / "part"
    execute(validate(PLAIN), whole)
    execute(validate(PLAIN), part, stop_after=2)
    return whole, part


def _rewrite(stem, change):
    """Change a checkpoint's tensors with ``change(dict)`` and re-record their SHA-256, so only the content is
    wrong (the integrity check passes)."""
    import hashlib

    tensors = load_file(str(stem.with_suffix(".safetensors")))
    change(tensors)
    save_file(tensors, str(stem.with_suffix(".safetensors")))
    meta = json.loads(stem.with_suffix(".json").read_text())
    meta["sha256"] = hashlib.sha256(stem.with_suffix(".safetensors").read_bytes()).hexdigest()
    stem.with_suffix(".json").write_text(json.dumps(meta))


def test_a_damaged_newest_checkpoint_is_skipped_said_and_the_end_identical(plain) -> None:
    whole, part = plain
    newest = part / "checkpoints" / "round-000002.safetensors"
    newest.write_bytes(newest.read_bytes()[:-7] + b"garbage")
    assert execute(validate(PLAIN), part, resume=True).status == "complete"
    notes = [e["note"] for e in _events(part, "run_repaired")]
    assert any("round-000002 is damaged" in n for n in notes), notes
    assert _rows(part) == _rows(whole)
    assert load_file(str(part / "model.safetensors")).keys() == load_file(str(whole / "model.safetensors")).keys()
    for k, v in load_file(str(part / "model.safetensors")).items():
        assert torch.equal(v, load_file(str(whole / "model.safetensors"))[k]), k


def test_per_client_state_cannot_fall_back_to_an_older_checkpoint(part) -> None:
    """SCAFFOLD's c_i of round 1 were superseded (deleted) when round 2 committed: with round 2's checkpoint
    damaged, round 1's cannot resume the run, and the message says why instead of a missing-file error."""
    newest = part / "checkpoints" / "round-000002.safetensors"
    newest.write_bytes(newest.read_bytes()[:-7] + b"garbage")
    before = _snapshot(part)
    with pytest.raises(RunFileError, match=r"client state missing.*round-000002 is damaged.*--overwrite"):
        execute(validate(CFG), part, resume=True)
    assert _snapshot(part) == before


def test_no_intact_checkpoint_is_refused_not_retrained_from_round_0(part) -> None:
    for f in (part / "checkpoints").glob("round-*.json"):
        f.write_text("{")
    before = _snapshot(part)
    with pytest.raises(RunFileError, match=r"checkpoints: no intact checkpoint of the 2 rounds recorded .*--overwrite"):
        execute(validate(CFG), part, resume=True)
    assert _snapshot(part) == before


@pytest.mark.parametrize("damage", ["missing tensor", "wrong shape"])
def test_a_checkpoint_that_does_not_fit_the_model_is_named(part, damage) -> None:
    stem = part / "checkpoints" / "round-000002"

    def change(t):
        key = "s/model/head.weight"  # the global model's (component states are checked where they are used)
        if damage == "missing tensor":
            del t[key]
        else:
            t[key] = torch.zeros(t[key].shape[0] + 1, t[key].shape[1])

    _rewrite(stem, change)
    before = _snapshot(part)
    # a marker referring to a tensor that is not there makes the checkpoint damaged (and SCAFFOLD's state cannot
    # fall back to round 1); a tensor of another shape does not fit the model
    match = r"round-000002 is damaged" if damage == "missing tensor" else r"round-000002.safetensors: does not fit"
    with pytest.raises(RunFileError, match=match):
        execute(validate(CFG), part, resume=True)
    assert _snapshot(part) == before


def test_a_missing_client_state_is_named_before_anything_is_written(part) -> None:
    files = sorted((part / "client_state").rglob("*.safetensors"))
    assert files  # SCAFFOLD keeps c_i on disk
    files[0].unlink()
    before = _snapshot(part)
    with pytest.raises(RunFileError, match=r"client state missing"):
        execute(validate(CFG), part, resume=True)
    assert _snapshot(part) == before


@pytest.mark.parametrize("status", ["[1]", '{"state": "done", "round": 2, "rounds": 3}', '{"state": "running", "round": "2"}'])
def test_a_status_fedsight_did_not_write_is_refused_naming_it(part, status) -> None:
    (part / "status.json").write_text(status)
    before = _snapshot(part)
    with pytest.raises(RunFileError, match=r"status.json: expected"):
        execute(validate(CFG), part, resume=True)
    assert _snapshot(part) == before


def test_complete_at_an_earlier_round_is_finished(part, whole) -> None:
    (part / "status.json").write_text('{"state": "complete", "round": 2, "rounds": 3}')
    assert execute(validate(CFG), part, resume=True).status == "complete"
    assert _rows(part) == _rows(whole)


def test_an_interrupted_run_says_so_and_resumes_identically(tmp_path, whole) -> None:
    path = tmp_path / "r"

    def ctrl_c(r, row):
        if r == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        execute(validate(CFG), path, on_round=ctrl_c)
    assert json.loads((path / "status.json").read_text()) == {"state": "interrupted", "round": 2, "rounds": 3}
    assert execute(validate(CFG), path, resume=True).status == "complete"
    assert _rows(path) == _rows(whole)


def test_the_cli_turns_a_damaged_run_file_into_one_line(part) -> None:
    (part / "status.json").write_text("[1]")
    proc = subprocess.run([sys.executable, "-c", "from fedsight.cli import main; main()", "resume", str(part)],
                          capture_output=True, text=True,
                          timeout=300)
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert err[0].startswith("error:") and "status.json: expected" in err[0] and "RunFileError" not in err[0]


def test_an_edited_non_tensor_entry_of_a_checkpoint_marker_is_caught(plain) -> None:
    """The tensors' SHA-256 does not cover the marker's state structure (round counters, optimiser settings):
    found by the fuzz suite, an edit there resumed silently with other numbers. Now the marker is damaged."""
    whole, part = plain
    marker = part / "checkpoints" / "round-000002.json"
    meta = json.loads(marker.read_text())
    text = json.dumps(meta["state"])
    assert '"__tensor__"' in text and text.count("{") > 3
    meta["state"]["__dict__"].popitem()  # drop one top-level entry of the server's state
    marker.write_text(json.dumps(meta))
    assert execute(validate(PLAIN), part, resume=True).status == "complete"
    assert any("round-000002 is damaged" in e["note"] for e in _events(part, "run_repaired"))
    assert _rows(part) == _rows(whole)


def test_a_flower_run_is_never_continued_in_process(tmp_path, monkeypatch):
    """A run whose sessions trained on Flower (client state on the nodes, central DP's noise on the server)
    is refused by `fedsight resume` with a message saying how to start it again; nothing is changed."""
    import json

    from typer.testing import CliRunner

    from fedsight.api import execute
    from fedsight.cli import app
    from fedsight.config import validate
    from helpers import tiny

    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "tiny" / "seed0"
    execute(validate(tiny(**{"server.rounds": 3})), run_dir, stop_after=1)
    meta = json.loads((run_dir / "run.json").read_text())
    meta["sessions"][0]["backend"] = "flower"  # as the ServerApp records it
    (run_dir / "run.json").write_text(json.dumps(meta))
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    res = CliRunner().invoke(app, ["resume", str(run_dir)])
    assert res.exit_code == 1
    assert "is a Flower run: it cannot continue in-process" in " ".join(res.output.split())
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
