"""Central differential privacy through Flower's DP strategy wrapper, inside FedSight's server round.

DP-FedAvg with server-side fixed clipping (McMahan et al. 2018, "Learning Differentially Private
Recurrent Language Models", Algorithm 1 with the fixed-denominator estimator; Andrew et al. 2021 for
the wrapper Flower implements): each client update ``Delta_k`` is clipped to L2 norm at most ``C``
(``Delta_k * min(1, C / ||Delta_k||)``, the norm over every uploaded tensor together), the clipped
updates are averaged with equal weights over the ``m`` sampled clients, and Gaussian noise
``N(0, (z C / m)^2)`` is added to the average (``z`` the noise multiplier). Each round is one release of
the Gaussian mechanism.

Accounting (``Accountant``; client-level DP, a client's whole data set is the unit). Two choices, both
from Google's dp-accounting (the library behind Flower's ``RdpAccountant``):

* ``sampling``: ``"none"`` (default) claims no amplification by client sampling. Neighbouring relation:
  add or remove one client; the sensitivity of the fixed-denominator mean is ``C / m``, so each release
  is ``GaussianDpEvent(z)``. ``"without-replacement"`` uses the amplification of FedSight's sampling,
  ``m`` distinct clients drawn uniformly from the ``N`` (``engine.plan.sample_clients``), which is a valid
  bound only under the replace-one (substitution) relation with ``N`` public (Wang, Balle &
  Kasiviswanathan 2019, "Subsampled Renyi Differential Privacy and Analytical Moments Accountant",
  Thm. 27; Balle, Barthe & Gaboardi 2018, "Privacy Amplification by Subsampling"). Replacing a client
  moves the clipped sum by up to ``2 C`` (two vectors of norm at most ``C``), so the release is
  ``SampledWithoutReplacementDpEvent(N, m, GaussianDpEvent(z / 2))`` under ``REPLACE_ONE``. With few clients
  (``m / N`` large) that bound is *larger* than no amplification's (3 of 3 clients, z = 1, 10 releases: 48.8
  against 19.1). The reported epsilon is therefore the smaller of the two, both add/remove-one bounds at the same
  delta: a replace-one (eps, delta) guarantee is an add/remove-one one (removing a client's update from the
  fixed-denominator mean is replacing it by the zero vector, which is in the clipping ball), and the minimum of
  two valid (eps, delta) bounds is valid. ``dp/amplified`` says which gave it. The converse does not hold:
  add/remove-one (eps, delta) gives replace-one only by group privacy (2 eps, (1 + e^eps) delta), so
  ``dp/epsilon_replace_one`` is computed on its own, the smaller of the amplified bound and no amplification
  under replace-one (``GaussianDpEvent(z / 2)``). Amplification also assumes that the sample is secret: with
  ``"without-replacement"`` the server draws it from its own secret (``engine.plan.sample_clients(..., secret)``,
  the stream ("sample", round) of the secret that also drives its noise), not from the run seed, which
  ``config.json`` and every node's run config hold. Each training instruction names only the receiving node's
  own client (``records.instructions_per_node``), so a sampled node learns that it was sampled, not who else was;
  a node the server cannot yet identify (no provisioning file, a new or restarted SuperNode) is told the
  sampled clients that have no online node. The bound is still against the other parties and observers of the
  released models, not against a coalition of sampled nodes (which together know their part of the sample). ``"none"`` draws it from the seed (a Flower run then samples as
  the in-process one does). Poisson sampling
  (each client independently with probability ``q``) is not what FedSight does, so its bound is refused.
* ``accountant``: ``"rdp"`` (default): Renyi DP (Mironov 2017) of each release at dp-accounting's default
  orders, composed additively and converted to (eps, delta) with Balle et al. 2020 ("Hypothesis Testing
  Interpretations and Renyi Differential Privacy", Thm. 21; Canonne, Kamath & Steinke 2020, Prop. 12);
  an upper bound, a few percent above the
  exact value. ``"pld"``: the privacy loss distribution (Meiser & Mohammadi 2018; Koskela et al. 2020),
  tight. Without amplification the composition of ``T`` releases is the Gaussian mechanism with noise
  multiplier ``z / sqrt(T)`` (the PLD of a Gaussian composes in closed form), whose epsilon is computed
  exactly (Balle & Wang 2018, "Improving the Gaussian Mechanism for Differential Privacy", Thm. 8;
  ``dp_accounting.gaussian_mechanism.get_epsilon_gaussian``); dp-accounting's ``PLDAccountant`` gives the
  same value to its discretisation (1e-4) but takes seconds per round once ``T / z^2`` reaches ~100.
  dp-accounting 0.6.0's PLD accountant has no sampling-without-replacement event, so ``"pld"`` with
  ``"without-replacement"`` is refused.

Flower 1.41's wrapper accepts only no-amplification accountants, so the wrapper here has none and
``CentralDP`` composes each successful release itself. ``describe()`` names the accountant, the sampling
assumption and the relation; the ServerApp logs it (a ``dp_accounting`` event, ``flower.json``); each round's row
has ``dp/epsilon`` (and, with ``without-replacement``, ``dp/amplified`` and ``dp/epsilon_replace_one``).

The mechanism is Flower's: ``DifferentialPrivacyServerSideFixedClipping`` wraps Flower's stock
``FedAvg``; FedSight hands it one reply per client (``global + Delta_k`` with equal weights) and receives
the noised average. The FedSight side stays as it is: the noised average update goes to the recipe's
server optimizer and the components' server hooks in ``Simulation.end_round``. ``CentralDP`` plugs in as
the recipe's aggregator, so the recipe must average uniformly (``recipe.weighting = "uniform"``,
``recipe.aggregator = "mean"``; other weightings change the sensitivity) and must not upload anything the
mechanism does not cover (shared BatchNorm statistics, components' extra tensors such as SCAFFOLD's
control variates).

The noise is drawn by Flower from NumPy's global generator; ``CentralDP`` sets its whole state per release from
the server's secret (``fedsight.secret``: 32 bytes from the OS CSPRNG drawn when the mechanism is installed, the
generator's 624 words from SHAKE-256 of the secret and ("dp-noise", release)) and restores the generator
afterwards. The secret is kept only in the server's private run files (``RUN_DIR/private/central_dp.key``, mode
0600; ``keep_secret``), never in the config, the run config, a message, a log or a report: a participant holding
all of them cannot regenerate the noise, and two runs of one seed release different noise. ``secret = None``
(tests only) keeps the old seed-derived stream (seed, "dp-noise", release), which anyone with the seed can
regenerate.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
from flwr.serverapp.strategy import dp_fixed_clipping as _dp_wrapper
from flwr.supercore import differential_privacy as _dp_utils

from ..central_dp import accounting_problem  # (with the config section that also names the choices: no Flower import)
from ..errors import ConfigError
from ..records import ClientResult
from ..rng import derive_seed
from ..runs import atomic_write_bytes
from ..secret import SERVER_PRIVATE_DIR, draw_secret, secret_numpy_state
from .records import record_to_tensors, tensors_to_record


class Accountant:
    """Cumulative (epsilon, delta) of ``T`` identical releases of the DP-FedAvg Gaussian mechanism (noise
    multiplier ``z``, ``m`` of ``N`` clients a release), by ``accountant`` under ``sampling`` (module
    docstring). ``epsilon(T)`` costs the same at every ``T``: the per-release RDP is computed once and
    scaled, the PLD of ``T`` Gaussian releases is one Gaussian's."""

    def __init__(self, accountant: str, sampling: str, *, noise_multiplier: float, num_sampled: int,
                 population: int, delta: float):
        problem = accounting_problem(accountant, sampling)
        if problem is not None:
            raise ValueError(f"{problem[0]} = {accountant if problem[0] == 'dp-accountant' else sampling!r} {problem[1]}")
        if not 1 <= num_sampled <= population:
            raise ValueError(f"{num_sampled} clients a release out of {population}: need 1 <= m <= N")
        if not (noise_multiplier > 0 and 0 < delta < 1):
            raise ValueError(f"need noise multiplier > 0 and 0 < delta < 1, got {noise_multiplier} and {delta}")
        self.accountant, self.sampling, self.delta = accountant, sampling, float(delta)
        self.noise_multiplier, self.num_sampled, self.population = float(noise_multiplier), int(num_sampled), int(population)
        self.relation = "add-or-remove-one"  # the reported epsilon's, whatever the sampling (epsilon())
        self._cache: dict[tuple[str, int], float] = {}
        self._rdp: dict[str, np.ndarray] = {}
        if accountant == "rdp":
            from dp_accounting import privacy_accountant
            from dp_accounting.rdp import RdpAccountant

            rel = privacy_accountant.NeighboringRelation
            for name, (relation, event) in self.events().items():
                acc = RdpAccountant(neighboring_relation=rel.REPLACE_ONE if relation == "replace-one" else rel.ADD_OR_REMOVE_ONE)
                acc.compose(event)
                self._orders, self._rdp[name] = np.array(acc.orders), np.array(acc.rdp)  # one release

    def events(self) -> dict[str, tuple[str, Any]]:
        """One release as dp-accounting ``DpEvent``s, each with its neighbouring relation: ``"none"``, no
        amplification (add/remove one client: the fixed-denominator mean moves by up to C / m, so the noise is z
        sensitivities); with ``without-replacement`` also ``"amplified"``, the sampled release (replace-one: the
        clipped sum moves by up to 2 C, so the noise is z / 2 sensitivities), and ``"replace-one"``, no
        amplification under replace-one (z / 2)."""
        from dp_accounting import dp_event

        z = self.noise_multiplier
        out = {"none": ("add-or-remove-one", dp_event.GaussianDpEvent(z))}
        if self.sampling == "without-replacement":
            out["amplified"] = ("replace-one", dp_event.SampledWithoutReplacementDpEvent(
                self.population, self.num_sampled, dp_event.GaussianDpEvent(z / 2)))
            out["replace-one"] = ("replace-one", dp_event.GaussianDpEvent(z / 2))
        return out

    def event(self) -> Any:
        """The release event of the sampling assumption (``events``: the sampled one with ``without-replacement``)."""
        return self.events()["amplified" if self.sampling == "without-replacement" else "none"][1]

    def _epsilon(self, name: str, releases: int) -> float:
        if releases == 0:
            return 0.0
        if (name, releases) not in self._cache:
            if self.accountant == "rdp":
                from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

                eps = compute_epsilon(self._orders, releases * self._rdp[name], self.delta)[0]
            else:  # T Gaussian releases = one with noise z / sqrt(T); exact epsilon of its PLD (sampling "none" only)
                from dp_accounting.gaussian_mechanism import get_epsilon_gaussian

                eps = get_epsilon_gaussian(self.noise_multiplier / float(np.sqrt(releases)), self.delta)
            self._cache[name, releases] = float(eps)
        return self._cache[name, releases]

    def bounds(self, releases: int) -> dict[str, float]:
        """Every epsilon at ``self.delta`` after ``releases`` releases, one per event of ``events``."""
        return {name: self._epsilon(name, releases) for name in self.events()}

    def epsilon(self, releases: int) -> float:
        """The reported epsilon at ``self.delta`` after ``releases`` releases (0 before the first): add/remove one
        client. With ``without-replacement``, the smaller of two valid bounds at the same delta: no amplification,
        and the amplified replace-one bound, which also bounds add/remove one (a client's clipped update replaced by
        zero is one replacement), so their minimum does."""
        b = self.bounds(releases)
        return min(b["none"], b.get("amplified", b["none"]))

    def amplified(self, releases: int) -> bool:
        """Whether the amplified bound gave ``epsilon(releases)`` (it is smaller than no amplification)."""
        b = self.bounds(releases)
        return "amplified" in b and b["amplified"] < b["none"]

    def epsilon_replace_one(self, releases: int) -> float | None:
        """With ``without-replacement``: the replace-one epsilon, the smaller of the amplified bound and no
        amplification under replace-one (sensitivity 2 C / m); None otherwise."""
        b = self.bounds(releases)
        return min(b["amplified"], b["replace-one"]) if "amplified" in b else None

    def spent(self, releases: int) -> dict[str, float]:
        """The metrics of ``releases`` releases: ``dp/epsilon`` and, with ``without-replacement``,
        ``dp/amplified`` (1: the amplified bound gave it, 0: no amplification did) and ``dp/epsilon_replace_one``."""
        out = {"dp/epsilon": self.epsilon(releases)}
        if self.sampling == "without-replacement":
            out["dp/amplified"] = float(self.amplified(releases))
            out["dp/epsilon_replace_one"] = float(self.epsilon_replace_one(releases))
        return out

    def describe(self) -> dict[str, Any]:
        """Which accountant and which assumption produce the reported epsilon (strings and numbers)."""
        out = {"accountant": self.accountant, "sampling": self.sampling, "neighbouring_relation": self.relation,
               "noise_multiplier": self.noise_multiplier, "num_sampled": self.num_sampled,
               "population": self.population, "delta": self.delta}
        if self.sampling == "none":
            out["note"] = (f"epsilon by {self.accountant.upper()}, no amplification by client sampling, "
                           f"{self.relation} neighbouring clients")
            return out
        out["note"] = (f"epsilon by {self.accountant.upper()}, {self.relation} neighbouring clients: the smaller of no "
                       f"amplification and amplification by sampling {self.num_sampled} of {self.population} clients "
                       "without replacement (a replace-one bound, which implies add-or-remove-one; valid only if the "
                       "sample, i.e. the run seed, is secret); dp/amplified says which gave each round's epsilon, "
                       "dp/epsilon_replace_one is the replace-one epsilon")
        return out


