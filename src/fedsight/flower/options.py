"""The ServerApp's options: the run-config keys (``OPTIONS``) and their checked form (``ServerOptions``), and the
checks of a Flower run that need no Flower runtime (``preflight``), run before anything starts or is written."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .secagg import OPTIONS as SECAGG_OPTIONS


#: run-config keys of the ServerApp (with their defaults); the ``fedsight.*`` keys (``run_config``) and ``run-dir`` are required
OPTIONS: dict[str, Any] = {
    "round-timeout": 600.0,  # seconds to wait for the replies of one round
    "min-clients": 1,  # fewer accepted updates: the round is not aggregated
    "min-nodes": 0,  # nodes to wait for before round 1 (0: one per client, partition.num_clients)
    "node-wait-timeout": 300.0,  # how long to wait for them; then start with the nodes online
    "poll-interval": 0.2,  # seconds between pulls of replies
    "dp-noise-multiplier": 0.0,  # > 0: central DP (dp.py) with this z
    "dp-clipping-norm": 1.0,  # C
    "dp-delta": 0.0,  # 0: min(1e-5, 1 / (10 N))
    "dp-accountant": "rdp",  # "rdp" or "pld" (dp.Accountant)
    "dp-sampling": "none",  # "none" (no amplification) or "without-replacement" (replace-one relation)
    "data": "partition",  # "partition": nodes hold partitions of the dataset spec; "data-dir": their own data
    "overwrite": False,  # replace a run directory that already holds a run
    "max-reply-mb": 1024.0,  # a reply's (train or evaluate) arrays above this many MB are rejected before parsing
    "max-examples": 1_000_000,  # data-dir: the most training examples a reply may claim (partition: the server's)
    "provisioning": "",  # a provisioning file (provisioning.py): partition -> node key; "": identity not authenticated
    **SECAGG_OPTIONS,  # secure aggregation (SecAgg+, secagg.py)
}


@dataclasses.dataclass
class ServerOptions:
    run_dir: Path
    round_timeout: float = 600.0
    min_clients: int = 1
    min_nodes: int = 0
    node_wait_timeout: float = 300.0
    poll_interval: float = 0.2
    dp_noise_multiplier: float = 0.0
    dp_clipping_norm: float = 1.0
    dp_delta: float = 0.0
    dp_accountant: str = "rdp"
    dp_sampling: str = "none"
    data: str = "partition"
    overwrite: bool = False
    max_reply_mb: float = 1024.0
    max_examples: int = 1_000_000
    provisioning: str = ""
    secagg: bool = False
    secagg_num_shares: int | float = 3
    secagg_reconstruction_threshold: int | float = 2
    secagg_clipping_range: float = 8.0
    secagg_quantization_range: int = 1 << 22
    secagg_feature_bound: float = 1024.0

    @classmethod
    def from_run_config(cls, rc: Mapping[str, Any]) -> "ServerOptions":
        if "run-dir" not in rc:
            raise KeyError("run config has no 'run-dir' (the run directory the ServerApp writes)")
        vals = {k: rc.get(k, d) for k, d in OPTIONS.items()}
        return cls(
            run_dir=Path(str(rc["run-dir"])).expanduser(),
            round_timeout=float(vals["round-timeout"]),
            min_clients=int(vals["min-clients"]),
            min_nodes=int(vals["min-nodes"]),
            node_wait_timeout=float(vals["node-wait-timeout"]),
            poll_interval=float(vals["poll-interval"]),
            dp_noise_multiplier=float(vals["dp-noise-multiplier"]),
            dp_clipping_norm=float(vals["dp-clipping-norm"]),
            dp_delta=float(vals["dp-delta"]),
            dp_accountant=str(vals["dp-accountant"]),
            dp_sampling=str(vals["dp-sampling"]),
            data=str(vals["data"]),
            overwrite=bool(vals["overwrite"]),
            max_reply_mb=float(vals["max-reply-mb"]),
            max_examples=int(vals["max-examples"]),
            provisioning=str(vals["provisioning"]),
            secagg=bool(vals["secagg"]),
            secagg_num_shares=vals["secagg-num-shares"],
            secagg_reconstruction_threshold=vals["secagg-reconstruction-threshold"],
            secagg_clipping_range=vals["secagg-clipping-range"],
            secagg_quantization_range=vals["secagg-quantization-range"],
            secagg_feature_bound=vals["secagg-feature-bound"],
        ).checked()

    def secagg_settings(self) -> Any:
        """The SecAgg+ settings (``secagg.SecAggSettings``), or a ``ConfigError`` naming the run-config key."""
        from .secagg import SecAggSettings

        return SecAggSettings.from_options({k: getattr(self, k.replace("-", "_")) for k in SECAGG_OPTIONS})

    def checked(self) -> "ServerOptions":
        """These options, or a ``ConfigError`` naming the first invalid one (run-config key)."""
        import math

        from ..central_dp import accounting_problem

        dp_problem = accounting_problem(self.dp_accountant, self.dp_sampling)
        rules = [
            ("round-timeout", self.round_timeout > 0, "must be > 0 seconds"),
            ("min-clients", self.min_clients >= 1, "must be >= 1"),
            ("min-nodes", self.min_nodes >= 0, "must be >= 0"),
            ("node-wait-timeout", self.node_wait_timeout >= 0, "must be >= 0 seconds"),
            ("poll-interval", self.poll_interval >= 0, "must be >= 0 seconds"),
            ("dp-noise-multiplier", math.isfinite(self.dp_noise_multiplier) and self.dp_noise_multiplier >= 0,
             "must be a finite number >= 0"),
            ("dp-clipping-norm", math.isfinite(self.dp_clipping_norm) and self.dp_clipping_norm > 0,
             "must be a finite number > 0"),
            ("dp-delta", math.isfinite(self.dp_delta) and 0 <= self.dp_delta < 1, "must be in [0, 1)"),
            (dp_problem[0] if dp_problem else "dp-accountant", dp_problem is None, dp_problem[1] if dp_problem else ""),
            ("data", self.data in ("partition", "data-dir"), "must be 'partition' or 'data-dir'"),
            ("max-reply-mb", math.isfinite(self.max_reply_mb) and self.max_reply_mb > 0, "must be a finite number > 0"),
            ("max-examples", self.max_examples >= 1, "must be >= 1"),
        ]
        for key, ok, why in rules:
            if not ok:
                value = getattr(self, key.replace("-", "_"))
                raise ConfigError(f"run config {key} = {value!r} {why}")
        self.secagg_settings()
        return self

    def checked_for(self, cfg: Any) -> "ServerOptions":
        """These options against the run's config, or a ``ConfigError`` naming the run-config key: ``min-clients``
        at most the federation's clients and the clients sampled in every round (else every round is skipped)."""
        from ..config import stage_configs
        from ..engine.plan import clients_per_round

        n = int(cfg.partition.num_clients)
        for _, _, c in stage_configs(cfg) or [("", 0, cfg)]:
            for comp in c.recipe.components:
                if comp.name == "watermark" and comp.key_file is None:
                    raise ConfigError(
                        "watermark on Flower needs key_file (the same key file on every node, `fedsight etlc keygen -o "
                        "FILE`): a key in the config is read by the server, and nodes cannot draw a key they share")
        if cfg.eval.class_split:
            raise ConfigError(f"eval.class_split = {cfg.eval.class_split}: not on Flower (the server holds no client's "
                              "model to evaluate on the global test set); run it in-process or with --nproc")
        if self.min_clients > n:
            raise ConfigError(f"run config min-clients = {self.min_clients} exceeds the federation's {n} clients "
                              "(partition.num_clients)")
        for name, _, c in stage_configs(cfg) or [("", 0, cfg)]:
            m = min(n, clients_per_round(n, c.server.clients_per_round, c.server.fraction))
            if self.min_clients > m:
                where = f" in stage {name!r}" if name else ""
                raise ConfigError(f"run config min-clients = {self.min_clients} exceeds the {m} clients sampled per "
                                  f"round{where} (server.clients_per_round / server.fraction): every round would be skipped")
        if self.provisioning:  # (provisioning.py: a ConfigError naming the file)
            from .provisioning import read_provisioning

            read_provisioning(self.provisioning, n)
        return self.with_config_dp(cfg)

    def with_config_dp(self, cfg: Any) -> "ServerOptions":
        """These options with the config's ``[privacy.central_dp]`` (``fedsight.central_dp``): a config that sets it
        runs with central DP on Flower as in-process. The ``dp-*`` options, if they switch central DP on too
        (``dp-noise-multiplier`` > 0), must say the same: every one equal to the section's (``dp-delta`` 0 and no
        ``delta`` both mean the default), else a ``ConfigError`` naming both keys. Without the section: these."""
        spec = getattr(getattr(cfg, "privacy", None), "central_dp", None)
        if spec is None:
            return self
        section = {"dp-noise-multiplier": ("noise_multiplier", spec.noise_multiplier),
                   "dp-clipping-norm": ("clipping_norm", spec.clipping_norm), "dp-delta": ("delta", spec.delta or 0.0),
                   "dp-accountant": ("accountant", spec.accountant), "dp-sampling": ("sampling", spec.sampling)}
        if self.dp_noise_multiplier > 0:
            for key, (name, value) in section.items():
                mine = getattr(self, key.replace("-", "_"))
                if mine != value:
                    raise ConfigError(f"run config {key} = {mine!r} differs from the config's privacy.central_dp.{name} "
                                      f"= {getattr(spec, name)!r}: set central DP in one place (the config's section, "
                                      "or the dp-* options on a config without it)")
        return dataclasses.replace(self, **{k.replace("-", "_"): v for k, (_, v) in section.items()})

    def install(self, server: Any) -> Any:
        """Check the run's ``server`` (an ``engine.server.Server``) against secure aggregation (``secagg.check_secagg``)
        and install central DP (``dp.install_central_dp``) when these options ask for them: a ``ConfigError`` names
        what the recipe cannot do. Returns the ``CentralDP`` or None."""
        if self.secagg:
            from .secagg import check_secagg

            check_secagg(server, self.secagg_settings(), dp=self.dp_noise_multiplier > 0)
        if self.dp_noise_multiplier <= 0:
            return None
        from .dp import install_central_dp

        return install_central_dp(server, noise_multiplier=self.dp_noise_multiplier, clipping_norm=self.dp_clipping_norm,
                                  delta=self.dp_delta or None, accountant=self.dp_accountant, sampling=self.dp_sampling)


