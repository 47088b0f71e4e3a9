"""On Flower too, a run whose rounds were skipped for non-finite updates completes and says so in
``status.json`` and ``summary.md`` (the nodes run the attack; the ServerApp rejects their updates)."""

from __future__ import annotations

import json
import re

import pytest

from fedsight.config import validate
from fedsight.runs import read_status

from flower_direct import run_direct
from helpers import poisoned_config

pytestmark = pytest.mark.flower


def test_flower_run_with_non_finite_rounds_says_which_were_skipped(tmp_path):
    raw, poisoned = poisoned_config()
    rounds = raw["server"]["rounds"]
    run_direct(validate(raw), tmp_path / "run", tmp_path / "nodes")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows if "event" not in r and r["clients/aggregated"] == 0] == poisoned
    status = read_status(tmp_path / "run")
    assert (status["state"], status["round"], status["rounds"]) == ("complete", rounds, rounds)
    assert status["skipped_rounds"] == poisoned and status["skipped_causes"] == {"non-finite updates": poisoned}
    [line] = [x for x in (tmp_path / "run" / "summary.md").read_text().splitlines() if "rounds were skipped" in x]
    assert re.search(rf"\b{len(poisoned)} of {rounds} rounds were skipped \(non-finite updates\): rounds "
                     rf"{', '.join(map(str, poisoned))}$", line), line
