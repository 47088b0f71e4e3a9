"""The PPFL-RDSN tables of docs/image_sr.md from the runs of ``examples/ppfl_rdsn.toml``, in the layout of the paper's
Tables I-III (He & Joshi; digest ``notes/001_ppfl_rdsn.md`` section 4). Every value is a mean ± sample std
over the complete runs (seeds; n in the last column) of a variant at one scale (``RUN_ROOT/<variant>/
scale=<s>/seed<k>``); PSNR (dB) and SSIM on BT.601 Y with a scale-sized border crop, per test set.

* Table I: centralised RDSN vs FedAvg (FL-RDSN), final round.
* Table II: FedAvg vs FedAvg + DP-SGD (PPFL-RDSN), FedAvg + DP + watermark and, when the sweep has it, FedAvg
  rounds followed by DP fine-tuning rounds (``fedavg_dp_ft``, the paper's protocol), with each run's epsilon (the
  largest over its clients, ``privacy/epsilon_max`` of the last row) at delta, and the PSNR drop vs FedAvg
  (FedAvg minus the variant, paired by seed: same partition and initial model). Runs whose clients refused a
  received global model (the watermark check) are counted below the table.
* Table III (x4 first, then x2): the final global models of ``fedavg`` (vanilla) and ``fedavg_dp_wm`` loaded
  from ``model.safetensors`` and evaluated clean and after each attack of the paper's Table III: +FT
  (``--ft-steps`` Adam steps at the run's ``train.lr`` on client 0's training data, task loss only: no
  watermark term, no DP), +Prune (70 % global magnitude pruning of the weights) and +Noise (Gaussian weight
  noise N(0, 1e-3) read as a variance, std 0.0316, seeded by the run's seed). Then the watermark score S of
  every model against the key and parameters of the ``fedavg_dp_wm`` run of the same scale and seed, with
  how many runs accept (S > threshold): the marked models should be accepted, the vanilla ones (never marked)
  rejected (their acceptances are false positives).
* Table IV: FedAvg vs FedAvg + the paper's DCT-domain local DP (Algorithm 1, ``dct_dp``) at each epsilon the sweep
  and band threshold the sweep has (variants ``fedavg_dct_e<epsilon>``, ``fedavg_dct_e<epsilon>_tau<tau>``), with
  the mechanism's single-release epsilon, delta, sigma, C_max and tau (noise on the DCT band u + v >= tau),
  the noised releases per example over the run, and the PSNR drop vs FedAvg paired by seed with its 95% CI.

    python examples/ppfl_table.py runs/ppfl_rdsn                 # Tables I-IV (III runs the attacks)
    python examples/ppfl_table.py runs/ppfl_rdsn --ft-steps 300
    python examples/ppfl_table.py runs/ppfl_rdsn --no-attacks    # Tables I, II and IV

Variants or scales without a complete run are left out (a table with none is omitted).
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from feddrive_table import ci_cell, complete_runs, print_provenance

CONDITIONS = [("clean", "clean"), ("ft", "+FT"), ("prune", "+Prune"), ("noise", "+Noise")]
PRUNE_FRACTION = 0.7
TABLE_I = [("centralised", "centralised (RDSN)"), ("fedavg", "FedAvg (FL-RDSN)")]
TABLE_II = [("fedavg", "FedAvg (FL-RDSN)"), ("fedavg_dp", "FedAvg + DP (PPFL-RDSN)"),
            ("fedavg_dp_wm", "FedAvg + DP + WM"), ("fedavg_dp_ft", "FedAvg, then DP fine-tuning")]
TABLE_III = [("fedavg", "vanilla"), ("fedavg_dp_wm", "PPFL + WM")]


# ---------------------------------------------------------------------------------------- run files


def scales(root: Path) -> list[str]:
    """The grid's scale labels found under any variant (``<variant>/scale=<s>``), in numeric order."""
    found = {p.name.split("=", 1)[1] for p in root.glob("*/scale=*") if p.is_dir()}
    return sorted(found, key=lambda s: (float(s) if re.fullmatch(r"[0-9]+(\.[0-9]+)?", s) else float("inf"), s))


def runs_of(root: Path, variant: str, scale: str) -> list[Path]:
    return complete_runs(root / variant, f"scale={scale}")


def rows(run: Path) -> list[dict[str, Any]]:
    from fedsight.runs import read_metrics

    return read_metrics(run)


def last(run: Path, key: str) -> dict[str, Any]:
    """The last metrics row of ``run`` holding ``key`` (empty if none)."""
    return next((r for r in reversed(rows(run)) if key in r and "event" not in r), {})