def _clip_model_update(param1: list, param2: list, clipping_norm: float) -> None:
    """Flower 1.41's ``compute_clip_model_update`` (``param1 <- param2 + clip(param1 - param2)``, its own
    ``clip_inputs_inplace``), except that an update whose norm is 0 (all zero, or so small that its float32 norm
    underflows) is left as it is instead of raising ``ZeroDivisionError``: its norm is at most C, so the clip is the
    identity. Every other update is clipped by Flower's code, bit for bit."""
    update = [np.subtract(x, y) for x, y in zip(param1, param2, strict=True)]
    if _dp_utils.get_norm(update) > 0:
        _dp_utils.clip_inputs_inplace(update, clipping_norm)
    for i, _ in enumerate(param2):
        param1[i] = param2[i] + update[i]


@contextlib.contextmanager
def _zero_norm_safe_clipping():
    """Flower's server-side clipping wrapper with ``_clip_model_update`` for the duration of one release (the
    wrapper calls the module-level function; the server aggregates on one thread)."""
    original = _dp_wrapper.compute_clip_model_update
    _dp_wrapper.compute_clip_model_update = _clip_model_update
    try:
        yield
    finally:
        _dp_wrapper.compute_clip_model_update = original


@contextlib.contextmanager
def _outside_flower_runtime():
    """Flower's wrapper builds (and never sends) one ``Message`` per update, and a ``Message`` reads the task identity
    Flower's runtime sets in a ServerApp process (flwr 1.41's ``TaskIdentity``). Outside a runtime (the in-process
    simulator, ``fedsight.central_dp``) nothing set it: a placeholder identity is set for the release and taken back
    after, and Flower's INFO lines of each release ("parameters are clipped ...") stay off that run's console. Inside
    a runtime (the identity is set) nothing changes."""
    from flwr.supercore.task_identity import TaskIdentity

    if TaskIdentity._run_id is not None:
        yield
        return
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 0, 0, 0
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
        TaskIdentity._run_id = TaskIdentity._node_id = TaskIdentity._task_id = None


