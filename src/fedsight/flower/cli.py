"""``fedsight flower ...``: FedSight runs on Flower (``flwr`` 1.41).

Wired into the main CLI as ``app.add_typer(flower_app, name="flower")``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape

from . import INSTALL

flower_app = typer.Typer(
    help="Run FedSight recipes on Flower: a Flower app for real SuperLink/SuperNode deployments, a loopback "
    "deployment, Flower's Ray simulation engine, TLS material.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@flower_app.callback()
def _require_flower() -> None:
    """Every flower command needs flwr: say how to get it instead of a traceback."""
    try:
        import flwr  # noqa: F401
        import flwr.app  # noqa: F401
    except ImportError:
        _fail(f"Flower is not installed: in your FedSight clone, {INSTALL} (flwr[simulation,dp] 1.41)")


# soft_wrap: a line is never broken at the console's width (80 columns off a terminal: a log file, a pipe, SLURM),
# so every progress line stays one line, whole, for grep and for the reader
console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def _say(text: str) -> None:
    """Plain text (paths, run names): never read as markup, never wrapped."""
    console.print(escape(text), highlight=False)

SetOpt = Annotated[Optional[list[str]], typer.Option("--set", "-s", help="Override a config value: key.path=value. Repeatable.")]
RunDirOpt = Annotated[Optional[Path], typer.Option(help="Run directory (default: the in-process run's, its name "
                                                        "followed by -flower-COMMAND).")]
RoundTimeout = Annotated[float, typer.Option(help="Seconds to wait for a round's replies; later ones count as lost.")]
MinClients = Annotated[int, typer.Option(min=1, help="Fewer accepted updates in a round: the round is not aggregated.")]
DpNoise = Annotated[float, typer.Option(min=0.0, help="Central DP noise multiplier z (0: off). Needs weighting 'uniform'.")]
DpClip = Annotated[float, typer.Option(min=0.0, help="Central DP clipping norm C of a client update.")]
DpDelta = Annotated[float, typer.Option(min=0.0, help="Central DP delta (0: min(1e-5, 1/(10 N))).")]
DpAccountant = Annotated[str, typer.Option(help="Central DP accountant: 'rdp' (Renyi DP, an upper bound) or 'pld' "
                                                "(privacy loss distribution, tight).")]
DpSampling = Annotated[str, typer.Option(help="Central DP sampling assumption: 'none' (no amplification) or "
                                              "'without-replacement' (amplification by FedSight's fixed-size sampling, "
                                              "replace-one neighbours; needs a secret seed).")]
Overwrite = Annotated[bool, typer.Option(help="Replace a run directory that already holds a run.")]
SecAgg = Annotated[bool, typer.Option("--secagg", help="Secure aggregation (Flower's SecAgg+): the server sees only the "
                                      "weighted mean of the updates. Needs aggregator 'mean', weighting 'uniform' or "
                                      "'data_size', 3+ clients a round.")]
SecAggShares = Annotated[float, typer.Option(help="SecAgg+ shares per secret: an integer >= 3 (the node and its "
                                                  "neighbours) or a fraction in (0, 1] of the sampled clients.")]
SecAggThreshold = Annotated[float, typer.Option(help="SecAgg+ shares that reconstruct a secret: an integer >= 2, below "
                                                     "--secagg-shares, or a fraction in (0, 1].")]
Provisioning = Annotated[Optional[Path], typer.Option(
    help="Provisioning file (JSON: partition id -> node public key; `fedsight flower certs DIR --node-keys N` writes "
    "DIR/provisioning.json): each client answers only from its provisioned node key. Needs node authentication. "
    "Without it, client identity is not authenticated.")]
SecAggClip = Annotated[float, typer.Option(help="SecAgg+ clipping range: each weighted update value is clipped to "
                                                "+-this before quantisation.")]
SecAggFeatureBound = Annotated[float, typer.Option(help="Fed3R/FedNCM under SecAgg+: the largest |feature value| "
                                                        "their sufficient statistics are scaled for.")]


def _fail(msg: str, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def flower_run_dir(in_process: Path, command: str) -> Path:
    """A Flower run's default directory: the in-process run's (``output_dir/run.name/seed<N>``) with
    ``-flower-<command>``, so that ``fedsight run``, ``flower simulate`` and ``flower local`` of one config
    never take each other's directory (each writes a whole run there; ``fedsight report`` compares them)."""
    return in_process.with_name(f"{in_process.name}-flower-{command}")


