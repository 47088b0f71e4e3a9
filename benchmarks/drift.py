"""How far one run drifts across CPU kernels: a config's variant at a seed run under this machine's native
kernels twice, with two threads, and with torch / oneDNN / MKL lowered to another CPU's kernels (the emulation
docs/guarantees.md's "How far two CPUs drift, measured" describes), each as its own ``fedsight run`` process; then the table of
those runs, read from their run directories, with their provenance (``fedsight.reporting.provenance``).

Settings (each a folder of OUT; every run is ``fedsight run CONFIG --variant V --set run.output_dir=OUT/<setting>``
plus the seed and the ``--set`` / ``--smoke`` given here):

    native        this machine's kernels (no ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS)
    native_again  the same, a second time (bit-identical files are the expected result)
    threads2      native, --set engine.threads=2
    avx2          ATEN_CPU_CAPABILITY=avx2 (torch's own kernels at AVX2)
    avx2_all      the same + ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 (an AVX2-only CPU)
    default       ATEN_CPU_CAPABILITY=default (torch's scalar kernels)

The table compares each setting's run with ``native``'s over the metrics lines of ``metrics.jsonl`` (every
``time/*`` key left out: wall-clock time differs between any two runs): the final value of the primary metric
(``run.json``) and of ``test/loss`` where logged, the largest difference to ``native`` of each over the
evaluations both runs logged (round 0, the initial model, counts like any other), and the first round at which any
metric differs (its key and the difference), or "none: every metric of every round the same". A variant with a
grid gives a run per grid point, each compared with ``native``'s run of that point. A run that is not complete
(``status.json``) is listed as such, not compared.

    python benchmarks/drift.py examples/quickstart.toml --variant fedavg --seed 0 --out runs/drift
    python benchmarks/drift.py examples/raf.toml --smoke --settings native,avx2_all,default --out runs/drift_raf
    python benchmarks/drift.py --print-only --out runs/drift      # the table from existing run directories
    python benchmarks/drift.py --print-only --summary --out runs/drift_raf --out runs/drift_ladd   # one row each

Running again with the same OUT resumes unfinished runs and skips finished ones (``fedsight run``'s rule).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

#: variables that choose the kernels; every setting starts from an environment without them
KERNEL_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
AVX2_ALL = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
#: name -> (label in the table, environment, extra overrides)
SETTINGS: dict[str, tuple[str, dict[str, str], list[str]]] = {
    "native": ("native", {}, []),
    "native_again": ("native, run again", {}, []),
    "threads2": ("native, `engine.threads=2`", {}, ["engine.threads=2"]),
    "avx2": ("`ATEN_CPU_CAPABILITY=avx2`", {"ATEN_CPU_CAPABILITY": "avx2"}, []),
    "avx2_all": ("`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`", AVX2_ALL, []),
    "default": ("`ATEN_CPU_CAPABILITY=default`", {"ATEN_CPU_CAPABILITY": "default"}, []),
}
REFERENCE = "native"
LOSS = "test/loss"


class DriftError(Exception):
    """Bad input or a run that failed: one line for the user."""


def overrides_for(config: Path, seed: int) -> list[str]:
    """The ``--set`` of ``seed``: ``sweep.seeds=[seed]`` where the config sweeps seeds, else ``seed=seed``."""
    try:
        raw = tomllib.loads(config.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise DriftError(f"{config}: cannot read the config ({exc})") from None
    sweep = raw.get("sweep")
    return [f"sweep.seeds=[{seed}]" if isinstance(sweep, dict) and "seeds" in sweep else f"seed={seed}"]


def command(config: Path, out: Path, setting: str, variant: str | None, seed: int, sets: list[str],
            smoke: bool) -> list[str]:
    """The ``fedsight run`` command line of one setting."""
    cmd = ["fedsight", "run", str(config)]
    if variant:
        cmd += ["--variant", variant]
    if smoke:
        cmd.append("--smoke")
    for s in [*overrides_for(config, seed), *sets, *SETTINGS[setting][2], f"run.output_dir={out / setting}"]:
        cmd += ["--set", s]
    return cmd


def environment(setting: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_VARS}
    env.update(SETTINGS[setting][1])
    return env


def run_setting(cmd: list[str], setting: str) -> None:
    env = environment(setting)
    shown = " ".join(f"{k}={v}" for k, v in SETTINGS[setting][1].items())
    print(f"[{setting}] {shown + ' ' if shown else ''}{shlex.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise DriftError(f"setting {setting}: `{shlex.join(cmd)}` exited {proc.returncode}: {tail[0]}")


# -- reading the run directories -----------------------------------------------------------------------------

def runs_in(out: Path, setting: str) -> dict[str, Path]:
    """The run directories under ``out/setting`` (folders holding ``config.json`` and ``metrics.jsonl``) by their
    path below it without ``smoke`` (``quickstart/fedavg/seed0``; a grid point is a folder of its own): the same
    key under two settings is the same run of the config."""
    base = out / setting
    if not base.is_dir():
        return {}
    found = sorted(p.parent for p in base.rglob("config.json") if (p.parent / "metrics.jsonl").is_file())
    return {"/".join(x for x in p.relative_to(base).parts if x != "smoke"): p for p in found}


def rows_of(path: Path) -> dict[int, dict[str, float]]:
    """The run's metrics lines by round (the last line of a round wins, as everywhere in FedSight), their numeric
    values without ``time/*``."""
    from fedsight.runs import read_metrics

    out: dict[int, dict[str, float]] = {}
    for rec in read_metrics(path):
        if "event" in rec:
            continue
        out[rec["round"]] = {k: float(v) for k, v in rec.items()
                             if k not in ("round", "stage") and not k.startswith("time/")
                             and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return out


def complete(path: Path) -> bool:
    from fedsight.runs import read_status

    return read_status(path).get("state") == "complete"


def primary_of(path: Path) -> str:
    from fedsight.runs import read_run_meta

    meta = read_run_meta(path) or {}
    primary = meta.get("primary")
    if not isinstance(primary, str):
        raise DriftError(f"{path / 'run.json'}: no primary metric recorded")
    return primary


def evaluations(rows: dict[int, dict[str, float]], key: str) -> dict[int, float]:
    return {r: row[key] for r, row in sorted(rows.items()) if key in row}


def final(rows: dict[int, dict[str, float]], key: str) -> float | None:
    ev = evaluations(rows, key)
    return ev[max(ev)] if ev else None


def largest_gap(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]], key: str) -> tuple[float, int]:
    """The largest |a - b| of ``key`` over the rounds both evaluated it, and how many those are."""
    ea, eb = evaluations(a, key), evaluations(b, key)
    common = sorted(ea.keys() & eb.keys())
    gaps = [abs(ea[r] - eb[r]) if math.isfinite(ea[r]) and math.isfinite(eb[r]) else math.inf for r in common
            if not (ea[r] == eb[r] or (math.isnan(ea[r]) and math.isnan(eb[r])))]
    return (max(gaps) if gaps else 0.0), len(common)


def first_difference(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]]) -> tuple[int, str, float] | None:
    """The first round at which any metric of the two runs differs (a key only one of them logged counts):
    (round, the key with the largest difference there, that difference); None for the same values throughout."""
    for r in sorted(a.keys() | b.keys()):
        ra, rb = a.get(r, {}), b.get(r, {})
        diffs = {}
        for k in sorted(ra.keys() | rb.keys()):
            x, y = ra.get(k), rb.get(k)
            if x is None or y is None:
                diffs[k] = math.inf
            elif not (x == y or (math.isnan(x) and math.isnan(y))):
                diffs[k] = abs(x - y)
        if diffs:
            k = max(diffs, key=lambda key: diffs[key])
            return r, k, diffs[k]
    return None


def fmt(v: float | None, digits: int = 6) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}g}" if v != 0 else "0"


def _reference(out: Path) -> dict[str, Path]:
    refs = runs_in(out, REFERENCE)
    if not refs:
        raise DriftError(f"{out}: no run of the reference setting ({out / REFERENCE}); run the script without "
                         "--print-only first")
    for path in refs.values():
        if not complete(path):
            raise DriftError(f"{path}: the reference run is not complete; run the script again to finish it")
    return refs


def _versus(ref: dict[int, dict[str, float]], path: Path, keys: list[str]) -> tuple[str, str]:
    """(largest gap of each of ``keys``, first round that differs) of the run at ``path`` against ``ref``."""
    rows = rows_of(path)
    first = first_difference(ref, rows)
    if first is None:
        return "none: every metric of every round the same", "none"
    gap = ", ".join(f"{k} {fmt(largest_gap(ref, rows, k)[0], 2)}" for k in keys)
    return gap, f"round {first[0]} ({first[1]}: {fmt(first[2], 2)})"


def table(out: Path) -> tuple[list[str], list[Path]]:
    """The Markdown table of the settings found under ``out`` (a block of rows per run of the reference: each
    grid point of a config with a grid) and their run directories (complete runs only)."""
    refs = _reference(out)
    first_ref = rows_of(next(iter(refs.values())))
    primary = primary_of(next(iter(refs.values())))
    keys = [primary] + ([LOSS] if LOSS != primary and final(first_ref, LOSS) is not None else [])
    n_eval = len(evaluations(first_ref, primary))
    lines = [f"| {'run, ' if len(refs) > 1 else ''}kernels | {' | '.join(f'final {k}' for k in keys)} | largest gap "
             f"to native over the {n_eval} evaluation{'s' if n_eval != 1 else ''} | first round that differs |",
             "|---|" + "---|" * len(keys) + "---|---|"]
    found = {setting: runs_in(out, setting) for setting in SETTINGS}
    dirs = []
    for name, ref_path in refs.items():
        ref = rows_of(ref_path)
        where = f"{name}: " if len(refs) > 1 else ""
        for setting, (label, _, _) in SETTINGS.items():
            path = found[setting].get(name)
            if path is None:
                continue
            if not complete(path):
                lines.append(f"| {where}{label} | " + " | ".join("-" for _ in keys) + " | (run not complete) | - |")
                continue
            dirs.append(path)
            finals = " | ".join(fmt(final(rows_of(path), k)) for k in keys)
            gap, first = ("(reference)", "-") if setting == REFERENCE else _versus(ref, path, keys)
            lines.append(f"| {where}{label} | {finals} | {gap} | {first} |")
    return lines, dirs


def summary(outs: list[Path]) -> tuple[list[str], list[Path]]:
    """One row per run of the reference under each OUT (a config's variant, each grid point): its primary
    metric's final value under ``native`` and, for each other setting run there, the largest difference of that
    metric over the evaluations and the first round at which any metric differs; and the run directories
    (complete runs only)."""
    others = [s for s in SETTINGS if s != REFERENCE and any(runs_in(o, s) for o in outs)]
    lines = ["| run | evaluations | primary | native final | "
             + " | ".join(f"{s}: largest gap; first round that differs" for s in others) + " |",
             "|---|---:|---|---:|" + "---|" * len(others)]
    dirs = []
    for out in outs:
        found = {s: runs_in(out, s) for s in others}
        for name, ref_path in _reference(out).items():
            dirs.append(ref_path)
            ref, primary = rows_of(ref_path), primary_of(ref_path)
            cells = []
            for setting in others:
                path = found[setting].get(name)
                if path is None or not complete(path):
                    cells.append("-" if path is None else "(run not complete)")
                    continue
                dirs.append(path)
                rows = rows_of(path)
                first = first_difference(ref, rows)
                cells.append("the same values" if first is None else
                             f"{fmt(largest_gap(ref, rows, primary)[0], 2)}; round {first[0]} ({first[1]}: "
                             f"{fmt(first[2], 2)})")
            lines.append(f"| {name} | {len(evaluations(ref, primary))} | {primary} | {fmt(final(ref, primary))} | "
                         f"{' | '.join(cells)} |")
    return lines, dirs


def print_table(outs: list[Path], compact: bool = False) -> None:
    from fedsight.reporting import provenance

    if len(outs) > 1 and not compact:
        raise DriftError("--out: give one folder, or several with --summary")
    lines, dirs = summary(outs) if compact else table(outs[0])
    print("\n".join(lines))
    print()
    print(provenance(dirs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", type=Path, help="the TOML config (not with --print-only)")
    ap.add_argument("--out", type=Path, required=True, action="append",
                    help="folder of the settings' output folders (with --print-only --summary: several)")
    ap.add_argument("--variant", help="the variant to run (default: the config's first, or the config itself)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for every setting's run (repeatable), e.g. server.rounds=6")
    ap.add_argument("--smoke", action="store_true", help="fedsight run --smoke (a short run of the variant)")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help=f"comma-separated settings to run (default: all: {','.join(SETTINGS)})")
    ap.add_argument("--print-only", action="store_true", help="print the table from the run directories under "
                    "--out; run nothing")
    ap.add_argument("--summary", action="store_true", help="with --print-only: one row per --out (a config's "
                    "variant) instead of one per setting")
    args = ap.parse_args(argv)
    try:
        if args.print_only:
            if args.config is not None:
                raise DriftError("--print-only: give no config (the table is read from --out)")
            print_table(args.out, args.summary)
            return 0
        if args.config is None:
            raise DriftError("config: give the TOML config to run (or --print-only)")
        if len(args.out) > 1 or args.summary:
            raise DriftError("--out: a run takes one folder (several, and --summary, only with --print-only)")
        out = args.out[0]
        settings = [s.strip() for s in args.settings.split(",") if s.strip()]
        unknown = [s for s in settings if s not in SETTINGS]
        if unknown or REFERENCE not in settings:
            raise DriftError(f"--settings: {', '.join(unknown) or 'the list'} "
                             f"{'is not a setting' if unknown else f'needs {REFERENCE!r}'}; choose from "
                             f"{', '.join(SETTINGS)}")
        if not args.config.is_file():
            raise DriftError(f"config: {args.config} is not a file")
        variant = args.variant or first_variant(args.config)
        for setting in settings:
            run_setting(command(args.config, out, setting, variant, args.seed, args.sets, args.smoke), setting)
        print(f"`{shlex.join(['python', 'benchmarks/drift.py', *(sys.argv[1:] if argv is None else argv)])}`\n")
        print_table([out])
    except DriftError as exc:
        print(f"drift.py: {exc}", file=sys.stderr)
        return 2
    return 0


def first_variant(config: Path) -> str | None:
    """The config's first variant's name, None for a config without variants."""
    try:
        raw = tomllib.loads(config.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise DriftError(f"{config}: cannot read the config ({exc})") from None
    variants = raw.get("variants")
    if isinstance(variants, list) and variants and isinstance(variants[0], dict):
        name = variants[0].get("name")
        return name if isinstance(name, str) else None
    return None


if __name__ == "__main__":
    sys.exit(main())