def config(run: Path) -> dict[str, Any]:
    from fedsight.runs import read_config

    return read_config(run)


def test_sets(run: Path) -> list[tuple[str, str]]:
    """(evaluation split, test set name) of a run: ``test`` is the data's first test set, ``test_<name>`` the
    others (``fedsight.tasks.image_sr``)."""
    names = config(run).get("data", {}).get("test_sets") or {}
    names = list(names) if isinstance(names, (dict, list)) else []
    splits = [k[: -len("/psnr_y")] for k in last(run, "test/psnr_y") if k.startswith("test") and k.endswith("/psnr_y")]
    label = {"test": names[0]} if names else {}
    return [(s, label.get(s, s.removeprefix("test_"))) for s in splits]


def component(cfg: dict[str, Any], name: str) -> dict[str, Any] | None:
    for c in cfg.get("recipe", {}).get("components", []):
        if isinstance(c, dict) and c.get("name") == name:
            return {k: v for k, v in c.items() if k != "name"}
    return None


def refusals(run: Path) -> int:
    return sum(1 for r in rows(run) if r.get("event") == "model_refused")


# ---------------------------------------------------------------------------------------- formatting


def fmt(values: list[float], digits: int) -> str:
    """mean ± sample std (the mean alone for one value; "-" for none) at ``digits`` decimals (PSNR in dB needs
    two, SSIM three: ``feddrive_table.cell`` is a x100 one-decimal percentage, made for mIoU)."""
    if not values:
        return "-"
    m = statistics.mean(values)
    return f"{m:.{digits}f} ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else f"{m:.{digits}f}"


def metric_cells(runs: list[Path], splits: list[tuple[str, str]]) -> list[str]:
    out = []
    for split, _ in splits:
        finals = [last(r, f"{split}/psnr_y") for r in runs]
        out.append(fmt([f[f"{split}/psnr_y"] for f in finals], 2))
        out.append(fmt([f[f"{split}/ssim_y"] for f in finals], 3))
    return out


def by_seed(runs: list[Path]) -> dict[int, Path]:
    return {int(config(r).get("seed", 0)): r for r in runs}


def drops(base: list[Path], runs: list[Path], split: str) -> str:
    """PSNR(FedAvg) - PSNR(variant) over the seeds both have (paired): mean, 95% CI and verdict (``ci_cell``;
    "better" here means a larger drop)."""
    key = f"{split}/psnr_y"
    b = {s: last(r, key)[key] for s, r in by_seed(base).items()}
    v = {s: last(r, key)[key] for s, r in by_seed(runs).items()}
    return ci_cell(b, v, 2)


def header(cols: list[str], right: int) -> None:
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join(["---"] * (len(cols) - right) + ["---:"] * right) + "|")


# ---------------------------------------------------------------------------------------- Tables I, II


def first_splits(root: Path, variants: list[str], scale_list: list[str]) -> list[tuple[str, str]] | None:
    for s in scale_list:
        for v in variants:
            runs = runs_of(root, v, s)
            if runs:
                return test_sets(runs[0])
    return None


def table_i(root: Path, scale_list: list[str]) -> bool:
    splits = first_splits(root, [v for v, _ in TABLE_I], scale_list)
    if splits is None:
        return False
    print("**Table I**: centralised RDSN vs FedAvg (FL-RDSN), final round; PSNR (dB) / SSIM on Y, border = scale; "
          "gap = centralised - FedAvg PSNR, paired by seed: mean [95% CI] and verdict ('better': centralised higher).")
    print()
    cols = [*[f"{n} {m}" for _, n in splits for m in ("PSNR", "SSIM")], *[f"{n} PSNR gap" for _, n in splits], "seeds"]
    header(["scale", "method", *cols], len(cols))
    for s in scale_list:
        central = runs_of(root, "centralised", s)
        for variant, label in TABLE_I:
            runs = runs_of(root, variant, s)
            if runs:
                gap = [drops(central, runs, split) if central and variant != "centralised" else "-"
                       for split, _ in splits]
                print(f"| x{s} | {label} | {' | '.join(metric_cells(runs, splits))} | {' | '.join(gap)} | {len(runs)} |")
    print()
    return True


