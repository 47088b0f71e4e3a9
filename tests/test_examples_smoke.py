"""Every shipped example runs end to end under ``--smoke``: an example that breaks fails CI.

CI runs the first variant of each example at its first grid point; ``FEDSIGHT_SLOW=1`` runs every variant at every
grid point. A
smoke run is the first seed, at most 2 rounds a stage, 2 local steps a round, one evaluation after the last
round, under ``run.output_dir/smoke`` (``fedsight.sweep._shrink``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import fedsight
from fedsight.config import ConfigError, read_toml, stage_configs
from fedsight.sweep import SMOKE_ROUNDS, SMOKE_STEPS, expand

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.toml"))
SLOW = os.environ.get("FEDSIGHT_SLOW", "") not in ("", "0")


def _variants(example: Path) -> list[str]:
    names = [v["name"] for v in read_toml(example).get("variants", [])]
    return names if SLOW else names[:1]


CASES = [(e, v) for e in EXAMPLES for v in (_variants(e) or [None])]


@pytest.mark.parametrize("example, variant", CASES, ids=[f"{e.stem}-{v}" for e, v in CASES])
def test_every_example_runs_under_smoke(example, variant, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # data caches the examples keep under runs/ land here
    grid = read_toml(example).get("sweep", {}).get("grid", {})
    first = {} if SLOW or not grid else {"sweep.grid": {k: v[:1] for k, v in grid.items()}}
    out = fedsight.run(example, smoke=True, variants=[variant] if variant else (), **{"run.output_dir": "out"},
                       **first)
    results = out if isinstance(out, list) else [out]
    assert results
    for res in results:
        assert res.status == "complete", res.run_dir
        assert res.run_dir.parts[:2] == ("out", "smoke")
        cfg = res.config
        stages = stage_configs(cfg)
        assert all(r <= SMOKE_ROUNDS for _, r, _ in stages) and (stages or cfg.server.rounds <= SMOKE_ROUNDS)
        assert cfg.train.steps == SMOKE_STEPS and cfg.seed == (read_toml(example).get("sweep", {}).get("seeds") or [0])[0]
        assert res.history[-1]["round"] == cfg.server.rounds
        assert any(k.startswith("test/") for k in res.history[-1]), "no evaluation after the last round"
        status = json.loads((res.run_dir / "status.json").read_text())
        assert status["round"] == cfg.server.rounds


def test_smoke_shrinks_every_stage_and_component_and_refuses_stop_after():
    raw = read_toml(EXAMPLES[0].parent / "ladd.toml")
    specs = expand(raw, "ladd.toml", smoke=True)
    assert len(specs) == len(raw["variants"])  # every variant, one seed
    for spec in specs:
        assert spec.run_dir.parts[:2] == ("runs", "smoke")
        plan = stage_configs(spec.config)
        assert [r for _, r, _ in plan] == [1, 2, 2] and spec.config.server.rounds == 5
        assert spec.config.eval.every == 5
        source = [c for _, _, scfg in plan for c in scfg.recipe.components if c.name == "source_pretrain"]
        assert source and all((c.steps, c.steps_per_round) == (2, 2) for c in source)
    (fed3r,) = expand(read_toml(EXAMPLES[0].parent / "fed3r.toml"), "fed3r.toml", smoke=True, only=["fedavg"])
    assert fed3r.config.pretrain.epochs == 1
    with pytest.raises(ConfigError, match="^smoke with stop_after"):
        fedsight.run(EXAMPLES[0].parent / "quickstart.toml", smoke=True, stop_after=1)


def test_smoke_caps_a_single_variant_in_a_fresh_process():
    """``--variant X --smoke`` in a new process: the parts' smoke values are read before any config is validated (a
    shrink that ran before the registry was loaded left LADD's source_pretrain at 3000 steps, so theta^0 never
    came and the adaptation stage failed)."""
    import subprocess
    import sys

    code = ("from fedsight.sweep import load; from fedsight.config import stage_configs\n"
            "(s,) = load('examples/ladd.toml', only=['ladd_cls'], smoke=True)\n"
            "print([(c.steps, c.steps_per_round) for _, _, cfg in stage_configs(s.config)"
            " for c in cfg.recipe.components if c.name == 'source_pretrain'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=EXAMPLES[0].parents[1], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[(2, 2)]"