def preflight(cfg: Any, options: Mapping[str, Any] | None, run_dir: str | Path) -> ServerOptions:
    """Every check of a Flower run that needs no Flower runtime, before anything starts or is written (Ray, a
    SuperLink, the app, the run directory): the options (``ServerOptions.checked``), the options against the
    config (``checked_for``) and, with central DP, the recipe against the mechanism (``dp.install_central_dp``
    on the run's server, built on the CPU without initial weights: the ServerApp builds its own). Raises
    ``ConfigError`` naming the key; writes nothing. A run directory another process is writing is
    ``RunInUse`` here already (the ServerApp holds the lock while it runs)."""
    from ..runs import RunLock

    with RunLock(run_dir):  # taken and released: a second run of the same directory fails before Ray starts
        pass
    unknown = sorted(set(options or {}) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"unknown Flower option(s) {unknown}; known: {sorted(OPTIONS)}")
    opts = ServerOptions.from_run_config({**dict(options or {}), "run-dir": str(run_dir)}).checked_for(cfg)
    if opts.dp_noise_multiplier > 0 or opts.secagg:
        import torch

        from ..api import build_schedule, build_stages, build_task
        from ..engine.server import Server
        from ..rng import PROCESS_STREAM

        from ..secret import server_side

        with PROCESS_STREAM, torch.random.fork_rng(devices=[]), server_side():  # (the caller's generator stays)
            task = build_task(cfg)
            server = Server(task, build_stages(cfg, task), build_schedule(cfg, task), cfg.seed)
        opts.install(server)
    return opts