def table_ii(root: Path, scale_list: list[str]) -> bool:
    splits = first_splits(root, [v for v, _ in TABLE_II], scale_list)
    if splits is None:
        return False
    print("**Table II**: FedAvg vs FedAvg + DP-SGD (PPFL-RDSN), + watermark, and FedAvg then DP fine-tuning, final "
          "round; ε is the largest over the clients at δ; PSNR drop = FedAvg - variant, paired by seed: mean [95% CI] "
          "and whether the interval excludes 0 ('better': FedAvg higher).")
    print()
    cols = [*[f"{n} {m}" for _, n in splits for m in ("PSNR", "SSIM")], "ε", "δ",
            *[f"{n} PSNR drop" for _, n in splits], "seeds"]
    header(["scale", "method", *cols], len(cols))
    notes = []
    for s in scale_list:
        base = runs_of(root, "fedavg", s)
        for variant, label in TABLE_II:
            runs = runs_of(root, variant, s)
            if not runs:
                continue
            privacy = [last(r, "privacy/epsilon_max") for r in runs]
            eps = fmt([p["privacy/epsilon_max"] for p in privacy if p], 2)
            deltas = sorted({p["privacy/delta"] for p in privacy if "privacy/delta" in p})
            delta = ", ".join(f"{d:g}" for d in deltas) or "-"
            drop = [drops(base, runs, split) if base and variant != "fedavg" else "-" for split, _ in splits]
            print(f"| x{s} | {label} | {' | '.join(metric_cells(runs, splits))} | {eps} | {delta} | "
                  f"{' | '.join(drop)} | {len(runs)} |")
            refused = [refusals(r) for r in runs]
            if any(refused):
                notes.append(f"{label} x{s}: {sum(refused)} `model_refused` events "
                             f"({sum(1 for n in refused if n)} of {len(runs)} runs)")
    print()
    for n in notes:
        print(f"- {n}")
    if notes:
        print()
    return True


# ---------------------------------------------------------------------------------------- Table IV


DCT_VARIANT = re.compile(r"fedavg_dct_e(?P<eps>[0-9.]+)(?:_tau(?P<tau>[0-9]+))?")


def dct_variants(root: Path) -> list[str]:
    """The sweep's DCT-DP variants (``fedavg_dct_e<epsilon>``, ``fedavg_dct_e<epsilon>_tau<tau>``), by increasing
    epsilon, then tau (no ``_tau``: the example's 8, first)."""
    found = [(m, p.name) for p in root.iterdir() if p.is_dir() and (m := DCT_VARIANT.fullmatch(p.name))]

    def key(item: tuple[re.Match, str]) -> tuple[float, int, str]:
        m, name = item
        try:
            eps = float(m["eps"])
        except ValueError:
            eps = float("inf")
        return eps, int(m["tau"] or -1), name

    return [name for _, name in sorted(found, key=key)]


def total(run: Path, key: str) -> float | None:
    """The sum of ``key`` over the run's round rows (None when no row has it)."""
    vals = [r[key] for r in rows(run) if key in r and "event" not in r]
    return sum(vals) if vals else None


def table_iv(root: Path, scale_list: list[str]) -> bool:
    variants = dct_variants(root)
    splits = first_splits(root, ["fedavg", *variants], scale_list) if variants else None
    if splits is None or not any(runs_of(root, v, s) for v in variants for s in scale_list):
        return False
    print("**Table IV**: FedAvg vs FedAvg + DCT-domain local DP (the paper's Algorithm 1, `dct_dp`), final round; "
          "ε and σ are of ONE release of one example's high band at the layer (δ per release; no composition, the "
          "weights are not DP); releases = noised passes per example over the run (mean over clients, summed over "
          "rounds); PSNR drop = FedAvg - variant, paired by seed: mean [95% CI] and whether the interval excludes 0 "
          "('better': FedAvg higher).")
    print()
    cols = [*[f"{n} {m}" for _, n in splits for m in ("PSNR", "SSIM")], "ε", "δ", "σ", "C_max", "τ", "releases",
            *[f"{n} PSNR drop" for _, n in splits], "seeds"]
    header(["scale", "method", *cols], len(cols))
    for s in scale_list:
        base = runs_of(root, "fedavg", s)
        for variant in ["fedavg", *variants]:
            runs = runs_of(root, variant, s)
            if not runs:
                continue
            if variant == "fedavg":
                label, privacy, drop = "FedAvg (no DP)", ["-"] * 6, ["-"] * len(splits)
            else:
                label = "FedAvg + DCT-DP"
                last_rows = [last(r, "privacy/dct_epsilon") for r in runs]
                dct = component(config(runs[0]), "dct_dp") or {}
                releases = [t for t in (total(r, "privacy/dct_passes") for r in runs) if t is not None]
                privacy = [fmt([x["privacy/dct_epsilon"] for x in last_rows if x], 2),
                           ", ".join(sorted({f"{x['privacy/dct_delta']:g}" for x in last_rows if x})) or "-",
                           fmt([x["privacy/dct_sigma"] for x in last_rows if x], 1),
                           f"{dct.get('c_max', 1.0):g}", f"{dct.get('tau', 8):g}", fmt(releases, 1)]
                drop = [drops(base, runs, split) if base else "-" for split, _ in splits]
            print(f"| x{s} | {label} | {' | '.join(metric_cells(runs, splits))} | {' | '.join(privacy)} | "
                  f"{' | '.join(drop)} | {len(runs)} |")
    print()
    return True


