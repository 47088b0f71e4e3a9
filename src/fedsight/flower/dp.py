"""Central differential privacy through Flower's DP strategy wrapper, inside FedSight's server round.

DP-FedAvg with server-side fixed clipping (McMahan et al. 2018, "Learning Differentially Private
Recurrent Language Models", Algorithm 1 with the fixed-denominator estimator; Andrew et al. 2021 for
the wrapper Flower implements): each client update ``Delta_k`` is clipped to L2 norm at most ``C``
(``Delta_k * min(1, C / ||Delta_k||)``, the norm over every uploaded tensor together), the clipped
updates are averaged with equal weights over the ``m`` sampled clients, and Gaussian noise
``N(0, (z C / m)^2)`` is added to the average (``z`` the noise multiplier). Each round is one release of
the Gaussian mechanism with L2 sensitivity ``C / m``; Flower's ``RdpAccountant`` (R'enyi DP, Mironov
2017; no sampling amplification, add/remove-one neighbouring) composes the releases and reports the
cumulative ``(epsilon, delta)``.

Everything above is Flower's: ``DifferentialPrivacyServerSideFixedClipping`` wraps Flower's stock
``FedAvg`` (the only strategy its accountant accepts); FedSight hands it one reply per client
(``global + Delta_k`` with equal weights) and receives the noised average. The FedSight side stays as it
is: the noised average update goes to the recipe's server optimizer and the components' server hooks
in ``Simulation.end_round``. ``CentralDP`` plugs in as the recipe's aggregator, so the recipe must
average uniformly (``recipe.weighting = "uniform"``, ``recipe.aggregator = "mean"``; other weightings
change the sensitivity) and must not upload anything the mechanism does not cover (shared BatchNorm
statistics, components' extra tensors such as SCAFFOLD's control variates).

The noise is drawn by Flower from NumPy's global generator; ``CentralDP`` seeds it per round from the
FedSight stream (seed, "dp-noise", round) and restores the generator afterwards, so a DP run is
reproducible for a given seed.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg

from ..errors import ConfigError
from ..records import ClientResult
from ..rng import derive_seed
from .records import record_to_tensors, tensors_to_record


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
    a round with fewer updates must not be released (the server skips it). ``population`` and
    ``delta`` configure the accountant."""

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
    ):
        from flwr.serverapp import NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod

        self.global_params, self.seed, self.num_sampled = global_params, seed, num_sampled
        self.noise_multiplier, self.clipping_norm = float(noise_multiplier), float(clipping_norm)
        self.accountant = RdpAccountant(
            PrivacyConfig(
                target_delta=float(delta),
                population_size=int(population),
                neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                sampling_method=SamplingMethod.NO_AMPLIFICATION,
                max_epsilon=None,
            )
        )
        inner = FedAvg(fraction_train=1.0, min_train_nodes=num_sampled, min_available_nodes=num_sampled)
        self.strategy = DifferentialPrivacyServerSideFixedClipping(
            inner, self.noise_multiplier, self.clipping_norm, num_sampled, accountant=self.accountant
        )
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
            if all(float(v.abs().max()) == 0.0 for v in res.delta.values()) if res.delta else True:
                raise ValueError(
                    f"client {res.client_id} sent a zero model update: Flower 1.41's clipping divides by the update's "
                    "norm (ZeroDivisionError); a DP run needs clients that train (lr > 0, at least one step)"
                )
        if len(results) != self.num_sampled:
            raise ValueError(f"a DP release needs exactly {self.num_sampled} updates, got {len(results)}")
        self.releases += 1
        r = self.releases
        current = {k: v.detach().clone() for k, v in self.global_params().items()}
        keys = list(current)
        py_state, np_state = random.getstate(), np.random.get_state()
        try:
            np.random.seed(derive_seed(self.seed, "dp-noise", r) % (2**32))
            instructions = list(
                self.strategy.configure_train(r, tensors_to_record(current), ConfigRecord(), _ReleaseGrid(len(results)))
            )
            replies = []
            for ins, res in zip(instructions, results, strict=True):
                local = {k: current[k] + res.delta[k] for k in keys}
                content = RecordDict({"arrays": tensors_to_record(local), "metrics": MetricRecord({"num-examples": 1})})
                replies.append(Message(content, reply_to=ins))
            arrays, _ = self.strategy.aggregate_train(r, replies)
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
        if arrays is None:
            raise RuntimeError("Flower's DP wrapper released no aggregate")
        noised = record_to_tensors(ArrayRecord(arrays) if not isinstance(arrays, ArrayRecord) else arrays)
        return {k: (noised[k].to(current[k]) - current[k]) for k in keys}

    def privacy_spent(self) -> dict[str, float]:
        """Cumulative (epsilon, delta) of the releases so far (Flower's RDP accountant)."""
        spent = self.strategy.privacy_spent()
        if spent is None or spent.num_releases == 0:
            return {"dp/epsilon": 0.0, "dp/delta": float(self.accountant.config.target_delta), "dp/releases": 0}
        return {"dp/epsilon": float(spent.epsilon), "dp/delta": float(spent.delta), "dp/releases": int(spent.num_releases)}

    def state_dict(self) -> dict:
        return {"releases": self.releases}

    def load_state_dict(self, state: dict) -> None:
        if state.get("releases"):
            raise ValueError("a central-DP run cannot be resumed (the accountant's state is not checkpointed)")


def install_central_dp(sim: Any, *, noise_multiplier: float, clipping_norm: float, delta: float | None) -> CentralDP:
    """Replace the aggregator of every stage of ``sim`` (an ``engine.server.Server``) by one
    ``CentralDP`` (one accountant for the run). The recipe must weight uniformly with the mean
    aggregator and share no buffers."""
    for st in sim.stages:
        w, a = st.recipe.weighting.name, st.recipe.aggregator.name
        if w != "uniform" or a != "mean":
            raise ConfigError(
                f"central DP needs recipe.weighting = 'uniform' and recipe.aggregator = 'mean' (stage {st.name!r} has "
                f"{w!r} and {a!r}): the noise is calibrated to an equal-weight mean of clipped updates"
            )
    if sim.shared_buffers:
        raise ConfigError(
            f"central DP does not cover shared buffers ({', '.join(sim.shared_buffers[:3])}, ...): use a model without "
            "BatchNorm running statistics or keep them local (recipe.sharing / a norm-sharing component)"
        )
    sizes = {st.clients_per_round or sim.schedule.clients_per_round for st in sim.stages}
    if len(sizes) != 1:
        raise ConfigError(f"central DP needs one clients-per-round for the whole run, got {sorted(sizes)}")
    n = sim.task.num_clients
    dp = CentralDP(
        lambda: {k: sim.global_model.state_dict()[k] for k in sim.shared_params},
        noise_multiplier=noise_multiplier,
        clipping_norm=clipping_norm,
        num_sampled=sizes.pop(),
        population=n,
        delta=delta if delta is not None else min(1e-5, 1.0 / (10 * n)),
        seed=sim.seed,
    )
    for st in sim.stages:
        st.recipe.aggregator = dp
    return dp