def _one_config(config: Path, sets: list[str] | None, run_dir: Path | None, command: str):
    from ..config import ConfigError
    from ..sweep import load

    try:
        specs = load(config, sets or [])
    except ConfigError as exc:
        _fail(str(exc))
    if len(specs) != 1:
        _fail(f"{config} defines {len(specs)} runs (a sweep); a Flower run takes one config (pick with --set)")
    spec = specs[0]
    return spec.config, (run_dir or flower_run_dir(spec.run_dir, command)).absolute()


#: run-config keys of the ServerApp -> the flags that set them
_FLAGS = {"round-timeout": "--round-timeout", "min-clients": "--min-clients", "dp-noise-multiplier": "--dp-noise",
          "dp-clipping-norm": "--dp-clip", "dp-delta": "--dp-delta", "dp-accountant": "--dp-accountant",
          "dp-sampling": "--dp-sampling", "secagg-num-shares": "--secagg-shares",
          "secagg-reconstruction-threshold": "--secagg-threshold", "secagg-clipping-range": "--secagg-clip",
          "secagg-feature-bound": "--secagg-feature-bound"}


def _flagged(msg: str) -> str:
    """A ServerApp check's message with the run-config keys it names ("key = value") as the CLI's flags."""
    for key, opt in _FLAGS.items():
        msg = re.sub(rf"(run config |(?<![\w-])){re.escape(key)} ", f"{opt} ", msg)
    return msg


def _options(cfg: Any, round_timeout: float, min_clients: int, dp_noise: float, dp_clip: float, dp_delta: float,
             overwrite: bool = False, dp_accountant: str = "rdp", dp_sampling: str = "none", secagg: bool = False,
             secagg_shares: float = 3, secagg_threshold: float = 2, secagg_clip: float = 8.0,
             provisioning: Path | None = None, secagg_feature_bound: float = 1024.0) -> dict[str, Any]:
    from .options import ServerOptions

    out: dict[str, Any] = {"round-timeout": round_timeout, "min-clients": min_clients, "overwrite": overwrite}
    if provisioning is not None:  # read and checked here (ServerOptions.checked_for), again by the ServerApp
        out["provisioning"] = str(provisioning.absolute())
    if secagg:
        from .secagg import count_or_fraction

        out.update({"secagg": True, "secagg-num-shares": count_or_fraction(secagg_shares),
                    "secagg-reconstruction-threshold": count_or_fraction(secagg_threshold), "secagg-clipping-range": secagg_clip,
                    "secagg-feature-bound": secagg_feature_bound})
    elif (secagg_shares, secagg_threshold, secagg_clip, secagg_feature_bound) != (3, 2, 8.0, 1024.0):
        _fail("--secagg-shares, --secagg-threshold, --secagg-clip and --secagg-feature-bound configure secure "
              "aggregation: add --secagg")
    if dp_noise != 0:
        if dp_clip <= 0:
            _fail("--dp-clip must be positive with --dp-noise")
        out.update({"dp-noise-multiplier": dp_noise, "dp-clipping-norm": dp_clip, "dp-delta": dp_delta,
                    "dp-accountant": dp_accountant, "dp-sampling": dp_sampling})
    try:  # the ServerApp's own checks of the options, before anything starts (the recipe's: _preflight)
        ServerOptions.from_run_config({"dp-accountant": dp_accountant, "dp-sampling": dp_sampling, **out,
                                       "run-dir": "."}).checked_for(cfg)
    except ValueError as exc:
        _fail(_flagged(str(exc)))
    if dp_noise == 0 and (dp_accountant, dp_sampling) != ("rdp", "none"):
        _fail("--dp-accountant and --dp-sampling account central DP: set --dp-noise > 0")
    return out