# ---------------------------------------------------------------------------------------- Table III


class Tasks:
    """Tasks of the runs, built once per (data, partition, seed, ...) setting: the vanilla and watermarked
    runs of one scale and seed share theirs."""

    KEYS = ("seed", "data", "partition", "validation", "task", "model")

    def __init__(self) -> None:
        self.cache: dict[str, Any] = {}

    def get(self, run: Path, cfg: Any) -> Any:
        from fedsight.api import build_task

        raw = config(run)
        key = json.dumps({k: raw.get(k) for k in self.KEYS}, sort_keys=True)
        if key not in self.cache:
            self.cache.clear()  # one setting at a time (runs come grouped by scale, then seed)
            self.cache[key] = build_task(cfg)
        return self.cache[key]


def load_model(run: Path, cfg: Any, task: Any) -> Any:
    """The run's final global model: built as the simulation builds it (the task's model adapted by the
    recipe's components), then ``model.safetensors``."""
    from fedsight.api import build_stages
    from fedsight.engine.plan import build_models
    from fedsight.models import load_weights

    model = build_models(task, build_stages(cfg, task), cfg.seed, 1)[0]
    load_weights(model, run / "model.safetensors")
    return model.eval()


def fine_tune(model: Any, task: Any, run: Path, cfg: Any, steps: int) -> Any:
    """A copy of ``model`` after ``steps`` Adam steps (lr ``train.lr``, the run's ``local_adam`` betas) on
    batches of ``train.batch_size`` examples of client 0, task loss only; batches and crops are seeded from
    the run's seed."""
    import torch

    from fedsight.rng import seed_torch, torch_gen
    from fedsight.training.local import batch_positions

    model = copy.deepcopy(model)
    if steps <= 0:
        return model
    adam = component(config(run), "local_adam") or {}
    opt = torch.optim.Adam(model.parameters(), lr=cfg.train.lr, betas=(adam.get("beta1", 0.9), adam.get("beta2", 0.999)),
                           eps=adam.get("eps", 1e-8))
    gen = torch_gen(cfg.seed, "ppfl_table", "ft")
    seed_torch(cfg.seed, "ppfl_table", "ft-crops")  # train_batch's crops and flips
    model.train()
    for pos in batch_positions(task.num_train_examples(0), cfg.train.batch_size, steps, gen):
        x, y = task.train_batch(0, pos)
        opt.zero_grad(set_to_none=True)
        task.loss(model(x), y).backward()
        opt.step()
    return model.eval()


def attacked(model: Any, task: Any, run: Path, cfg: Any, ft_steps: int) -> dict[str, Any]:
    import torch

    from fedsight.functional.watermark import (
        add_weight_noise,
        paper_noise_std,
        prune_magnitude,
    )
    from fedsight.rng import torch_gen

    out = {"clean": model, "ft": fine_tune(model, task, run, cfg, ft_steps)}
    for name, state in (("prune", prune_magnitude(model, PRUNE_FRACTION)),
                        ("noise", add_weight_noise(model, paper_noise_std("variance"),
                                                   generator=torch_gen(cfg.seed, "ppfl_table", "noise")))):
        m = copy.deepcopy(model)
        with torch.no_grad():
            m.load_state_dict(state)
        out[name] = m.eval()
    return out


def wm_params(root: Path, scale: str, seed: int) -> dict[str, Any] | None:
    """The watermark parameters of the ``fedavg_dp_wm`` run of this scale and seed (complete or not)."""
    path = root / "fedavg_dp_wm" / f"scale={scale}" / f"seed{seed}"
    if not (path / "config.json").is_file():
        return None
    return component(config(path), "watermark")


