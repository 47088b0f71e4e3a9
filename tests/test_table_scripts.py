"""The docs' table scripts (``examples/*_table.py``) print each comparison with its paired 95% CI and verdict, and
the commit, command and machine of the runs behind it. Run directories are written as the engine writes them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from scipy import stats

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(autouse=True)
def _scripts_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def _run(root: Path, variant: str, seed: int, miou: float) -> None:
    d = root / variant / f"seed{seed}"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"seed": seed, "run": {"name": variant}}))
    (d / "status.json").write_text(json.dumps({"state": "complete", "round": 5, "rounds": 5}))
    rows = [{"round": 1, "stage": "source", "test/miou": 0.1},
            {"round": 5, "stage": "adapt", "test/miou": miou, "test/loss": 1.5}]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    session = {"command": ["fedsight", "run", "examples/ladd.toml"], "git": {"fedsight": {"commit": "abcdef0123456"}},
               "torch": "2.13.0+cpu", "python": "3.11.7", "device": "cpu", "threads": 1,
               "machine": {"cpu": "Test CPU", "cpu_capability": "AVX2", "blas": "mkl"}}
    (d / "run.json").write_text(json.dumps({"format": 1, "metrics": {}, "sessions": [session]}))


def test_ladd_table_prints_paired_cis_against_fedavg_st_and_the_provenance(tmp_path, capsys):
    import ladd_table

    base = {0: 0.20, 1: 0.22, 2: 0.25}
    kd = {0: 0.23, 1: 0.26, 2: 0.27}
    for seed in base:
        _run(tmp_path, "fedavg_st", seed, base[seed])
        _run(tmp_path, "st_kd", seed, kd[seed])
    _run(tmp_path, "ladd_cls", 0, 0.3)  # one seed: no interval
    for seed in base:
        _run(tmp_path, "st_kd_running", seed, kd[seed] - 0.01 * (seed + 1))
    ladd_table.main(tmp_path)
    out = capsys.readouterr().out
    diffs = [100 * (kd[s] - base[s]) for s in base]
    lo, hi = stats.ttest_rel([100 * kd[s] for s in base], [100 * base[s] for s in base]).confidence_interval()
    mean = sum(diffs) / 3
    assert f"| ✓ | ✓ | ✓ | ✗ | ✗ | {mean:+.1f} [{lo:+.1f}, {hi:+.1f}] better (n=3) |" in out
    assert "| ✓ | ✓ | ✓ | ✓ | ✓ | +10.0 (n=1, no interval) |" in out
    # mIoU and test loss by length, the losses paired by seed (the one common seed: no interval)
    assert "| 60 | 22.3 ± 2.5 | 30.0 | 1.50 ± 0.00 | 1.50 | +0.00 (n=1, no interval) | 3 / 1 |" in out
    lo, hi = stats.ttest_rel([-1.0, -2.0, -3.0], [0.0] * 3).confidence_interval()
    assert f"| ST + KD | 23.3 ± 1.2 | 25.3 ± 2.1 | -2.0 [{lo:+.1f}, {hi:+.1f}] within noise (n=3) | 3 / 3 |" in out
    assert "| LADD (cls) | 30.0 |" not in out  # no running twin: no row
    # a run against its own source-only model (the end of its source stage, 10% in every fixture run)
    lo, hi = stats.ttest_rel([100 * base[s] for s in base], [10.0] * 3).confidence_interval()
    mean = sum(100 * v - 10 for v in base.values()) / 3
    assert f"| self-training after FDA - its source-only model | {mean:+.1f} [{lo:+.1f}, {hi:+.1f}] better (n=3) |" in out
    assert "| LADD (cls) - its source-only model | +20.0 (n=1, no interval) |" in out
    # the fixture's one adaptation evaluation is also its last
    assert "| FedAvg + self-training: final - first adaptation evaluation | +0.0 [+0.0, +0.0] within noise (n=3) |" in out
    assert "LADD (all)" not in out.split("other comparisons")[1]  # no runs: no row
    prov = out[out.index("## Provenance"):]
    assert "of the 10 runs" in prov and "`abcdef012345`" in prov and "Test CPU (cpu_capability AVX2, blas mkl)" in prov
    assert "`fedsight run examples/ladd.toml`" in prov


def test_feddrive_table_compares_heterogeneous_rows_with_heterogeneous_fedavg(tmp_path, capsys):
    import feddrive_table

    for seed, (a, b, c) in enumerate([(0.10, 0.12, 0.30), (0.14, 0.13, 0.33), (0.12, 0.15, 0.31)]):
        for variant, v in (("het_fedavg", a), ("het_fedadam", b), ("het_silobn", b)):
            _run(tmp_path, variant, seed, v)
            path = tmp_path / variant / f"seed{seed}" / "metrics.jsonl"
            path.write_text(json.dumps({"round": 5, "test/miou": v, "test_unseen/miou": v / 2}) + "\n")
        # SiloBN's final checkpoint already evaluated with statistics by domain (read back, not re-evaluated)
        row = {"set": {"recipe.sharing.test_stats": "domain"}, "test/miou": c}
        (tmp_path / "het_silobn" / f"seed{seed}" / "evaluations.jsonl").write_text(json.dumps(row) + "\n")
    feddrive_table.main(tmp_path)
    out = capsys.readouterr().out
    lo, hi = stats.ttest_rel([12, 13, 15], [10, 14, 12]).confidence_interval()
    assert f"| FedAdam | - | " in out and f"+1.3 [{lo:+.1f}, {hi:+.1f}] within noise (n=3) |" in out
    lo, hi = stats.ttest_rel([30, 33, 31], [10, 14, 12]).confidence_interval()
    assert f"| SiloBN by domain - heterogeneous FedAvg, seen | +19.3 [{lo:+.1f}, {hi:+.1f}] better (n=3) |" in out
    assert "| SiloBN | - | 6.7 ± 0.8 | 13.3 ± 1.5 | 31.3 ± 1.5 | 3 |" in out
    assert "uniform" not in out.split("other comparisons")[1]  # no uniform runs: no row
    assert "## Provenance" in out and "of the 9 runs" in out
    assert sys.modules["feddrive_table"].ci_cell({0: 1.0}, {1: 1.0}) == "- (no common seed)"


SIZES = ["64x48", "96x72", "160x120"]  # the lowest rungs and one unseen size; "test" is the top rung 128x96


def _pose_run(root: Path, variant: str, seed: int, pckh: dict[str, float], rungs: list[int] | None = None) -> None:
    """A keypoint run as the engine writes it: ``test/pckh`` at the top rung, ``test_<H>x<W>/pckh`` at the others."""
    _run(root, variant, seed, 0.0)
    d = root / variant / f"seed{seed}"
    task = {"name": "keypoints", "ladder": [[128, 96], [96, 72], [64, 48]], "client_rungs": rungs}
    (d / "config.json").write_text(json.dumps({"seed": seed, "run": {"name": variant}, "task": task}))
    row = {"round": 100, "test/pckh": pckh["128x96"], **{f"test_{s}/pckh": pckh[s] for s in SIZES}}
    (d / "metrics.jsonl").write_text(json.dumps({"round": 20, "test/pckh": 0.0}) + "\n" + json.dumps(row) + "\n")


def test_raf_ablations_table_prints_each_experiment_with_paired_cis(tmp_path, capsys):
    import raf_ablations_table

    low = {0: 10.0, 1: 12.0, 2: 11.0}  # drift_lll at 64x48
    drift = {0: 8.0, 1: 11.5, 2: 9.0}  # drift_lhh at 64x48
    for seed in low:
        _pose_run(tmp_path, "drift_lll", seed, {"64x48": low[seed], "96x72": 5, "128x96": 4, "160x120": 3})
        _pose_run(tmp_path, "drift_lhh", seed, {"64x48": drift[seed], "96x72": 6, "128x96": 7, "160x120": 8})
        _pose_run(tmp_path, "cl_high", seed, {"64x48": 1.0 + seed, "96x72": 2, "128x96": 3, "160x120": 4}, [0])
        _pose_run(tmp_path, "cl_kd_high", seed, {"64x48": 5.0 + 2 * seed, "96x72": 2, "128x96": 3, "160x120": 4},
                  [0])
        _pose_run(tmp_path, "allhigh_fedavg", seed, {"64x48": 2.0, "96x72": 3, "128x96": 4, "160x120": 5})
        _pose_run(tmp_path, "allhigh_raf_fedavg", seed, {"64x48": 12.0, "96x72": 3, "128x96": 4, "160x120": 5})
        _pose_run(tmp_path / "raf", "raf_fedavg", seed, {"64x48": 20.0 - seed, "96x72": 2, "128x96": 3,
                                                          "160x120": 4})
    assert raf_ablations_table.main([str(tmp_path), "--raf", str(tmp_path / "raf")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    lo, hi = stats.ttest_rel(list(drift.values()), list(low.values())).confidence_interval()
    mean = sum(drift[s] - low[s] for s in low) / 3
    # Table I: columns lowest first, unseen sizes starred, the paper's number, the gain over (low, low, low)
    assert ("| clients (paper's heights) | 64x48 | 96x72 | 128x96 | 160x120 * | paper at 128x96 | gain at 64x48 "
            "| seeds |") in lines
    assert f"| 128 / 256 / 256 | 9.5 ± 1.8 | 6.0 ± 0.0 | 7.0 ± 0.0 | 8.0 ± 0.0 | 51.3 | " \
           f"{mean:+.1f} [{lo:+.1f}, {hi:+.1f}] within noise (n=3) | 3 |" in lines
    assert "| 128 / 128 / 128 | 11.0 ± 1.0 | 5.0 ± 0.0 | 4.0 ± 0.0 | 3.0 ± 0.0 | 52.8 | - | 3 |" in lines
    # Fig. 8: CL+KD - CL is +4 + seed: [4, 5, 6]; RAF - CL is 19 - 2 seed: [19, 17, 15]
    lo, hi = stats.ttest_rel([5, 7, 9], [1, 2, 3]).confidence_interval()
    assert f"| CL+KD - CL | +5.0 [{lo:+.1f}, {hi:+.1f}] better (n=3) | +0.0 [+0.0, +0.0] within noise (n=3)" in out
    assert "| HML (RAF), raf.toml's raf_fedavg | 19.0 ± 1.0 |" in out and "| RAF - CL | +17.0 [" in out
    assert "4 clients all at 128x96" in out and "| FedAvg + RAF | 12.0 ± 0.0 | 3.0 ± 0.0 |" in out
    assert "| gain of RAF | +10.0 [+10.0, +10.0] better (n=3) | +0.0 [+0.0, +0.0] within noise (n=3) |" in out
    assert "mid client" not in out  # experiments with no run are left out
    assert "of the 21 runs" in out[out.index("## Provenance"):]
    assert raf_ablations_table.main([str(tmp_path / "none")]) == 2
    assert raf_ablations_table.main([str(tmp_path / "raf")]) == 1  # a folder without this sweep's runs


def test_raf_table_compares_rows_and_unseen_sizes_paired_by_seed(tmp_path, capsys):
    """raf_table.py's comparisons across rows: FedProx - FedAvg and one-high - 3-client at every size, and each run
    at an unseen size minus itself at the top rung (the ladder's sizes get "-")."""
    import raf_table

    fedavg = {0: 30.0, 1: 32.0, 2: 31.0}
    fedprox = {0: 20.0, 1: 23.0, 2: 21.0}
    for seed in fedavg:
        _pose_run(tmp_path, "fedavg", seed, {"64x48": 25, "96x72": 28, "128x96": fedavg[seed], "160x120": fedavg[seed] + 1})
        _pose_run(tmp_path, "fedprox", seed, {"64x48": 20, "96x72": 22, "128x96": fedprox[seed],
                                              "160x120": fedprox[seed] - seed})
        _pose_run(tmp_path, "fedprox_mu1e4", seed, {"64x48": 26, "96x72": 28, "128x96": 31, "160x120": 32})
    assert raf_table.table_ii_comparisons(tmp_path)
    lines = capsys.readouterr().out.splitlines()
    assert "| comparison | 64x48 | 96x72 | 128x96 | 160x120 * |" in lines
    lo, hi = stats.ttest_rel(list(fedprox.values()), list(fedavg.values())).confidence_interval()
    row = next(line for line in lines if line.startswith("| FedProx - FedAvg |")).split(" | ")
    assert row[1].startswith("-5.0 [") and row[2].startswith("-6.0 [")  # constant differences at 64x48 and 96x72
    assert row[3] == f"-9.7 [{lo:+.1f}, {hi:+.1f}] worse (n=3)"
    assert "| FedAvg: unseen - 128x96 | - | - | - | +1.0 [+1.0, +1.0] better (n=3) |" in lines
    row = next(line for line in lines if line.startswith("| FedProx, mu 1e-4 - FedAvg |")).split(" | ")
    assert row[1] == "+1.0 [+1.0, +1.0] better (n=3)" and row[3].startswith("+0.0 [")
    lo, hi = stats.ttest_rel([20, 22, 19], [20, 23, 21]).confidence_interval()
    assert f"| FedProx: unseen - 128x96 | - | - | - | -1.0 [{lo:+.1f}, {hi:+.1f}] within noise (n=3) |" in lines
    assert not any(line.startswith("| 1 high + n low") for line in lines)  # no one-high runs: no such rows
    assert not raf_table.table_ii_comparisons(tmp_path / "fedavg")


def test_ppfl_table_iv_sets_dct_dp_against_fedavg_paired_by_seed(tmp_path, capsys):
    import ppfl_table

    base = {0: 27.10, 1: 27.15, 2: 27.20}
    dct = {0: 26.50, 1: 26.70, 2: 26.55}
    for seed in base:
        for variant, psnr, comps in (("fedavg", base[seed], []),
                                     ("fedavg_dct_e2.75", dct[seed], [{"name": "dct_dp", "c_max": 10.0}])):
            _run(tmp_path, f"{variant}/scale=2", seed, 0.0)
            d = tmp_path / variant / "scale=2" / f"seed{seed}"
            (d / "config.json").write_text(json.dumps({"seed": seed, "data": {"test_sets": {"photos": ["a"]}},
                                                       "recipe": {"components": comps}}))
            priv = {"privacy/dct_epsilon": 2.75, "privacy/dct_delta": 1e-5, "privacy/dct_sigma": 35.2,
                    "privacy/dct_passes": 1.25} if comps else {}
            rows = [{"round": 1, **priv}, {"round": 2, "test/psnr_y": psnr, "test/ssim_y": 0.8, **priv}]
            (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert ppfl_table.table_iv(tmp_path, ["2"])
    out = capsys.readouterr().out
    lo, hi = stats.ttest_rel(list(base.values()), list(dct.values())).confidence_interval()
    mean = sum(base[s] - dct[s] for s in base) / 3
    assert "**Table IV**" in out
    assert "| x2 | FedAvg (no DP) | 27.15 ± 0.05 | 0.800 ± 0.000 | - | - | - | - | - | - | - | 3 |" in out
    assert (f"| x2 | FedAvg + DCT-DP | 26.58 ± 0.10 | 0.800 ± 0.000 | 2.75 ± 0.00 | 1e-05 | 35.2 ± 0.0 | 10 | 8 | "
            f"2.5 ± 0.0 | {mean:+.2f} [{lo:+.2f}, {hi:+.2f}] better (n=3) | 3 |") in out
    for name in ("fedavg_dct_e8_tau22", "fedavg_dct_e1_tau22", "fedavg_dct_e8", "fedavg_dct_e8_tau16", "other"):
        (tmp_path / "order" / name).mkdir(parents=True)
    assert ppfl_table.dct_variants(tmp_path / "order") == ["fedavg_dct_e1_tau22", "fedavg_dct_e8", "fedavg_dct_e8_tau16",
                                                          "fedavg_dct_e8_tau22"]
    assert not ppfl_table.table_iv(tmp_path / "fedavg", ["2"])  # no DCT-DP variant: no table
    for seed, psnr in {0: 27.50, 1: 27.40, 2: 27.60}.items():  # Table I: the centralised model's gap to FedAvg
        d = tmp_path / "centralised" / "scale=2" / f"seed{seed}"
        d.mkdir(parents=True)
        (d / "status.json").write_text(json.dumps({"state": "complete"}))
        (d / "config.json").write_text(json.dumps({"seed": seed, "data": {"test_sets": {"photos": ["a"]}}}))
        (d / "metrics.jsonl").write_text(json.dumps({"round": 2, "test/psnr_y": psnr, "test/ssim_y": 0.9}) + "\n")
    capsys.readouterr()
    assert ppfl_table.table_i(tmp_path, ["2"])
    out = capsys.readouterr().out
    lo, hi = stats.ttest_rel([27.50, 27.40, 27.60], list(base.values())).confidence_interval()
    assert f"| x2 | FedAvg (FL-RDSN) | 27.15 ± 0.05 | 0.800 ± 0.000 | +0.35 [{lo:+.2f}, {hi:+.2f}] better (n=3) | 3 |" in out
    assert "| x2 | centralised (RDSN) | 27.50 ± 0.10 | 0.900 ± 0.000 | - | 3 |" in out


def test_fed3r_table_prints_both_sweeps_and_the_paired_comparisons(tmp_path, capsys):
    import fed3r_table

    def run(root, variant, seed, acc, wma):
        d = root / variant / f"seed{seed}"
        d.mkdir(parents=True)
        (d / "status.json").write_text(json.dumps({"state": "complete"}))
        (d / "config.json").write_text(json.dumps({"seed": seed}))
        row = {"round": 30, "test/acc": acc, "local/wma": wma, "local/worst10": wma / 2, "cost/total_up_bytes": 1e6,
               "cost/total_down_bytes": 2e6, "cost/total_flops": 3e9}
        (d / "metrics.jsonl").write_text(json.dumps({"round": 1, "test/acc": 0.0}) + "\n" + json.dumps(row) + "\n")

    for seed, (a, b) in enumerate([(0.60, 0.90), (0.70, 0.93), (0.65, 0.95)]):
        run(tmp_path / "fed3r", "fedavg", seed, a, a)
        run(tmp_path / "fed3r", "fed3r", seed, b, b)
        run(tmp_path / "personalized", "fedavg+fedsim_psi", seed, a, b)
    assert fed3r_table.main([str(tmp_path / "fed3r"), str(tmp_path / "personalized")]) == 0
    out = capsys.readouterr().out
    assert "| fedavg | 30 | 65.0 ± 5.0 | 65.0 ± 5.0 | 32.5 ± 2.5 | 3.00 | 3.00 | 3 |" in out
    assert "| fedavg+fedsim_psi | 30 | 65.0 ± 5.0 | 92.7 ± 2.5 |" in out
    from fedsight.reporting import paired_difference

    d = paired_difference({0: 90.0, 1: 93.0, 2: 95.0}, {0: 60.0, 1: 70.0, 2: 65.0}, True)
    assert f"| test/acc | fed3r | fedavg | {d.mean:+.1f} [{d.ci[0]:+.1f}, {d.ci[1]:+.1f}] better (n=3) |" in out
    assert "## Provenance" in out
    assert fed3r_table.main([str(tmp_path / "nope"), str(tmp_path / "personalized")]) == 2


def test_baselines_table_compares_every_method_with_fedavg_paired_by_seed(tmp_path, capsys):
    import baselines_table

    for variant, accs in (("fedavg", [0.80, 0.82, 0.78]), ("fedavgm", [0.90, 0.95, 0.91]), ("krum", [0.3, 0.2, 0.25])):
        for seed, acc in enumerate(accs):
            d = tmp_path / variant / f"seed{seed}"
            d.mkdir(parents=True)
            (d / "status.json").write_text(json.dumps({"state": "complete"}))
            (d / "config.json").write_text(json.dumps({"seed": seed}))
            row = {"round": 40, "test/acc": acc, "local/wma": acc, "local/worst10": acc / 2,
                   "cost/total_up_bytes": 1e6, "cost/total_down_bytes": 1e6, "cost/total_flops": 1e9}
            (d / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    assert baselines_table.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| fedavgm | 40 | 92.0 ± 2.6 |" in out and "| krum | 40 | 25.0 ± 5.0 |" in out
    assert out.index("| fedavgm | fedavg | +") < out.index("| krum | fedavg | -")  # the config's order
    assert "| fedavg | fedavg |" not in out and "better (n=3)" in out and "worse (n=3)" in out
    assert baselines_table.main([str(tmp_path / "none")]) == 2


def test_fedvsr_table_pairs_each_method_with_fedavg_on_its_own_partition(tmp_path, capsys):
    import fedvsr_table

    def run(variant, part, seed, psnr):
        d = tmp_path / variant / part / f"seed{seed}"
        d.mkdir(parents=True)
        (d / "status.json").write_text(json.dumps({"state": "complete"}))
        (d / "config.json").write_text(json.dumps({"seed": seed}))
        row = {"round": 20, "test/psnr_y": psnr, "test/ssim_y": psnr / 40, "test/psnr_rgb": psnr - 1,
               "test/ssim_rgb": psnr / 50}
        (d / "metrics.jsonl").write_text(json.dumps({"round": 0, "test/psnr_y": 1.0}) + "\n" + json.dumps(row) + "\n")

    for seed, (a, b, c) in enumerate([(24.0, 24.5, 23.0), (24.2, 24.6, 23.1), (24.1, 24.8, 23.3)]):
        run("fedavg", "name=iid", seed, a)
        run("fedavg_gla", "name=iid", seed, b)
        run("fedavg", "name=classes", seed, c)  # another partition: never FedAvg's iid baseline
        run("fedavg_gla", "name=classes", seed, c)
    assert fedvsr_table.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| FedAvg | iid | 24.10 ± 0.10 |" in out and "| FedAvg | one photo per client | 23.13 ± 0.15 |" in out
    from fedsight.reporting import paired_difference

    d = paired_difference({0: 24.5, 1: 24.6, 2: 24.8}, {0: 24.0, 1: 24.2, 2: 24.1}, True)
    assert f"| fedavg_gla | fedavg | iid | {d.mean:+.2f} [{d.ci[0]:+.2f}, {d.ci[1]:+.2f}] better (n=3) |" in out
    assert "| fedavg_gla | fedavg | one photo per client | +0.00" in out
    assert "| fedavg, one photo per client | fedavg, iid | (paired by seed) | -0.97" in out
    assert fedvsr_table.main([str(tmp_path / "none")]) == 2
