"""The Python API: ``fedsight.run`` and ``fedsight.load_run``, for notebooks and scripts.

``run`` does what ``fedsight run`` does (every variant x grid point x seed of a config, each into its run
directory; an existing run of the same config is resumed or, when complete, read back) and returns each
run's ``RunResult``; ``load_run`` reads a finished run directory back, its trained model included, without
loading the dataset (the run records what the model was built for in ``run.json``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError

ConfigLike = str | os.PathLike[str] | Mapping[str, Any]


@dataclass
class RunResult:
    """One run, read from its directory: ``status`` ("complete", "stopped", ...), ``final`` (each metric's
    last logged value), ``history`` (one dict per round: every metric logged that round), ``events`` (the
    ``{"event": ...}`` lines: lost clients, skipped rounds, ...), ``config`` (the validated config) and
    ``model`` (the final global model, loaded on first use from ``model.safetensors``)."""

    run_dir: Path
    status: str
    config: Any
    history: list[dict[str, Any]]
    events: list[dict[str, Any]]
    final: dict[str, Any] = field(default_factory=dict)
    _model: Any = field(default=None, repr=False)

    @property
    def client_metrics(self) -> list[dict[str, Any]]:
        """Every evaluated round's local-test metrics of every client (``client_metrics.jsonl``; with
        ``eval.local``): ``[{"round": r, "stage": ..., "clients": {"0": {"n": ..., "acc": ...}, ...}}, ...]``."""
        from .runs import RunDir

        return RunDir(self.run_dir).read_client_metrics()

    @property
    def model(self) -> Any:
        if self._model is None:
            self._model = load_model(self.run_dir, self.config)
        return self._model

    @property
    def selected(self) -> dict[str, Any] | None:
        """The model selected on validation (``eval.select = "best"``: ``best.json``), ``{"round", "metric",
        "value", ...}``; None without a selection. Its test metrics are ``final["selected/test/..."]``."""
        from .model_selection import read_best

        return read_best(self.run_dir)

    @property
    def selected_model(self) -> Any:
        """The model selected on validation (``best.safetensors``), built as ``model`` is (loaded on each use)."""
        from .model_selection import BEST_WEIGHTS

        return load_model(self.run_dir, self.config, BEST_WEIGHTS)

    def dataframe(self) -> Any:
        """``history`` as a pandas DataFrame indexed by round (needs pandas; the rest of the API does not)."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("RunResult.dataframe() needs pandas (pip install pandas); RunResult.history is the "
                              "same table as a list of dicts") from None
        return pd.DataFrame(self.history).set_index("round")


def _raw_config(config: ConfigLike) -> tuple[dict[str, Any], str]:
    from .config import read_toml

    if isinstance(config, Mapping):
        return dict(config), "config"
    return read_toml(config), str(config)


def run(config: ConfigLike, *, variants: list[str] | tuple[str, ...] = (), overwrite: bool = False,
        stop_after: int | None = None, smoke: bool = False, **overrides: Any) -> RunResult | list[RunResult]:
    """Run ``config`` (a TOML file's path, or the same tables as a dict) and return its ``RunResult``, or a list
    of them when the config is a sweep (variants x grid points x seeds, in ``fedsight run``'s order).

    ``overrides`` set config keys as ``--set`` does, the command line's precedence included: dots in a key are
    spelt ``__`` (``server__rounds=5``) or passed as ``**{"server.rounds": 5}``; values are Python values.
    ``variants``: only these ``[[variants]]``, by name or shell-style pattern (``"fedavg_dct_*"``). ``smoke``: a
    smoke test of every variant, as ``fedsight run --smoke`` (``fedsight.sweep.expand``). An existing run directory of the same config resumes (or, when
    complete, is read back); one of a different config is an error unless ``overwrite``. Errors in the config
    are ``fedsight.ConfigError`` with the CLI's one-line messages; nothing is written before it is checked."""
    from .api import execute
    from .shared_stages import share
    from .sweep import expand

    if smoke and stop_after is not None:
        raise ConfigError("smoke with stop_after: a smoke run is already at most 2 rounds a stage; pass one of them")
    raw, source = _raw_config(config)
    sets = [(key.replace("__", ".").split("."), value) for key, value in overrides.items()]
    specs = expand(raw, source, only=tuple(variants), typed=sets, smoke=smoke)
    share(specs, lambda i, r: execute(specs[i].config, specs[i].run_dir, stop_after=r), lambda line: None,
          overwrite=overwrite, stop_after=stop_after)  # ([sweep] share_stages; off: nothing)
    results = []
    for spec in specs:
        out = execute(spec.config, spec.run_dir, overwrite=overwrite, stop_after=stop_after)
        results.append(_read(out.run_dir, spec.config))
    return results[0] if len(results) == 1 else results


def load_run(run_dir: str | os.PathLike[str]) -> RunResult:
    """A run directory read back: metrics, events, config, and (on first use of ``.model``) the trained model
    built from the run's own record of its inputs and outputs, without loading any data."""
    from .api import load_run_config

    return _read(Path(run_dir), load_run_config(run_dir))


def _read(run_dir: Path, cfg: Any) -> RunResult:
    from .runs import RunDir, last_values

    run = RunDir(run_dir)
    rows = run.read_metrics()
    return RunResult(run_dir, str(run.read_status().get("state", "new")), cfg, [r for r in rows if "event" not in r],
                     [r for r in rows if "event" in r], last_values(rows))


def load_model(run_dir: Path, cfg: Any, name: str = "model.safetensors") -> Any:
    """The run's final global model (``model.safetensors``; ``name``: another of its weight files, such as the
    selected model's ``best.safetensors``) in a model built from ``run.json``'s ``model_io``."""
    from . import registry as R
    from .models.base import ModelIO, load_weights
    from .runs import read_run_meta
    from .tasks.base import component_params

    weights = Path(run_dir) / name
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: no trained model (the run has not completed or stopped yet"
                                f"{', or selects no model: eval.select' if name != 'model.safetensors' else ''})")
    io = (read_run_meta(run_dir) or {}).get("model_io")
    if not isinstance(io, dict):
        raise ConfigError(f"{Path(run_dir) / 'run.json'}: no model_io (a run written before FedSight recorded it); "
                          "build the model with fedsight.api.build_task(config).build_model() instead")
    entry = R.MODELS.get(cfg.model.name)
    model = entry.factory(entry.params(**component_params(cfg.model)), io=ModelIO(**io))
    load_weights(model, weights)
    return model.eval()