def _preflight(cfg: Any, opts: dict[str, Any], run_dir: Path, *, data_here: bool = True) -> None:
    """The recipe against the options (central DP's requirements), before anything is written or started.
    ``data_here=False`` (an app for other hosts): data this host lacks leaves those checks to the ServerApp,
    which runs them before it writes anything."""
    from ..errors import ConfigError
    from .options import preflight

    try:
        preflight(cfg, opts, run_dir)
    except ConfigError as exc:
        _fail(_flagged(str(exc)))
    except FileNotFoundError as exc:
        if data_here:
            _fail(str(exc), 1)
        err.print(f"note: the ServerApp checks the recipe against central DP at start (the data is not here: {exc})",
                  markup=False, highlight=False, soft_wrap=True)


def _identity_line(opts: dict[str, Any]) -> None:
    """One line on what binds a client to its node in the run (``provisioning.identity_note``)."""
    if opts.get("provisioning"):
        _say(f"client identity: each client answers only from the node key provisioned for it in {opts['provisioning']}")
    else:
        err.print("note: client identity is not authenticated (no --provisioning): any node the SuperLink admits may "
                  "answer for any client, and its update is aggregated as that client's, with full weight",
                  markup=False, highlight=False, soft_wrap=True)


def _check_free(run_dir: Path, overwrite: bool) -> None:
    if (run_dir / "config.json").is_file() and not overwrite:
        st = json.loads((run_dir / "status.json").read_text()) if (run_dir / "status.json").is_file() else {}
        if st.get("state") == "interrupted":
            _fail(f"{run_dir} holds a Flower run interrupted at round {st.get('round')} of {st.get('rounds')}; a Flower run "
                  "cannot be resumed: pass --overwrite to start it again (or --run-dir for another directory)")
        _fail(f"{run_dir} already holds a run; pass --overwrite to replace it or --run-dir for another directory")


def _row_text(row: dict[str, Any], keys: list[tuple[str, str]]) -> str:
    """One progress line: the round, its clients, ``keys`` (``api.progress_keys``) and DP's epsilon."""
    if "event" in row:
        what = {k: v for k, v in row.items() if k not in ("event", "stage")}
        return f"[yellow]{escape(str(row['event']))}[/] {escape(json.dumps(what))}"
    parts = [f"round {row.get('round')}", "initial model" if row.get("round") == 0 else
             f"{row.get('clients/aggregated', 0)}/{row.get('clients/sampled', 0)} clients"]
    for key, label in dict.fromkeys([*keys, ("dp/epsilon", "eps")]):  # (keys has it with [privacy.central_dp])
        if key in row:
            parts.append(f"{label} {row[key]:.4f}")
    if "time/round_s" in row:
        parts.append(f"{row['time/round_s']:.1f} s")
    return "  ".join(parts)


def _print_row(row: dict[str, Any], keys: list[tuple[str, str]], elapsed: float | None = None) -> None:
    """A progress line (``_row_text``), after the seconds since the start when ``elapsed`` is given; one line
    whatever its length (the consoles soft-wrap)."""
    head = f"[dim]{elapsed:7.1f} s[/]  " if elapsed is not None else ""
    console.print(head + _row_text(row, keys), highlight=False)


APP_MODULES = ("__init__.py", "server_app.py", "client_app.py")


def _guard_folder(directory: Path, files: Any, force: bool) -> None:
    """The output-path guard (``fedsight.safe_write``) on DIRECTORY and the files a command writes there."""
    from ..errors import OutputPathError
    from ..safe_write import check_output_folder

    try:
        check_output_folder(directory, "", files, force=force)
    except OutputPathError as exc:
        _fail(str(exc))


