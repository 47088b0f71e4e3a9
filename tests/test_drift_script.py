"""``benchmarks/drift.py``: the table of one run under several CPU-kernel settings, read from the run directories
(``--print-only``), with their provenance; the ``fedsight run`` command of each setting. Run directories are
written as the engine writes them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture()
def drift(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import drift

    yield drift
    sys.modules.pop("drift", None)


def _run(out: Path, setting: str, rows: list[dict], *, state: str = "complete", capability: str = "AVX512",
         name: str = "quickstart/fedavg/seed0") -> Path:
    d = out / setting / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"seed": 0, "run": {"name": "fedavg"}}))
    (d / "status.json").write_text(json.dumps({"state": state, "round": 4, "rounds": 4}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"stage": "federated", **r}) + "\n" for r in rows)
                                     + json.dumps({"event": "note", "round": 4}) + "\n")
    session = {"command": ["fedsight", "run", "examples/quickstart.toml", "--set", f"run.output_dir=out/{setting}"],
               "git": {"fedsight": {"commit": "abcdef0123456789"}}, "torch": "2.13.0+cpu", "python": "3.11.7",
               "device": "cpu", "threads": 1, "machine": {"cpu": "Test CPU", "cpu_capability": capability}}
    (d / "run.json").write_text(json.dumps({"format": 1, "primary": "test/acc", "metrics": {}, "sessions": [session]}))
    return d


def _rows(**change: tuple[int, str, float]) -> list[dict]:
    """Round 0 (the initial model) and 4 rounds, evaluated at 0, 2 and 4; ``change``: (round, key, new value)."""
    rows = [{"round": 0, "test/acc": 0.1, "test/loss": 2.3, "time/eval_s": 0.5}]
    for r in range(1, 5):
        row = {"round": r, "train/loss": 2.0 - r / 10, "time/round_s": 1.0 + r}
        if r % 2 == 0:
            row.update({"test/acc": 0.5 + r / 10, "test/loss": 1.0 - r / 10})
        rows.append(row)
    for r, key, value in change.values():
        rows[r][key] = value
    return rows


def test_print_only_tables_each_setting_against_native_from_the_run_directories(tmp_path, drift, capsys):
    out = tmp_path / "out"
    _run(out, "native", _rows())
    again = _rows()
    again[3]["time/round_s"] = 9.0  # wall-clock time differs between any two runs: not a difference
    _run(out, "native_again", again)
    # a first difference in round 1's training loss, a larger one at the final evaluation
    _run(out, "avx2", _rows(a=(1, "train/loss", 1.9 + 2e-7), b=(4, "test/acc", 0.9 + 0.0028),
                            c=(4, "test/loss", 0.6 - 3.3e-4)), capability="AVX2")
    _run(out, "default", _rows(a=(0, "test/loss", 2.3 + 1e-6)), capability="DEFAULT")  # round 0 counts
    _run(out, "threads2", _rows(), state="running")
    assert drift.main(["--print-only", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0] == ("| kernels | final test/acc | final test/loss | largest gap to native over the 3 evaluations "
                        "| first round that differs |")
    assert lines[2] == "| native | 0.9 | 0.6 | (reference) | - |"
    assert lines[3] == "| native, run again | 0.9 | 0.6 | none: every metric of every round the same | none |"
    assert lines[4] == "| native, `engine.threads=2` | - | - | (run not complete) | - |"
    assert lines[5] == ("| `ATEN_CPU_CAPABILITY=avx2` | 0.9028 | 0.59967 | test/acc 0.0028, test/loss 0.00033 "
                        "| round 1 (train/loss: 2e-07) |")
    assert lines[6] == ("| `ATEN_CPU_CAPABILITY=default` | 0.9 | 0.6 | test/acc 0, test/loss 1e-06 "
                        "| round 0 (test/loss: 1e-06) |")
    prov = text[text.index("## Provenance"):]
    assert "of the 4 runs" in prov and "`abcdef012345`" in prov  # (the incomplete run is not in the table)
    assert "`Test CPU (cpu_capability AVX2)` (1 run)" in prov and "`Test CPU (cpu_capability DEFAULT)` (1 run)" in prov
    # one row per run of the reference (a config's variant, each grid point of it, under --smoke too), a column
    # per setting any of them ran
    other = tmp_path / "other"
    for point, acc in (("alpha=0.1", 0.9), ("alpha=1.0", 0.7)):
        _run(other, "native", _rows(a=(4, "test/acc", acc)), name=f"smoke/grid/a/{point}/seed0")
        _run(other, "avx2", _rows(a=(4, "test/acc", acc)), name=f"smoke/grid/a/{point}/seed0")
    assert drift.main(["--print-only", "--summary", "--out", str(out), "--out", str(other)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| run | evaluations | primary | native final | native_again: largest gap; "
                               "first round that differs | threads2: ")
    assert lines[2] == ("| quickstart/fedavg/seed0 | 3 | test/acc | 0.9 | the same values | (run not complete) | "
                        "0.0028; round 1 (train/loss: 2e-07) | 0; round 0 (test/loss: 1e-06) |")
    assert lines[3] == "| grid/a/alpha=0.1/seed0 | 3 | test/acc | 0.9 | - | - | the same values | - |"
    assert lines[4] == "| grid/a/alpha=1.0/seed0 | 3 | test/acc | 0.7 | - | - | the same values | - |"
    assert drift.main(["--print-only", "--out", str(out), "--out", str(other)]) == 2


def test_print_only_without_the_reference_run_is_one_line_and_prints_no_table(tmp_path, drift, capsys):
    _run(tmp_path, "avx2", _rows())
    assert drift.main(["--print-only", "--out", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and f"{tmp_path}: no run of the reference setting" in err
    assert drift.main(["examples/quickstart.toml", "--print-only", "--out", str(tmp_path)]) == 2
    assert "--print-only: give no config" in capsys.readouterr().err


def test_each_setting_runs_fedsight_with_its_seed_kernels_and_own_output_folder(tmp_path, drift, monkeypatch):
    swept = tmp_path / "s.toml"
    swept.write_text('[sweep]\nseeds = [0, 1]\n\n[[variants]]\nname = "a"\n')
    single = tmp_path / "c.toml"
    single.write_text("seed = 0\n")
    cmd = drift.command(swept, tmp_path / "o", "threads2", "a", 3, ["server.rounds=6"], True)
    assert cmd == ["fedsight", "run", str(swept), "--variant", "a", "--smoke", "--set", "sweep.seeds=[3]", "--set",
                   "server.rounds=6", "--set", "engine.threads=2", "--set", f"run.output_dir={tmp_path / 'o' / 'threads2'}"]
    assert drift.command(single, tmp_path, "native", None, 3, [], False)[3:5] == ["--set", "seed=3"]
    assert drift.first_variant(swept) == "a" and drift.first_variant(single) is None
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert "ATEN_CPU_CAPABILITY" not in drift.environment("native")
    assert {k: drift.environment("avx2_all")[k] for k in drift.KERNEL_VARS} == {
        "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert drift.environment("default")["ATEN_CPU_CAPABILITY"] == "default"
    assert drift.main([str(single), "--settings", "avx2", "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()