class _ReleaseGrid(Grid):
    """The ``m`` updates of one release, presented to the strategy as ``m`` nodes (``configure_train``
    builds one instruction per node; nothing is sent)."""

    def __init__(self, m: int):
        self._ids = list(range(1, m + 1))

    def set_run(self, run: Any) -> None:  # pragma: no cover - not used
        raise NotImplementedError

    @property
    def run(self) -> Any:  # pragma: no cover - not used
        raise NotImplementedError

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # pragma: no cover
        raise NotImplementedError

    def get_node_ids(self) -> Iterable[int]:
        return list(self._ids)

    def push_messages(self, messages):  # pragma: no cover - not used
        raise NotImplementedError

    def pull_messages(self, message_ids):  # pragma: no cover - not used
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None):  # pragma: no cover - not used
        raise NotImplementedError


class CentralDP:
    """A FedSight aggregator (``aggregate(results, weights) -> delta``) that releases the clipped,
    noised mean update through Flower's ``DifferentialPrivacyServerSideFixedClipping``.

    ``global_params()`` returns the current global values of the shared trainable parameters (the
    point the updates are clipped around). ``num_sampled`` is the fixed number of updates per release;
    a round with fewer updates must not be released (the server skips it). ``population``, ``delta``,
    ``accountant`` (``"rdp"``, ``"pld"``) and ``sampling`` (``"none"``, ``"without-replacement"``)
    configure the ``Accountant``."""

    name = "central_dp"

    def __init__(
        self,
        global_params,
        *,
        noise_multiplier: float,
        clipping_norm: float,
        num_sampled: int,
        population: int,
        delta: float,
        seed: int,
        accountant: str = "rdp",
        sampling: str = "none",
        secret: bytes | None = None,
    ):
        self.global_params, self.seed, self.num_sampled = global_params, seed, num_sampled
        self.secret = secret  # the server's noise secret (None: the seed-derived stream, for tests)
        self.noise_multiplier, self.clipping_norm = float(noise_multiplier), float(clipping_norm)
        self.accountant = Accountant(accountant, sampling, noise_multiplier=self.noise_multiplier,
                                     num_sampled=num_sampled, population=population, delta=delta)
        inner = FedAvg(fraction_train=1.0, min_train_nodes=num_sampled, min_available_nodes=num_sampled)
        # no accountant in Flower's wrapper (it accepts no-amplification ones only): releases are composed here
        self.strategy = DifferentialPrivacyServerSideFixedClipping(inner, self.noise_multiplier, self.clipping_norm,
                                                                   num_sampled)
        self.releases = 0

    def aggregate(self, results: list[ClientResult], weights: torch.Tensor) -> dict[str, torch.Tensor]:
        del weights  # equal weights: the mechanism's sensitivity assumes them (checked at build time)
        for res in results:
            if res.extras or res.buffers:
                raise ValueError(
                    f"central DP covers the model update only, but client {res.client_id} also uploads "
                    f"{sorted(res.extras) + (['buffers'] if res.buffers else [])}; drop those components "
                    "(or shared BatchNorm statistics) from a DP run"
                )
        if len(results) != self.num_sampled:
            raise ValueError(f"a DP release needs exactly {self.num_sampled} updates, got {len(results)}")
        r = self.releases + 1
        current = {k: v.detach().clone() for k, v in self.global_params().items()}
        keys = list(current)
        py_state, np_state = random.getstate(), np.random.get_state()
        try:
            if self.secret is not None:
                np.random.set_state(secret_numpy_state(self.secret, "dp-noise", r))
            else:
                np.random.seed(derive_seed(self.seed, "dp-noise", r) % (2**32))
            with _outside_flower_runtime():
                instructions = list(self.strategy.configure_train(r, tensors_to_record(current), ConfigRecord(),
                                                                  _ReleaseGrid(len(results))))
                replies = []
                for ins, res in zip(instructions, results, strict=True):
                    local = {k: current[k] + res.delta[k] for k in keys}
                    content = RecordDict({"arrays": tensors_to_record(local),
                                          "metrics": MetricRecord({"num-examples": 1})})
                    replies.append(Message(content, reply_to=ins))
                with _zero_norm_safe_clipping():
                    arrays, _ = self.strategy.aggregate_train(r, replies)
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
        if arrays is None:
            raise RuntimeError("Flower's DP wrapper released no aggregate")
        self.releases = r  # composed only once released
        noised = record_to_tensors(ArrayRecord(arrays) if not isinstance(arrays, ArrayRecord) else arrays)
        return {k: (noised[k].to(current[k]) - current[k]) for k in keys}

    def admit(self, r: int, results: list[ClientResult], events: list[dict[str, Any]]) -> list[ClientResult]:
        """The accepted ``results`` of round ``r`` if they make a release (exactly ``num_sampled``), else none and a
        ``dp_release_skipped`` event: a release of fewer updates would have a larger sensitivity than accounted, and
        a skipped round composes nothing. Every backend admits a DP round here (``engine.loop``, the ServerApp)."""
        if results and len(results) != self.num_sampled:
            events.append({"round": r, "event": "dp_release_skipped", "accepted": len(results), "needed": self.num_sampled})
            return []
        return results

    def privacy_spent(self) -> dict[str, float]:
        """Cumulative (epsilon, delta) of the releases so far (``self.accountant``; ``describe()`` says how)."""
        return {**self.accountant.spent(self.releases), "dp/delta": self.accountant.delta, "dp/releases": self.releases}

    def describe(self) -> dict[str, Any]:
        """The mechanism and how its epsilon is accounted (``Accountant.describe``)."""
        return {"clipping_norm": self.clipping_norm, **self.accountant.describe()}

    def keep_secret(self, run_dir: Any) -> Path | None:
        """Write the server's noise secret to ``run_dir/private/central_dp.key`` (mode 0600): the server's private
        run files, the only place it is kept. Returns the path (None without a secret)."""
        if self.secret is None:
            return None
        path = Path(run_dir) / SERVER_PRIVATE_DIR / "central_dp.key"
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        atomic_write_bytes(path, self.secret, mode=0o600)  # (0600 from the start, renamed)
        return path

    def state_dict(self) -> dict:
        return {"releases": self.releases}

    def load_state_dict(self, state: dict) -> None:
        """The accountant's whole state is the number of releases (each is the same event): a resumed in-process run
        composes on from there (a Flower run is never resumed)."""
        self.releases = int(state.get("releases", 0))


