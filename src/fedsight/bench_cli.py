"""``fedsight bench``: prints the engines' speed and memory ratios measured in one run (``fedsight.bench``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from . import bench as B
from .cli_common import guard
from .errors import ConfigError
from .safe_write import atomic_write_text, check_output

console = Console(highlight=False)


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _speed_table(title: str, rows: list[B.Row]) -> Table:
    base = next((r for r in rows if r.engine == "sequential engine" and r.threads == 1), None)
    table = Table(title=title, title_justify="left")
    for col in ("engine", "threads", "s/round", "updates/s", "× seq", "note"):
        table.add_column(col, justify="left" if col in ("engine", "note") else "right")
    for r in rows:
        ratio = r.updates_per_s / base.updates_per_s if r.updates_per_s and base and base.updates_per_s else None
        table.add_row(r.engine.replace(" engine", ""), str(r.threads or "—"), _fmt(r.seconds, ".3f"), _fmt(r.updates_per_s, ".1f"),
                      _fmt(ratio, ".2f"), r.note)
    return table


def wide_threads(rows: list[dict[str, Any]]) -> int:
    return max(r["threads"] for r in rows)


def _ranks_table(title: str, rows: list[dict[str, Any]]) -> Table:
    """``--nproc``: one row per (ranks, threads a rank); "efficiency": updates/s over ranks x one rank's at one
    thread; "× 1 rank": against one rank with as many threads as the most ranks have in all."""
    table = Table(title=title, title_justify="left")
    for col in ("ranks", "threads/rank", "s/round", "updates/s", "efficiency", f"× 1 rank × {wide_threads(rows)} thr"):
        table.add_column(col, justify="right")
    wide = next(r for r in rows if r["ranks"] == 1 and r["threads"] > 1) if len(rows) > 1 else rows[0]
    for r in rows:
        table.add_row(str(r["ranks"]), str(r["threads"]), _fmt(r["seconds"], ".3f"), _fmt(r["updates_per_s"], ".1f"),
                      _fmt(r["efficiency"], ".2f"), _fmt(r["updates_per_s"] / wide["updates_per_s"], ".2f"))
    return table


def bench(
    workload: Annotated[list[str], typer.Option("--workload", "-w", help="cnn (small CNN on digits), sr (small RDSN), or a paper's model: paper-cls, paper-seg, paper-sr, paper-vsr, paper-pose; repeatable")] = ["cnn", "sr"],  # noqa: B006
    clients: Annotated[int | None, typer.Option(min=1, help="clients per round (all clients train every round); default: 50 for cnn, 20 for sr, 4 for paper-*")] = None,
    rounds: Annotated[int, typer.Option(min=2, help="timed rounds per engine and thread count (after one warm-up round)")] = 5,
    device: Annotated[str, typer.Option(help='"auto" (CUDA when available), "cpu", "cuda" or "cuda:N"')] = "auto",
    flower: Annotated[bool, typer.Option(help="also time Flower's Ray simulation engine (needs flwr)")] = True,
    memory: Annotated[bool, typer.Option(help="also measure peak RSS over MEMORY_CLIENTS clients (SCAFFOLD)")] = True,
    memory_clients: Annotated[str, typer.Option(help="comma-separated client counts of the memory runs")] = "100,10000,100000",
    memory_rounds: Annotated[int, typer.Option(min=1, help="rounds of each memory run (50 clients a round)")] = 20,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write every measurement to this JSON file")] = None,
    force: Annotated[bool, typer.Option(help="Replace an existing --json file.")] = False,
    nproc: Annotated[int, typer.Option(min=1, help="also time the distributed backend on 1..NPROC ranks (vectorised)")] = 1,
) -> None:
    """Seconds per round and client updates/s of a plain PyTorch loop, the sequential and the vectorised engine (one
    thread and all cores) and Flower's simulation engine on the same workload, as ratios measured in one run; then
    the peak memory of a stateful recipe as the number of clients grows. "updates/s": client updates per second;
    "× seq": against the sequential engine at one thread."""
    unknown = [w for w in workload if w not in B.WORKLOADS]
    if unknown:
        raise ConfigError(f"--workload {unknown[0]!r}: expected one of {', '.join(B.WORKLOADS)}")
    try:
        counts = [int(c) for c in memory_clients.split(",")]
    except ValueError:
        raise ConfigError(f"--memory-clients {memory_clients!r}: expected comma-separated integers") from None
    if any(c < 1 for c in counts):
        raise ConfigError(f"--memory-clients {memory_clients!r}: every count must be >= 1")
    if json_out is not None:  # refused before minutes of measuring, not after
        json_out = guard(check_output, json_out, "--json", force=force)
    threads = sorted({1, os.cpu_count() or 1})
    results: dict[str, Any] = {"device": device, "threads": threads, "workloads": {}}
    for name in workload:
        title, build, default_clients = B.WORKLOADS[name]
        m = default_clients if clients is None else clients
        raw = build(m, rounds)
        rows = B.time_engines(raw, rounds, threads, device)
        if flower:
            rows.append(B.time_flower(raw, rounds + 2))
        console.print(_speed_table(f"{title}: {m} clients a round, {rounds} timed rounds, device {device}", rows))
        results["workloads"][name] = [{**vars(r), "updates_per_s": r.updates_per_s} for r in rows]
        if nproc > 1:
            from .distributed.bench import time_ranks

            ranked = time_ranks(raw, rounds, nproc, device)
            console.print(_ranks_table(f"{title}: {m} clients a round on 1..{nproc} ranks, vectorised, device {device}",
                                       ranked))
            results.setdefault("ranks", {})[name] = ranked
    if memory:
        mem = B.peak_rss(counts, memory_rounds, 50)
        table = Table(title=f"peak RSS, SCAFFOLD (state on disk), {memory_rounds} rounds x 50 clients", title_justify="left")
        for col in ("clients", "peak RSS MB", f"× {counts[0]} clients", "clients holding state", "s"):
            table.add_column(col, justify="right")
        for r in mem:
            table.add_row(f"{r['clients']:,}", f"{r['peak_rss_mb']:.1f}", f"{r['peak_rss_mb'] / mem[0]['peak_rss_mb']:.3f}",
                          f"{r['with_state']:,}", f"{r['seconds']:.1f}")
        console.print(table)
        results["memory"] = mem
    if json_out is not None:
        atomic_write_text(json_out, json.dumps(results, indent=2) + "\n")