@flower_app.command("app")
def app_cmd(
    config: Annotated[Path, typer.Argument(help="FedSight TOML config (one run).")],
    directory: Annotated[Path, typer.Argument(help="Where to write the Flower app (pyproject.toml + fedsight_app/).")],
    set_: SetOpt = None,
    run_dir: RunDirOpt = None,
    round_timeout: RoundTimeout = 600.0,
    min_clients: MinClients = 1,
    dp_noise: DpNoise = 0.0,
    dp_clip: DpClip = 1.0,
    dp_delta: DpDelta = 0.0,
    dp_accountant: DpAccountant = "rdp",
    dp_sampling: DpSampling = "none",
    secagg: SecAgg = False,
    secagg_shares: SecAggShares = 3,
    secagg_threshold: SecAggThreshold = 2,
    secagg_clip: SecAggClip = 8.0,
    secagg_feature_bound: SecAggFeatureBound = 1024.0,
    data_dir_nodes: Annotated[bool, typer.Option("--data-dir-nodes", help="SuperNodes read their own data-dir (no partition.json).")] = False,
    overwrite: Overwrite = False,
    force: Annotated[bool, typer.Option(help="Replace the files of an app already in DIRECTORY.")] = False,
    provisioning: Provisioning = None,
) -> None:
    """Write a runnable Flower app for CONFIG: submit it with `flwr run DIR <connection>`."""
    from .app import PACKAGE, write_app

    _guard_folder(directory, ("pyproject.toml", "README.md", *(f"{PACKAGE}/{f}" for f in APP_MODULES)), force)
    cfg, rd = _one_config(config, set_, run_dir, "app")
    # a provisioning file that is here is checked now; one only on the SuperLink host, by the ServerApp at start
    here = provisioning is not None and (provisioning.exists() or provisioning.is_symlink())
    opts = _options(cfg, round_timeout, min_clients, dp_noise, dp_clip, dp_delta, overwrite, dp_accountant, dp_sampling,
                    secagg, secagg_shares, secagg_threshold, secagg_clip, provisioning if here else None,
                    secagg_feature_bound=secagg_feature_bound)
    if data_dir_nodes:
        opts["data"] = "data-dir"
    _preflight(cfg, opts, rd, data_here=False)
    if provisioning is not None and not here:
        opts["provisioning"] = str(provisioning.absolute())
        err.print(f"note: {provisioning.absolute()} is not here: the ServerApp reads and checks it on the SuperLink host "
                  "at start", markup=False, highlight=False, soft_wrap=True)
    _identity_line(opts)
    try:
        out = write_app(cfg, directory, run_dir=rd, options=opts)
    except ValueError as exc:
        _fail(str(exc))
    n = cfg.partition.num_clients
    _say(f"wrote the Flower app to {out}")
    _say(f"the ServerApp will write the run directory {rd} (on the SuperLink host)")
    _say(f"start {n} SuperNodes with --node-config 'partition-id=K num-partitions={n}' (K = 0..{n - 1}), then: "
         f"flwr run {out} <connection>")


