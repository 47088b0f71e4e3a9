"""Central differential privacy in the in-process simulator: ``[privacy.central_dp]``.

The mechanism and the accountants are the Flower path's (``fedsight.flower.dp``): DP-FedAvg with server-side
fixed clipping through Flower's ``DifferentialPrivacyServerSideFixedClipping`` (each update clipped to L2 norm
``C``, the clipped updates averaged with equal weights over the ``m`` sampled clients, ``N(0, (z C / m)^2)`` added),
and dp-accounting's RDP or PLD accountant (``Accountant``). The in-process run installs the same ``CentralDP``
object as the recipe's aggregator (``flower.dp.install_in_process``), so a simulation reports the epsilon a deployment of the same
config reports, round by round, and releases its noise from the same code.

Choices made here:

* **One section, both paths.** ``[privacy.central_dp]`` (``CentralDPSection``) switches central DP on for
  ``fedsight run`` and for every Flower command (the ServerApp reads it from the config, ``flower.options``). The
  Flower flags (``--dp-noise`` ...) keep working on a config without the section; given together with the
  section they must agree with it (a ``ConfigError`` naming both keys otherwise): two sources of one privacy
  guarantee that disagree are a mistake, never resolved silently.
* **Validated at config time**, one line per problem (pydantic; the accounting pairs by ``accounting_problem``,
  the Flower path's own check), and the flower extra (flwr, dp-accounting) must be installed. What needs the
  built model (uniform weighting and mean aggregation, no shared buffers, no extra uploads, one clients-per-round:
  ``flower.dp.check_central_dp``, the checks of Flower's preflight) is checked when the run is built, before
  anything is written.
* **The noise secret** (issue 43) follows local DP's pattern (``fedsight.secret``): under ``[privacy] noise =
  "secret"`` the server draws 32 bytes from the OS CSPRNG and keeps them in ``RUN_DIR/private/central_dp.key``
  (mode 0600, as the Flower ServerApp does), never in the config, a log or a report; a resumed run reads them back
  and releases exactly the noise the uninterrupted run would (the key is required once a round is checkpointed:
  ``keep_server_secret``). Under ``"simulated"`` (the in-process default) the noise, and with ``sampling =
  "without-replacement"`` the client sample, are the seed's streams (reproducible research; anyone holding the
  config regenerates them), and ``run.json`` and ``summary.md`` say so (``privacy_note``).
* **Rounds without a full release**: a round with fewer than ``m`` accepted updates (dropout, a straggler, a
  rejected update) is not released and composes nothing: a ``dp_release_skipped`` event, as on Flower (``admit``).
* **Resume**: the accountant's whole state is its number of releases, checkpointed with the aggregator.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .registry import Params

#: ``accountant`` values: Renyi DP (default) or the privacy loss distribution
ACCOUNTANTS = ("rdp", "pld")
#: ``sampling`` values: no amplification (default) or FedSight's fixed-size sampling without replacement
SAMPLINGS = ("none", "without-replacement")
#: what installs the flower extra (the Flower CLI's own line)
FLOWER_EXTRA = 'pip install -e ".[flower]" (flwr[simulation,dp]==1.41.0)'


def accounting_problem(accountant: str, sampling: str,
                       keys: tuple[str, str] = ("dp-accountant", "dp-sampling")) -> tuple[str, str] | None:
    """Why (``accountant``, ``sampling``) cannot account a FedSight DP run, as (the option at fault, why); None: it
    can. ``keys``: how the two options are named (the Flower run config's by default)."""
    acc_key, smp_key = keys
    if accountant not in ACCOUNTANTS:
        return acc_key, "must be 'rdp' or 'pld'"
    if sampling == "poisson":
        return smp_key, ("is not how FedSight samples (exactly server.clients_per_round clients without replacement "
                         "each round); use 'without-replacement' or 'none'")
    if sampling not in SAMPLINGS:
        return smp_key, "must be 'none' or 'without-replacement'"
    if accountant == "pld" and sampling == "without-replacement":
        return acc_key, (f"has no bound for {smp_key} = 'without-replacement' (dp-accounting 0.6.0's PLD "
                         "accountant has no sampling-without-replacement event); use 'rdp' with it")
    return None


def missing_extra() -> list[str]:
    """The modules of the flower extra that central DP needs and this environment lacks."""
    return [m for m in ("flwr", "dp_accounting") if importlib.util.find_spec(m) is None]


class CentralDPSection(Params):
    """Central DP (DP-FedAvg, server-side fixed clipping, Gaussian noise; ``fedsight.central_dp``)."""

    noise_multiplier: float = Field(..., gt=0, description="z: the noise's standard deviation is z C / m (m clients "
                                    "a round)")
    clipping_norm: float = Field(1.0, gt=0, description="C: each client update is clipped to this L2 norm")
    delta: float | None = Field(None, gt=0, lt=1, description="the reported epsilon's delta; none: min(1e-5, 1 / (10 "
                                "N)), N clients")
    accountant: Literal["rdp", "pld"] = Field("rdp", description='"rdp" (Renyi DP, an upper bound) or "pld" (privacy '
                                              "loss distribution, tight)")
    sampling: Literal["none", "without-replacement"] = Field(
        "none", description='"none": no amplification by sampling; "without-replacement": also the amplified bound '
        "(replace-one neighbours; a secret sample)")

    @field_validator("sampling", mode="before")
    @classmethod
    def _how_fedsight_samples(cls, v: Any) -> Any:
        if v == "poisson":
            raise ValueError(accounting_problem("rdp", v)[1])
        return v

    @model_validator(mode="after")
    def _accountable_and_installed(self) -> "CentralDPSection":
        problem = accounting_problem(self.accountant, self.sampling, ("accountant", "sampling"))
        if problem is not None:
            raise ValueError(f"{problem[0]} = {getattr(self, problem[0])!r} {problem[1]}")
        missing = missing_extra()
        if missing:
            raise ValueError(f"central DP needs the flower extra ({', '.join(missing)} not installed): {FLOWER_EXTRA}")
        return self


def server_secret_path(run_dir: str | Path) -> Path:
    """Where a run keeps the server's central-DP secret (the Flower ServerApp's place too)."""
    from .secret import SERVER_PRIVATE_DIR

    return Path(run_dir) / SERVER_PRIVATE_DIR / "central_dp.key"


def keep_server_secret(sim: Any, run_dir: str | Path, resumed: bool) -> Path | None:
    """Under ``[privacy] noise = "secret"``: the server's secret is read back from ``run_dir/private/central_dp.key``
    or, for a run that has released nothing yet, drawn and written there (mode 0600, never replacing a file;
    ``secret.keep_secret``), and used for the noise (and the sample with ``without-replacement``). A resumed run
    (``resumed``, at a checkpointed round > 0) whose key is missing or damaged is a ``RunFileError`` naming the file,
    before anything is written: a new secret would change the noise. Returns the path (None: no secret to keep)."""
    dp = getattr(sim.backend, "dp", None)
    if dp is None or dp.secret is None:
        return None
    import os

    from .secret import keep_secret

    path = server_secret_path(run_dir)
    must = resumed and sim.round > 0
    if not must:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
    dp.secret = keep_secret(path, must_exist=must)
    if sim.server.sample_secret is not None:
        sim.server.sample_secret = dp.secret
    return path


def accounting_event(dp: Any, stage: str) -> dict[str, Any]:
    """The ``dp_accounting`` event (round 0) that says which accountant and assumption give the rows' epsilon (its
    note under ``reason``, which ``summary.md``'s event table shows), as the Flower ServerApp writes it."""
    desc = dp.describe()
    return {"stage": stage, "round": 0, "event": "dp_accounting", "reason": desc.pop("note"), **desc}
