"""FedSight: federated learning for real-world vision tasks under heterogeneity.

The Python API (``fedsight.results``): ``fedsight.run(config, **overrides)`` runs a config (a TOML path or a
dict) as ``fedsight run`` does and returns ``RunResult``s; ``fedsight.load_run(run_dir)`` reads a run back,
its trained model included. Register your own parts with ``fedsight.registry`` (``MODELS.register`` etc.).
"""

__version__ = "0.1.0"

__all__ = ["ConfigError", "RunResult", "load_run", "run", "__version__"]


def __getattr__(name: str):  # the API on first use: ``import fedsight`` stays light (no torch)
    if name in ("run", "load_run", "RunResult"):
        from . import results

        return getattr(results, name)
    if name == "ConfigError":
        from .errors import ConfigError

        return ConfigError
    raise AttributeError(f"module 'fedsight' has no attribute {name!r}")