@flower_app.command("local")
def local_cmd(
    config: Annotated[Path, typer.Argument(help="FedSight TOML config (one run).")],
    nodes: Annotated[Optional[int], typer.Option(min=1, help="SuperNodes to start (one per client: partition.num_clients).")] = None,
    set_: SetOpt = None,
    run_dir: RunDirOpt = None,
    round_timeout: RoundTimeout = 600.0,
    min_clients: MinClients = 1,
    timeout: Annotated[float, typer.Option(help="Give up (and stop the run) after this many seconds.")] = 24 * 3600.0,
    tls_dir: Annotated[Optional[Path], typer.Option(help="Serve with TLS; certificates are generated here if missing.")] = None,
    node_auth: Annotated[bool, typer.Option(help="SuperNode authentication: one ECDSA key per node, registered first.")] = False,
    data_dir: Annotated[Optional[list[Path]], typer.Option(help="Node K reads its own data from the K-th --data-dir.")] = None,
    workdir: Annotated[Optional[Path], typer.Option(help="Keep FLWR_HOME, logs and node state here (default: a temp dir, removed).")] = None,
    dp_noise: DpNoise = 0.0,
    dp_clip: DpClip = 1.0,
    dp_delta: DpDelta = 0.0,
    dp_accountant: DpAccountant = "rdp",
    dp_sampling: DpSampling = "none",
    secagg: SecAgg = False,
    secagg_shares: SecAggShares = 3,
    secagg_threshold: SecAggThreshold = 2,
    secagg_clip: SecAggClip = 8.0,
    secagg_feature_bound: SecAggFeatureBound = 1024.0,
    overwrite: Overwrite = False,
    provisioning: Provisioning = None,
) -> None:
    """Start a SuperLink and N SuperNodes on loopback, run CONFIG as a Flower app, stream progress,
    collect the FedSight run directory, and stop every process started. With --node-auth every client is
    bound to its node's key from the start: the keys and provisioning.json of `fedsight flower certs` in
    --tls-dir (made there if missing), or --provisioning."""
    from ..api import progress_keys
    from ..errors import ConfigError
    from .local import FlowerInterrupted, FlowerRunError, run_local

    if provisioning is not None and not node_auth:
        _fail(f"--provisioning {provisioning} binds clients to node keys: add --node-auth (SuperNodes without keys get "
              "temporary keys that no provisioning file lists)")
    cfg, rd = _one_config(config, set_, run_dir, "local")
    opts = _options(cfg, round_timeout, min_clients, dp_noise, dp_clip, dp_delta, overwrite, dp_accountant, dp_sampling,
                    secagg, secagg_shares, secagg_threshold, secagg_clip, provisioning,
                    secagg_feature_bound=secagg_feature_bound)
    _preflight(cfg, opts, rd)  # before the first line of progress (run_local checks again, for its Python callers)
    _check_free(rd, overwrite)
    if node_auth and not provisioning:  # run_local binds the nodes' keys (local.provision_local)
        where = tls_dir / "provisioning.json" if tls_dir is not None else "the work directory's keys/provisioning.json"
        _identity_line({"provisioning": str(where)})
    else:
        _identity_line(opts)
    t0 = time.monotonic()
    keys = progress_keys(cfg)

    def on_row(row: dict[str, Any], dep: Any) -> None:
        _print_row(row, keys, time.monotonic() - t0)

    _say(f"starting a SuperLink and {nodes or cfg.partition.num_clients} SuperNodes on 127.0.0.1 ...")
    try:
        final = run_local(cfg, rd, nodes=nodes, workdir=workdir, options=opts, timeout=timeout, on_row=on_row,
                          tls_dir=tls_dir, node_auth=node_auth, data_dirs=data_dir, keep_workdir=workdir is not None)
    except ConfigError as exc:  # run_local's preflight: nothing was started or written
        _fail(_flagged(str(exc)))
    except (FlowerRunError, ValueError, FileNotFoundError) as exc:
        _fail(str(exc), 1)
    except FlowerInterrupted as exc:  # the run stopped on the SuperLink first, then every process (local.run_local)
        err.print(f"interrupted: {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(130)
    _say(f"run {final['run-id']} {final['status']} in {time.monotonic() - t0:.1f} s; run directory: {rd}")
    _say(f"summary: {rd / 'summary.md'}")


@flower_app.command("simulate")
def simulate_cmd(
    config: Annotated[Path, typer.Argument(help="FedSight TOML config (one run).")],
    set_: SetOpt = None,
    run_dir: RunDirOpt = None,
    cpus_per_client: Annotated[float, typer.Option(min=0.0, help="Ray CPUs per client (client_resources.num_cpus).")] = 1.0,
    gpus_per_client: Annotated[float, typer.Option(min=0.0, help="Ray GPUs per client (client_resources.num_gpus).")] = 0.0,
    ray_cpus: Annotated[Optional[int], typer.Option(min=1, help="CPUs Ray may use (default: all).")] = None,
    min_clients: MinClients = 1,
    dp_noise: DpNoise = 0.0,
    dp_clip: DpClip = 1.0,
    dp_delta: DpDelta = 0.0,
    dp_accountant: DpAccountant = "rdp",
    dp_sampling: DpSampling = "none",
    secagg: SecAgg = False,
    secagg_shares: SecAggShares = 3,
    secagg_threshold: SecAggThreshold = 2,
    secagg_clip: SecAggClip = 8.0,
    secagg_feature_bound: SecAggFeatureBound = 1024.0,
    overwrite: Overwrite = False,
) -> None:
    """Run CONFIG on Flower's Ray-backed simulation engine (one virtual SuperNode per client)."""
    from ..api import progress_keys
    from ..errors import ConfigError
    from .simulation import flower_simulate

    cfg, rd = _one_config(config, set_, run_dir, "simulate")
    opts = _options(cfg, 600.0, min_clients, dp_noise, dp_clip, dp_delta, overwrite, dp_accountant, dp_sampling,
                    secagg, secagg_shares, secagg_threshold, secagg_clip,
                    secagg_feature_bound=secagg_feature_bound)
    _check_free(rd, overwrite)
    t0 = time.monotonic()
    try:
        out = flower_simulate(cfg, rd, num_cpus=cpus_per_client, num_gpus=gpus_per_client, ray_cpus=ray_cpus, options=opts)
    except ConfigError as exc:  # flower_simulate's preflight: Ray was not started, nothing was written
        _fail(_flagged(str(exc)))
    except (RuntimeError, ValueError, FileNotFoundError) as exc:
        _fail(str(exc), 1)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    keys = progress_keys(cfg)
    for row in rows:
        _print_row(row, keys)
    _say(f"done in {time.monotonic() - t0:.1f} s; run directory: {out}")


@flower_app.command("certs")
def certs_cmd(
    directory: Annotated[Path, typer.Argument(help="Where to write ca.crt, server.pem, server.key and node keys.")],
    host: Annotated[Optional[list[str]], typer.Option(help="SuperLink host name or IP (repeatable; default 127.0.0.1, localhost).")] = None,
    node_keys: Annotated[int, typer.Option(min=0, help="ECDSA key pairs for SuperNode authentication (node0, node1, ...).")] = 0,
    partition_id: Annotated[Optional[list[int]], typer.Option(
        "--partition-id", min=0, help="The partition of node K in provisioning.json, once per node in order "
        "(default: node K holds partition K).")] = None,
) -> None:
    """Generate a test CA, a SuperLink certificate, SuperNode authentication keys and, with node keys, the
    provisioning file that binds each node's key to its partition (provisioning.json, for --provisioning)."""
    from .provisioning import FILE, write_provisioning
    from .tls import host_problem, make_node_key, make_tls

    hosts = tuple(host) if host else ("127.0.0.1", "localhost")
    for h in hosts:
        if (why := host_problem(h)) is not None:
            _fail(f"--host {h!r} {why}")
    ids = list(partition_id) if partition_id else list(range(node_keys))
    if len(ids) != node_keys:
        _fail(f"--partition-id given {len(ids)} time(s) for --node-keys {node_keys}: once per node, in node order")
    if len(set(ids)) != len(ids):
        _fail(f"--partition-id {ids}: a partition is held by one node")
    names = ("ca.crt", "ca.key", "server.pem", "server.key", *(f"node{k}{e}" for k in range(node_keys) for e in ("", ".pub")),
             *((FILE,) if node_keys else ()))
    _guard_folder(directory, names, True)  # files already there are kept (or completed), as documented

    files = make_tls(directory, hosts)
    _say(f"CA: {files.ca_cert}\nSuperLink certificate: {files.server_cert}\nSuperLink key: {files.server_key}")
    for k in range(node_keys):
        key = make_node_key(directory, f"node{k}")
        _say(f"node {k}: private {key}, public {key}.pub")
    if node_keys:
        try:
            prov = write_provisioning(directory, ids)
        except ValueError as exc:  # a node key already there that is not one (kept files are read back)
            _fail(str(exc))
        _say(f"provisioning (partition -> node key, for --provisioning): {prov}; "
             + ", ".join(f"node {k} holds partition {p}" for k, p in enumerate(ids)))
