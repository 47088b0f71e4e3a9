"""A run whose rounds were skipped (every update non-finite, or too few left) still completes, and says so:
``status.json`` keeps state "complete" (what every reader of it takes as finished) and lists the skipped
rounds with their cause; ``summary.md`` has a line "N of R rounds were skipped (cause): rounds ..."."""

from __future__ import annotations

import json
import re

from fedsight.api import execute
from fedsight.config import validate
from fedsight.runs import read_status

from helpers import poisoned_config


def _skipped_line(summary: str) -> str:
    [line] = [x for x in summary.splitlines() if "rounds were skipped" in x]
    return line


def test_in_process_run_with_non_finite_rounds_says_which_were_skipped(tmp_path):
    raw, poisoned = poisoned_config()
    rounds = raw["server"]["rounds"]
    out = execute(validate(raw), tmp_path / "r")
    assert out.status == "complete"
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    # the engine's own record: nothing aggregated in exactly the poisoned rounds, every rejection non-finite
    assert [r["round"] for r in rows if "event" not in r and r["clients/aggregated"] == 0] == poisoned
    assert {r["round"] for r in rows if r.get("event") == "rejected_update"} == set(poisoned)
    status = read_status(tmp_path / "r")  # the run directory's own reader accepts it
    assert (status["state"], status["round"], status["rounds"]) == ("complete", rounds, rounds)
    assert status["skipped_rounds"] == poisoned
    assert status["skipped_causes"] == {"non-finite updates": poisoned}
    line = _skipped_line((tmp_path / "r" / "summary.md").read_text())
    assert re.search(rf"\b{len(poisoned)} of {rounds} rounds were skipped \(non-finite updates\): rounds "
                     rf"{', '.join(map(str, poisoned))}$", line), line
    # `fedsight run` again: a complete run, so it is skipped, not trained again
    assert execute(validate(raw), tmp_path / "r").status == "skipped"


def test_a_run_without_skipped_rounds_has_no_skip_entries(tmp_path):
    raw, _ = poisoned_config()
    raw["stages"][1].pop("recipe")  # the same stages, no attack
    execute(validate(raw), tmp_path / "r")
    assert set(read_status(tmp_path / "r")) == {"state", "round", "rounds"}
    assert "skipped" not in (tmp_path / "r" / "summary.md").read_text()


def test_causes_of_skipped_rounds_are_read_from_their_rounds_events():
    from fedsight.reporting.summary import skipped_status

    records = [
        {"round": 1, "event": "rejected_update", "client": 0, "reason": "delta 'w' has non-finite values"},
        {"round": 1, "event": "rejected_update", "client": 1, "reason": "non-finite values"},
        {"round": 1, "event": "round_skipped", "reason": "no valid client update"},
        {"round": 1, "clients/aggregated": 0},
        {"round": 2, "event": "client_lost", "client": 0, "reason": "no reply"},
        {"round": 2, "event": "too_few_clients", "accepted": 1, "min_clients": 2},
        {"round": 2, "event": "round_skipped", "reason": "no valid client update"},
        {"round": 3, "event": "rejected_update", "client": 2, "reason": "non-finite values"},  # the others aggregated
        {"round": 4, "event": "round_skipped", "reason": "no valid client update"},  # no reason recorded
    ]
    assert skipped_status(records) == {
        "skipped_rounds": [1, 2, 4],
        "skipped_causes": {"non-finite updates": [1], "lost clients, too few clients": [2], "no valid client update": [4]},
    }
    assert skipped_status([r for r in records if r["round"] == 3]) == {}
