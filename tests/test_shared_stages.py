"""``[sweep] share_stages``: runs that begin with the same stages train them once, and every run still ends bit for
bit as it does alone (``fedsight.shared_stages``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import fedsight
from fedsight.shared_stages import plan, prepare
from fedsight.sweep import expand
from helpers import tiny


def sweep(out: Path, share: bool, seeds: list[int] = [0]) -> dict:
    """Three stages of one round (SCAFFOLD's client state in the second); variants that differ in the last stage,
    in the second, in the data, and in the top-level recipe that every stage overrides."""
    raw = tiny(**{"run.output_dir": str(out), "server.rounds": 3, "eval.every": 1})
    raw["stages"] = [{"name": "a", "rounds": 1, "recipe": {"components": []}},
                     {"name": "b", "rounds": 1, "recipe": {"components": ["scaffold"]}},
                     {"name": "c", "rounds": 1, "recipe": {"components": []}}]
    last = copy.deepcopy(raw["stages"])
    last[2]["train"] = {"lr": 0.05}
    second = copy.deepcopy(raw["stages"])
    second[1]["train"] = {"lr": 0.05}
    raw["variants"] = [{"name": "base"}, {"name": "last", "stages": last}, {"name": "second", "stages": second},
                       {"name": "data", "partition": {"alpha": 0.3}}, {"name": "top", "recipe": {"components": ["fedprox"]}}]
    raw["sweep"] = {"seeds": seeds, "share_stages": share}
    return raw


def rows(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in lines if "event" not in r]


def test_the_plan_shares_the_longest_equal_prefix_with_the_first_run_that_has_it(tmp_path):
    specs = expand(sweep(tmp_path, True, seeds=[0, 1]), "t.toml")
    names = [(s.variant, s.seed) for s in specs]
    got = {(names[s.follower], names[s.donor], s.round, s.stages) for s in plan([s.config for s in specs])}
    assert got == {(("last", 0), ("base", 0), 2, 2), (("last", 1), ("base", 1), 2, 2),  # differs in stage c only
                   (("second", 0), ("base", 0), 1, 1), (("second", 1), ("base", 1), 1, 1),  # from stage b on
                   (("top", 0), ("base", 0), 2, 2), (("top", 1), ("base", 1), 2, 2)}  # overridden in every stage
    # ("data": another partition, nothing shared; no run shares with another seed's)


def test_every_run_ends_as_it_does_alone_and_says_where_its_first_rounds_came_from(tmp_path):
    alone = fedsight.run(sweep(tmp_path / "alone", False))
    shared = fedsight.run(sweep(tmp_path / "shared", True))
    for a, s in zip(alone, shared):
        assert rows(a.run_dir) == rows(s.run_dir), s.run_dir
        assert (a.run_dir / "model.safetensors").read_bytes() == (s.run_dir / "model.safetensors").read_bytes()
        assert s.status == "complete"
    events = {s.run_dir.parent.name: [e for e in s.events if e["event"] == "stages_shared"] for s in shared}
    base = str(shared[0].run_dir)
    assert events == {"base": [], "data": [], "last": [{"event": "stages_shared", "round": 2, "stage": "b", "from": base}],
                      "second": [{"event": "stages_shared", "round": 1, "stage": "a", "from": base}],
                      "top": [{"event": "stages_shared", "round": 2, "stage": "b", "from": base}]}
    meta = json.loads((shared[1].run_dir / "run.json").read_text())
    # the first run's two sessions (to round 1 for "second", on to round 2 for "last" and "top"), then its own
    assert len(meta["sessions"]) == 3


def test_a_first_run_past_the_shared_rounds_leaves_the_others_to_train_them(tmp_path):
    specs = expand(sweep(tmp_path, True), "t.toml")
    fedsight.run(sweep(tmp_path, False), variants=["base"])  # finished: its round-2 state is gone
    said, ran = [], []
    copied = prepare([s.config for s in specs], [s.run_dir for s in specs], lambda i, r: ran.append((i, r)), said.append)
    assert copied == [] and ran == []
    assert said == [f"share_stages: {specs[0].run_dir} is past round 1 already; 1 run(s) train their first 1 rounds "
                    "themselves",
                    f"share_stages: {specs[0].run_dir} is past round 2 already; 2 run(s) train their first 2 rounds "
                    "themselves"]


def test_overwrite_and_stop_after_turn_it_off_in_one_line(tmp_path):
    from typer.testing import CliRunner

    import tomli_w
    from fedsight.cli import app

    cfg = tmp_path / "s.toml"
    cfg.write_text(tomli_w.dumps(sweep(tmp_path / "runs", True)))
    out = CliRunner().invoke(app, ["run", str(cfg), "--stop-after", "1", "--variant", "base", "--variant", "last"])
    assert out.exit_code == 0, out.output
    assert "share_stages: off with --stop-after; every run trains all its stages" in " ".join(out.output.split())
    assert not any(e for d in (tmp_path / "runs").rglob("metrics.jsonl") for e in d.read_text().splitlines()
                   if "stages_shared" in e)