def check_central_dp(sim: Any, sampling: str = "none") -> int:
    """Refuse (``ConfigError`` naming the config key) a run that central DP cannot cover; returns ``m``, the
    fixed number of updates of a release. ``sim`` is an ``engine.server.Server`` (its stages, model and
    task): every stage must weight uniformly with the mean aggregator, train and share trainable parameters
    (the mechanism clips and noises a model update), share no buffers and upload no extra tensors (they
    would leave un-noised), and sample one number of clients; amplification (``sampling =
    "without-replacement"``) needs FedSight's own uniform sampling (no component that picks the clients).
    Reads the server only: the same checks run before anything starts (``options.preflight``) and in the
    ServerApp."""
    from ..engine.plan import stage_layout
    from ..training.component import Component

    for st in sim.stages:
        where = f"stage {st.name!r}"
        w, a = st.recipe.weighting.name, st.recipe.aggregator.name
        if w != "uniform" or a != "mean":
            raise ConfigError(
                f"central DP needs recipe.weighting = 'uniform' and recipe.aggregator = 'mean' ({where} has "
                f"{w!r} and {a!r}): the noise is calibrated to an equal-weight mean of clipped updates"
            )
        trainer = st.recipe.trainer
        if not trainer.trains:
            raise ConfigError(
                f"central DP releases model updates, but {where} trains nothing (its trainer "
                f"{getattr(trainer, 'name', type(trainer).__name__)!r} is a statistics pass): drop that stage or its "
                "recipe.components entry from a DP run"
            )
        extras = sorted(c.name for c in st.recipe.components if c.uploads_extras)
        if extras:
            raise ConfigError(
                f"central DP covers the model update only, but recipe.components {', '.join(extras)} ({where}) also "
                "upload extra tensors that would leave un-noised; drop them from a DP run"
            )
        layout = stage_layout(sim.global_model, st)
        if layout.shared_buffers:
            raise ConfigError(
                f"central DP does not cover shared buffers ({where} shares {', '.join(layout.shared_buffers[:3])}, ...): "
                "use a model without BatchNorm running statistics (model.norm) or keep them local (recipe.sharing / a "
                "norm-sharing component)"
            )
        if not layout.shared_params:
            raise ConfigError(
                f"central DP releases model updates, but {where} shares no trainable parameter (recipe.sharing, "
                "train.freeze): no update to clip and noise"
            )
    sizes = {st.clients_per_round or sim.schedule.clients_per_round for st in sim.stages}
    if len(sizes) != 1:
        raise ConfigError(f"central DP needs one server.clients_per_round for the whole run, got {sorted(sizes)}")
    if sampling == "without-replacement":
        pickers = sorted({c.name for st in sim.stages for c in st.recipe.components
                          if type(c).sample is not Component.sample})
        if pickers:
            raise ConfigError(f"dp-sampling = 'without-replacement' assumes uniform sampling, but {', '.join(pickers)} "
                              "picks the clients; use dp-sampling = 'none'")
    return min(sizes.pop(), sim.task.num_clients)  # sample_clients takes everyone when m >= N