def attack_run(root: Path, run: Path, scale: str, ft_steps: int, tasks: Tasks) -> dict[str, Any]:
    """{condition: {"psnr": {split: dB}, "wm": Verification or None}} of one run's final model."""
    from fedsight.api import load_run_config
    from fedsight.recipe.ppfl import run_watermark_secret, verify

    cfg = load_run_config(run)
    task = tasks.get(run, cfg)
    params = wm_params(root, scale, cfg.seed)
    # the clients' drawn key of a watermarked run under [privacy] noise = "secret" (none: key_file or the seed's)
    secret = run_watermark_secret(root / "fedavg_dp_wm" / f"scale={scale}" / f"seed{cfg.seed}")
    result = {}
    for cond, model in attacked(load_model(run, cfg, task), task, run, cfg, ft_steps).items():
        psnr = {split: task.evaluate(model, split)["psnr_y"] for split in task.test_splits}
        result[cond] = {"psnr": psnr, "wm": verify(model, params, seed=cfg.seed, secret=secret) if params is not None else None}
    return result


def table_iii(root: Path, scale_list: list[str], ft_steps: int) -> bool:
    import torch

    torch.set_num_threads(1)
    tasks = Tasks()
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    splits: list[tuple[str, str]] | None = None
    for s in sorted(scale_list, key=lambda x: x != "4"):  # x4 first, as the paper
        for variant, _ in TABLE_III:
            for run in runs_of(root, variant, s):
                print(f"attacks: {run}", file=sys.stderr)
                splits = splits or test_sets(run)
                results.setdefault((s, variant), []).append(attack_run(root, run, s, ft_steps, tasks))
    if not results or splits is None:
        return False
    order = [k for k in ((s, v) for s in sorted(scale_list, key=lambda x: x != "4") for v, _ in TABLE_III) if k in results]
    label = dict(TABLE_III)
    print(f"**Table III**: watermark robustness, PSNR (dB, Y) of the final global model clean and attacked: +FT = "
          f"{ft_steps} Adam steps on client 0's data (task loss only), +Prune = {PRUNE_FRACTION:.0%} global magnitude "
          f"pruning, +Noise = N(0, 1e-3) weight noise (variance).")
    print()
    header(["scale", "test set", "model", *[c for _, c in CONDITIONS], "seeds"], len(CONDITIONS) + 1)
    for s0 in dict.fromkeys(s for s, _ in order):
        for split, name in splits:  # the paper's layout: per benchmark, vanilla then watermarked
            for s, v in (k for k in order if k[0] == s0):
                res = results[(s, v)]
                cells = [fmt([r[c]["psnr"][split] for r in res], 2) for c, _ in CONDITIONS]
                print(f"| x{s} | {name} | {label[v]} | {' | '.join(cells)} | {len(res)} |")
    print()
    print("Watermark score S (mean ± std) and accepted runs (S > threshold), with the key and parameters of the "
          "watermarked run of the same scale and seed; vanilla acceptances are false positives.")
    print()
    header(["scale", "model", *[c for _, c in CONDITIONS], "threshold", "\\|J\\|", "seeds"], len(CONDITIONS) + 3)
    for s, v in order:
        res = [r for r in results[(s, v)] if r["clean"]["wm"] is not None]
        if not res:
            continue
        cells = []
        for c, _ in CONDITIONS:
            ver = [r[c]["wm"] for r in res]
            cells.append(f"{fmt([x.score for x in ver], 4)} ({sum(x.passed for x in ver)}/{len(ver)})")
        thr = sorted({r["clean"]["wm"].threshold for r in res})
        size = sorted({r["clean"]["wm"].carriers for r in res})
        print(f"| x{s} | {label[v]} | {' | '.join(cells)} | {', '.join(f'{t:g}' for t in thr)} | "
              f"{', '.join(map(str, size))} | {len(res)} |")
    print()
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path, nargs="?", default=Path("runs/ppfl_rdsn"), help="the sweep's run directory")
    ap.add_argument("--ft-steps", type=int, default=100, help="Adam steps of the +FT attack (default 100)")
    ap.add_argument("--no-attacks", action="store_true", help="skip Table III (loads models, runs the attacks)")
    args = ap.parse_args(argv)
    if not args.root.is_dir():
        print(f"ppfl_table: {args.root}: no such run directory (run examples/ppfl_rdsn.toml first)", file=sys.stderr)
        return 2
    if args.ft_steps < 0:
        ap.error("--ft-steps must be >= 0")
    scale_list = scales(args.root)
    shown = [table_i(args.root, scale_list), table_ii(args.root, scale_list)]
    if not args.no_attacks:
        shown.append(table_iii(args.root, scale_list, args.ft_steps))
    shown.append(table_iv(args.root, scale_list))
    if not any(shown):
        print(f"ppfl_table: no complete run under {args.root}/<variant>/scale=<s>/", file=sys.stderr)
    print_provenance(sorted(r for v in sorted({p.name for p in args.root.iterdir() if p.is_dir()}) for sc in scale_list
                            for r in runs_of(args.root, v, sc)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