def install_central_dp(sim: Any, *, noise_multiplier: float, clipping_norm: float, delta: float | None,
                       accountant: str = "rdp", sampling: str = "none") -> CentralDP:
    """Replace the aggregator of every stage of ``sim`` (an ``engine.server.Server``) by one
    ``CentralDP`` (one accountant for the run), after ``check_central_dp``."""
    m = check_central_dp(sim, sampling)
    n = sim.task.num_clients
    dp = CentralDP(
        lambda: {k: sim.global_model.state_dict()[k] for k in sim.shared_params},
        noise_multiplier=noise_multiplier,
        clipping_norm=clipping_norm,
        num_sampled=m,
        population=n,
        delta=delta if delta is not None else min(1e-5, 1.0 / (10 * n)),
        seed=sim.seed,
        accountant=accountant,
        sampling=sampling,
        secret=draw_secret(),  # the server's own: regenerable by no participant
    )
    for st in sim.stages:
        st.recipe.aggregator = dp
    if sampling == "without-replacement":  # amplification assumes a secret sample: drawn from the server's secret
        sim.sample_secret = dp.secret
    return dp


def install_in_process(sim: Any, cfg: Any) -> CentralDP | None:
    """Install ``cfg``'s central DP on ``sim`` (an ``engine.simulation.Simulation``; none without the section):
    ``install_central_dp`` on its server (which checks the recipe: a ``ConfigError`` naming the
    key), the backend's admission and metrics (``engine.loop.InProcessBackend``). The secret is drawn in memory
    (``[privacy] noise = "secret"``) or there is none (``"simulated"``: the seed's streams); a run with a directory
    keeps it there (``central_dp.keep_server_secret``). Returns the ``CentralDP`` or None."""
    spec = cfg.privacy.central_dp
    if spec is None:
        return None
    dp = install_central_dp(sim.server, noise_multiplier=spec.noise_multiplier, clipping_norm=spec.clipping_norm,
                            delta=spec.delta, accountant=spec.accountant, sampling=spec.sampling)
    if cfg.privacy.noise == "simulated":  # the seed's streams (CentralDP's secret None), said in run.json
        dp.secret = None
        sim.server.sample_secret = None
    sim.backend.dp = dp
    return dp
