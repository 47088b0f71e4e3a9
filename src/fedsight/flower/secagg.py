"""Secure aggregation (SecAgg+) of the clients' updates through Flower's ``SecAggPlusWorkflow``.

SecAgg+ (Bell et al. 2020, "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead"; Bonawitz
et al. 2017 for SecAgg): each sampled client quantises its weighted update, adds a private mask and
pairwise masks agreed with ``num_shares - 1`` neighbours, and uploads only the masked integer vector; the
server learns the sum of the vectors and nothing else, and still gets the sum when clients drop out, as long
as ``reconstruction_threshold`` shares of each secret reach it. The protocol is Flower's, unchanged: the
server side is ``flwr.server.workflow.SecAggPlusWorkflow`` (four message exchanges a round: setup, share
keys, collect masked vectors, unmask), the node side ``flwr.client.mod.secaggplus_mod``. Flower 1.41 has
them only on its legacy ``Strategy``/``FitRes`` path; this module is the adapter:

* server (``SecAggRound``): the round's instruction (global state, broadcasts, config) travels to each
  sampled client's node as a legacy ``FitIns`` (``instruction_fitins``); a legacy ``Strategy`` hands the
  workflow the sampled nodes and receives the unmasked weighted mean. Each reply of every stage is
  checked first (``_CheckedGrid``): a reply that does not have the records, types, node ids, array count,
  shapes and value range that stage expects, or that is larger than ``max-reply-mb``, is dropped with its
  reason, and the protocol treats that node as dropped out (its masks are removed with the other nodes'
  shares). The round's clients become ``Reply``s that all carry the unmasked mean, so the round loop, the
  reply contract (shapes, dtypes, finite values, the example counts against the server's own sizes), the
  weighting and the server optimizer are the ones of every other run: the weighted mean of identical
  updates is that update. A node that leaves before the masked-vector stage restarts the protocol without it
  (``_EarlyDropout``). A protocol that halts (fewer live neighbours than the threshold) or fails (a share that
  does not reconstruct) skips the round with an event; nothing raises out of it.
* node (``secagg_train``): ``secaggplus_mod`` runs the protocol; for its masked-vector stage it calls
  FedSight's own training of the instruction and uploads, as one vector in the order the server names,
  the shared trainable parameters' update and the shared float buffers' change (local - global), with
  the recipe's weight: 1 (``recipe.weighting = "uniform"``) or the client's number of examples
  (``"data_size"``, divided by ``max_weight``, the largest client). A client that refuses the model or
  produces a non-finite update raises there, so the protocol sees it drop out.

Quantisation (Flower's): each value ``x * w / max_weight`` is clipped to ``[-clipping_range,
clipping_range]`` and stochastically rounded to one of ``quantization_range`` levels, so the mean differs
from the plain mean by at most one level (``2 clipping_range / quantization_range``, 3.8e-6 with the
defaults) divided by the mean weight ratio. Values outside the range are clipped: each node counts them
(``secagg/clipped`` in its reply; a ``secagg_clipped`` event on the server). The sum of ``m`` clients' levels
must stay below the modulus (``2**32``), so ``m * quantization_range < 2**32`` is checked before the run.
The stochastic rounding draws from NumPy's global generator, seeded per (run seed, round, client) just
before the node quantises, so a SecAgg run is reproducible.

Statistics (Fed3R, FedNCM: a stage whose trainer uploads sums, ``statistics_component``): each client adds its
statistics for all C classes (``functional.ridge.dense_statistics``) to the same protocol, as two limbs per entry
on Flower's grid (``encode_statistic``: clipping range 1, a power-of-two scale per statistic from
``ClosedFormClassifier.secure_fields``, ``stats_levels`` levels), so Flower's stochastic rounding rounds nothing
and the unmasked sum is exact to ``m * scale / Q**2`` per entry (``decode_sum``, ``sum_error``). The component
checks the group's sum (``secure_sum``); the sum rides on the group's first reply, zeros on the others, and every
reply passes the reply contract (``UploadContext.secure_sum``) or the whole group is rejected.

What it does not do: the server cannot inspect an update, so a malicious client can add any vector
in the quantised range to the sum (it controls its masked vector, including its weight factor), and nothing
per update (norm bounding, robust aggregators, FedVG) can run; those recipes are refused before the run
(``check_secagg``). Flower 1.41 seeds each mask's generator (NumPy's ``RandomState``) with 32 bits folded
from the 32-byte shared secret (``secaggplus_utils.pseudo_rand_gen``).
"""

from __future__ import annotations

import dataclasses
import io
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError
from .secagg_node import META, instruction_fitins
from .secagg_stats import MODULUS, Statistics, statistics_component, stats_levels

#: run-config keys of secure aggregation (``options.OPTIONS``) and their defaults
OPTIONS: dict[str, Any] = {
    "secagg": False,  # true: SecAgg+ through Flower's workflow
    "secagg-num-shares": 3,  # int >= 3: shares (neighbours + itself) per secret; float in (0, 1]: fraction of m
    "secagg-reconstruction-threshold": 2,  # int >= 2: shares that reconstruct a secret; float in (0, 1]: fraction
    "secagg-clipping-range": 8.0,  # |x * w / max_weight| above this is clipped before quantisation
    "secagg-quantization-range": 1 << 22,  # quantisation levels
    "secagg-feature-bound": 1024.0,  # |phi(x)_i| a Fed3R/FedNCM client's statistics are scaled for (rounded up to 2**k)
}
WEIGHTINGS = ("uniform", "data_size")
#: the options that are a count (int) or a fraction of the sampled clients (float), as Flower reads them
COUNT_OR_FRACTION = ("secagg-num-shares", "secagg-reconstruction-threshold")


def count_or_fraction(v: Any) -> Any:
    """A share option as Flower must see it: a whole number above 1 as an int (a count), anything else as given
    (a float in (0, 1] is a fraction; 1.0 means all)."""
    if isinstance(v, float) and v.is_integer() and v > 1:
        return int(v)
    return v


@dataclass(frozen=True)
class SecAggSettings:
    num_shares: int | float = 3
    reconstruction_threshold: int | float = 2
    clipping_range: float = 8.0
    quantization_range: int = 1 << 22
    feature_bound: float = 1024.0

    @classmethod
    def from_options(cls, opts: Mapping[str, Any]) -> "SecAggSettings":
        """The settings of run-config values (``OPTIONS`` keys), or a ``ConfigError`` naming the key."""
        import math

        def share(key: str, low: int) -> int | float:
            v = opts.get(key, OPTIONS[key])
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"run config {key} = {v!r} must be an integer or a fraction in (0, 1]")
            v = count_or_fraction(v)
            if isinstance(v, int) and v < low:
                raise ConfigError(f"run config {key} = {v!r} must be an integer >= {low} or a fraction in (0, 1]")
            if isinstance(v, float) and not 0 < v <= 1:
                raise ConfigError(f"run config {key} = {v!r} must be an integer >= {low} or a fraction in (0, 1]")
            return v

        shares = share("secagg-num-shares", 3)
        threshold = share("secagg-reconstruction-threshold", 2)
        if isinstance(shares, int) and isinstance(threshold, int) and threshold >= shares:
            raise ConfigError(f"run config secagg-reconstruction-threshold = {threshold} must be below "
                              f"secagg-num-shares = {shares}")
        clip = opts.get("secagg-clipping-range", OPTIONS["secagg-clipping-range"])
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not (math.isfinite(clip) and clip > 0):
            raise ConfigError(f"run config secagg-clipping-range = {clip!r} must be a finite number > 0")
        q = opts.get("secagg-quantization-range", OPTIONS["secagg-quantization-range"])
        if isinstance(q, float) and q.is_integer():
            q = int(q)
        if isinstance(q, bool) or not isinstance(q, int) or not 2 <= q < MODULUS:
            raise ConfigError(f"run config secagg-quantization-range = {q!r} must be an integer in [2, 2**32)")
        bound = opts.get("secagg-feature-bound", OPTIONS["secagg-feature-bound"])
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not (math.isfinite(bound) and bound > 0):
            raise ConfigError(f"run config secagg-feature-bound = {bound!r} must be a finite number > 0")
        return cls(shares, threshold, float(clip), q, float(bound))


# -- what may run under secure aggregation ----------------------------------------------------------


def check_secagg(sim: Any, settings: SecAggSettings, *, dp: bool = False) -> None:
    """Refuse (``ConfigError`` naming the config key) a run whose recipe needs more than the weighted mean of
    the updates: ``sim`` is an ``engine.server.Server``. A statistics stage must upload sums
    (``statistics_component``: Fed3R, FedNCM; not LADD's styles); every training stage must aggregate with
    ``recipe.aggregator = "mean"`` and weight with ``"uniform"`` or ``"data_size"``, share no integer buffer
    (BatchNorm's ``num_batches_tracked``: its change per round is the number of steps, outside any useful
    quantisation range) and have no component that needs each update (``Component.secure_aggregation_problem``);
    every round must sample at least 3 clients, at least ``num_shares`` when that is an integer, and few enough
    that their quantised sum fits the modulus. Central DP clips each update on the server: not with SecAgg."""
    from ..engine.plan import stage_layout

    if dp:
        raise ConfigError("run config secagg = true with central DP (dp-noise-multiplier > 0): Flower's server-side DP "
                          "clips each client's update, which secure aggregation hides; use one or the other")
    for st in sim.stages:
        where = f"stage {st.name!r}"
        if not st.recipe.trainer.trains:  # a statistics pass: summed (statistics_component), weights play no role
            if statistics_component(st) is None:
                raise ConfigError(f"secure aggregation sums what the clients upload, but {where}'s trainer "
                                  f"{getattr(st.recipe.trainer, 'name', type(st.recipe.trainer).__name__)!r} uploads "
                                  "statistics the server needs one by one (not their sum); drop that stage or secagg")
            for c in st.recipe.components:
                why = c.secure_aggregation_problem(st.recipe.weighting.name)
                if why:
                    raise ConfigError(f"recipe.components {c.name} ({where}) {why}: it cannot run under secure "
                                      "aggregation")
            continue
        w, a = st.recipe.weighting.name, st.recipe.aggregator.name
        if a != "mean":
            raise ConfigError(f"secure aggregation gives the server only the weighted mean of the updates, but "
                              f"recipe.aggregator = {a!r} ({where}) needs each update; use 'mean' or drop secagg")
        if w not in WEIGHTINGS:
            raise ConfigError(f"secure aggregation weights each update inside the mask by 1 or its example count, "
                              f"but recipe.weighting = {w!r} ({where}) needs each update; use 'uniform' or 'data_size'")
        for c in st.recipe.components:
            why = c.secure_aggregation_problem(w)
            if why:
                raise ConfigError(f"recipe.components {c.name} ({where}) {why}: it cannot run under secure aggregation")
        layout = stage_layout(sim.global_model, st)
        state = sim.global_model.state_dict()
        ints = [k for k in layout.shared_buffers if not state[k].is_floating_point()]
        if ints:
            raise ConfigError(f"secure aggregation cannot carry the shared integer buffer {ints[0]!r} ({where}; BatchNorm's "
                              "step counter): keep BatchNorm local (a norm-sharing component such as fedbn, or "
                              "recipe.sharing) or use model.norm = 'group' or 'none'")
        if not layout.shared_params and not layout.shared_buffers:
            raise ConfigError(f"secure aggregation sums model updates, but {where} shares nothing (recipe.sharing, "
                              "train.freeze)")
    statistics = {st.name for st in sim.stages if not st.recipe.trainer.trains}
    for name, m in stage_sample_sizes(sim):
        where = f" in stage {name!r}" if name else ""
        if m < 3:
            raise ConfigError(f"secure aggregation needs at least 3 clients a round, but {m} are sampled{where} "
                              "(server.clients_per_round / server.fraction)")
        if isinstance(settings.num_shares, int) and settings.num_shares > m:
            raise ConfigError(f"run config secagg-num-shares = {settings.num_shares} exceeds the {m} clients sampled "
                              f"per round{where}")
        if name not in statistics and m * settings.quantization_range >= MODULUS:  # (statistics: stats_levels)
            raise ConfigError(f"run config secagg-quantization-range = {settings.quantization_range} is too large for "
                              f"{m} clients a round{where}: their quantised sum must stay below 2**32")


def stage_sample_sizes(sim: Any) -> list[tuple[str, int]]:
    """(stage name, clients sampled per round) of each stage of ``sim``."""
    n = sim.task.num_clients
    return [(st.name, min(n, st.clients_per_round or sim.schedule.clients_per_round)) for st in sim.stages]


# -- the server side --------------------------------------------------------------------------------


def _load_array(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is int for x in v)


def _bytes(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, bytes) for x in v)


@dataclass
class _Expect:
    """What the masked-vector replies of a round must be: the node -> client map, the shapes of the uploaded
    arrays (after the weight factor), the modulus and the byte limit."""

    client_of: dict[int, int]
    shapes: list[tuple[int, ...]]
    max_bytes: int
    round: int = 0
    nonce: int | None = None  # the round's fresh server nonce, which each masked-vector reply must echo
    seen_keys: set = dataclasses.field(default_factory=set)  # every public key accepted so far in this run


def reply_problem(stage: str, request: Any, reply: Any, expect: _Expect) -> str | None:
    """Why ``reply`` (to ``request``, of protocol stage ``stage``) cannot be used (None: it can). Its size is
    ``_CheckedGrid``'s to check, before this parses anything."""
    import flwr.compat.common.recorddict_compat as compat
    from flwr.app import ConfigRecord
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
    from flwr.supercore.primitives.asymmetric import bytes_to_public_key

    rec = reply.content.config_records.get(RECORD_KEY_CONFIGS)
    if not isinstance(rec, ConfigRecord):
        return f"no {RECORD_KEY_CONFIGS!r} record"
    node = int(reply.metadata.src_node_id)
    asked = request.content.config_records[RECORD_KEY_CONFIGS]
    if stage == Stage.SETUP:
        keys = [rec.get(Key.PUBLIC_KEY_1), rec.get(Key.PUBLIC_KEY_2)]
        if not _bytes(keys) or len(set(keys)) != 2 or sum(len(k) for k in keys) > 4096:
            return "its public keys are not two distinct byte strings"
        try:
            for k in keys:
                bytes_to_public_key(k)
        except Exception:
            return "a public key does not parse"
        if any(k in expect.seen_keys for k in keys):  # the protocol's keys are fresh every round
            return "replay: its public keys were already used in this run"
        expect.seen_keys.update(keys)
    elif stage == Stage.SHARE_KEYS:
        neighbours = {int(k) for k in asked if k != Key.STAGE} - {node}
        dsts, texts = rec.get(Key.DESTINATION_LIST), rec.get(Key.CIPHERTEXT_LIST)
        if not (_ints(dsts) and _bytes(texts)) or len(dsts) != len(texts):
            return "destinations and ciphertexts are not two lists of equal length (ints, bytes)"
        if len(set(dsts)) != len(dsts) or not set(dsts) <= neighbours:
            return "its key shares go to nodes that are not its neighbours (or twice to one)"
    elif stage == Stage.COLLECT_MASKED_VECTORS:
        masked = rec.get(Key.MASKED_PARAMETERS)
        if not _bytes(masked) or len(masked) != 1 + len(expect.shapes):
            return f"not {1 + len(expect.shapes)} masked arrays"
        for i, (b, shape) in enumerate(zip(masked, [(1,), *expect.shapes])):
            try:
                arr = _load_array(b)
            except Exception:
                return f"masked array {i} does not parse"
            if arr.dtype.kind not in "iu" or tuple(arr.shape) != tuple(shape):
                return f"masked array {i} is {arr.dtype}{list(arr.shape)}, expected integers of shape {list(shape)}"
            if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= MODULUS):
                return f"masked array {i} has values outside [0, 2**32)"
        try:
            fitres = compat.recorddict_to_fitres(reply.content, keep_input=True)
            meta = {k: fitres.metrics[f"{META}{k}"] for k in ("client-id", "num-examples", "num-steps", "flops")}
        except Exception as exc:
            return f"its plain records are unreadable ({type(exc).__name__}: {exc})"
        echoed = (fitres.metrics.get(f"{META}round"), fitres.metrics.get(f"{META}nonce"))
        if echoed != (expect.round, expect.nonce):
            return (f"replay: it echoes round {echoed[0]!r}, this is round {expect.round}" if echoed[0] != expect.round
                    else f"replay: it echoes another nonce than round {expect.round}'s instruction")
        bad = [k for k, v in fitres.metrics.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
        if bad:
            return f"metric {bad[0]!r} is not a number"
        if meta["client-id"] != expect.client_of.get(node):
            return f"it answers as client {meta['client-id']}, but its node holds client {expect.client_of.get(node)}"
    elif stage == Stage.UNMASK:
        allowed = set(asked.get(Key.ACTIVE_NODE_ID_LIST, [])) | set(asked.get(Key.DEAD_NODE_ID_LIST, []))
        nids, shares = rec.get(Key.NODE_ID_LIST), rec.get(Key.SHARE_LIST)
        if not (_ints(nids) and _bytes(shares)) or len(nids) != len(shares):
            return "node ids and shares are not two lists of equal length (ints, bytes)"
        if len(set(nids)) != len(nids) or not set(nids) <= allowed:
            return "it sends shares of nodes it was not asked for (or twice)"
    return None


class _CheckedGrid:
    """The round's ``Grid`` as the workflow sees it: each message goes out on its own (``exchange_messages``),
    and each reply is checked (``reply_problem``) before the workflow reads it; a reply that fails
    (``rejected``) and a node that does not answer within the timeout or answers with an error (``lost``) are
    left out, so the protocol treats the node as dropped. Both map node -> "stage: reason"."""

    def __init__(self, grid: Any, expect: _Expect, timeout: float, poll: float):
        self.grid, self.expect, self.timeout, self.poll = grid, expect, timeout, poll
        self.rejected: dict[int, str] = {}
        self.lost: dict[int, str] = {}
        self.sent: dict[int, int] = {}  # node -> bytes of its accepted protocol replies (keys, shares, masked vector)

    def get_node_ids(self) -> Any:
        return self.grid.get_node_ids()

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Any]:
        from flwr.app import ConfigRecord
        from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

        from .exchange import exchange_messages

        messages = list(messages)
        if not messages:
            return []
        stage = str(messages[0].content.config_records[RECORD_KEY_CONFIGS][Key.STAGE])
        by_node = {int(m.metadata.dst_node_id): m for m in messages}
        got, failed = exchange_messages(self.grid, messages, self.timeout, self.poll)
        for node, why in failed.items():
            self.lost.setdefault(node, f"{stage}: {why}")
        out = []
        for node, reply in got.items():
            rec = reply.content.config_records.get(RECORD_KEY_CONFIGS)
            size = _payload_bytes(rec) if isinstance(rec, ConfigRecord) else 0
            try:
                why = ("its reply exceeds the size limit (max-reply-mb)" if size > self.expect.max_bytes
                       else reply_problem(stage, by_node[node], reply, self.expect))
            except Exception as exc:  # whatever a tampered reply makes a check raise is a refusal too
                why = f"unreadable ({type(exc).__name__})"
            if why is None:
                out.append(reply)
                self.sent[node] = self.sent.get(node, 0) + size
            else:
                self.rejected.setdefault(node, f"{stage}: {why}")
        if stage in (Stage.SETUP, Stage.SHARE_KEYS) and len(out) < len(messages):
            raise _EarlyDropout(set(by_node) - {int(m.metadata.src_node_id) for m in out})
        return out


def _payload_bytes(record: Any) -> int:
    """The bytes a protocol record carries: byte strings as they are, numbers as 8 bytes."""
    total = 0
    for v in record.values():
        for x in v if isinstance(v, list) else [v]:
            total += len(x) if isinstance(x, (bytes, str)) else 8
    return total


class _EarlyDropout(Exception):
    """Nodes left before the masked-vector stage. Flower 1.41's workflow would still count them as dropped
    in the unmask stage and ask the others for shares of secrets they never received (the round then
    halts), so the protocol starts again without them: nothing was masked or trained yet."""

    def __init__(self, nodes: set[int]):
        super().__init__(f"nodes {sorted(nodes)} left before the masked-vector stage")
        self.nodes = nodes


class _Proxy:
    """The legacy ``ClientProxy`` of a node: the workflow reads only its ``node_id``."""

    def __init__(self, node_id: int):
        self.node_id, self.cid = int(node_id), str(node_id)


class _Strategy:
    """The legacy ``Strategy`` the workflow drives: ``configure_fit`` names the round's nodes with their
    instructions; ``aggregate_fit`` receives the unmasked mean (every result carries it) and keeps it."""

    def __init__(self, fitins: dict[int, Any]):
        self.fitins = fitins
        self.results: list[tuple[Any, Any]] | None = None

    def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> list[tuple[Any, Any]]:
        return [(_Proxy(node), ins) for node, ins in self.fitins.items()]

    def aggregate_fit(self, server_round: int, results: list[tuple[Any, Any]], failures: list[Any]) -> tuple[Any, dict]:
        self.results = list(results)
        return None, {}  # the FedSight server applies the mean (SecAggRound.train)


def _legacy_context(round: int, strategy: _Strategy) -> Any:
    from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
    from flwr.server import LegacyContext, ServerConfig

    state = RecordDict({"config": ConfigRecord({"current_round": int(round)}), "parameters": ArrayRecord()})
    base = Context(run_id=0, node_id=0, node_config={}, state=state, run_config={})
    return LegacyContext(base, config=ServerConfig(num_rounds=max(1, round)), strategy=strategy)  # type: ignore[arg-type]


class SecAggRound:
    """The training half of a round under SecAgg+ (``FlowerBackend.train`` delegates here)."""

    def __init__(self, backend: Any, settings: SecAggSettings):
        self.backend, self.settings = backend, settings
        server = backend.server
        if server.sizes_known:
            self.max_examples = max(server.task.num_train_examples(c) for c in range(server.task.num_clients))
        else:
            self.max_examples = int(server.max_examples)
        server.secure_sum = True  # the reply contract: a statistics reply carries its share of the group's sum
        self.seen_keys: set = set()  # the protocol public keys accepted in this run (a replayed setup reply reuses some)

    def statistics(self, m: int) -> Any:
        """How a statistics stage's clients add their statistics to the sum (``secagg_stats.Statistics``), None in a training
        stage. ``m``: the clients of the round (the levels depend on it)."""
        server = self.backend.server
        comp = statistics_component(server.stages[server.stage_index]) if not server.recipe.trainer.trains else None
        if comp is None:
            return None
        model = server.global_model
        classes = comp.classes_of(model, server.task)
        fields = comp.secure_fields(model, classes, self.max_examples, self.settings.feature_bound)
        return Statistics(comp, classes, fields, stats_levels(m))

    def train(self, plan: Any) -> tuple[list[Any], list[dict[str, Any]]]:
        from flwr.server.workflow import SecAggPlusWorkflow

        from ..engine.plan import Reply
        from ..records import ClientResult
        from . import records as FR

        b, s, r = self.backend, self.settings, plan.round
        server = b.server
        events = b.identify(r)
        nodes = {c: b.node_of[c] for c in plan.sampled if b.node_of.get(c) in b.online}
        client_of = {n: c for c, n in nodes.items()}
        gstate = server.global_model.state_dict()
        params, buffers = list(server.layout.shared_params), list(server.layout.shared_buffers)
        stats = self.statistics(len(nodes))
        if stats is not None:  # sums of statistics: weight 1, clipping range 1, the round's own levels
            params, buffers = [], []
            s = dataclasses.replace(s, clipping_range=1.0, quantization_range=stats.levels)
        weighting = server.recipe.weighting.name if stats is None else "uniform"
        max_weight = 1.0 if weighting == "uniform" else float(max(1, self.max_examples))
        nonce = secrets.randbits(62)  # fresh per round: a masked vector resent from an earlier round echoes another
        extra = {"secagg-nonce": nonce, "secagg-params": params, "secagg-buffers": buffers, "secagg-weighting": weighting,
                 "secagg-max-weight": max_weight, "secagg-clipping-range": s.clipping_range, "secagg-seed": int(server.seed)}
        if stats is not None:
            extra.update(stats.config())
        fitins = {}
        for c, n in nodes.items():
            own = {c: plan.client_broadcast[c]} if c in plan.client_broadcast else None
            content = FR.instruction_content(r, [c], gstate, plan.broadcast, own, **b.task_info, **extra)  # its own only
            fitins[n] = instruction_fitins(content)
        shapes = ([tuple(gstate[k].shape) for k in params + buffers] if stats is None else
                  [(2, *shape) for _, shape, _ in stats.fields])
        grid = _CheckedGrid(b.grid, _Expect(client_of, shapes, b.max_reply_bytes, r, nonce, self.seen_keys), b.opts.round_timeout,
                            b.opts.poll_interval)
        strategy = _Strategy(fitins)
        failed_protocol = None
        while len(strategy.fitins) >= 2:
            workflow = SecAggPlusWorkflow(s.num_shares, s.reconstruction_threshold, max_weight=max_weight,
                                          clipping_range=s.clipping_range, quantization_range=s.quantization_range,
                                          modulus_range=MODULUS, timeout=b.opts.round_timeout)
            try:
                workflow(grid, _legacy_context(r, strategy))  # type: ignore[arg-type]
            except _EarlyDropout as exc:  # start again without them (_EarlyDropout says why)
                strategy = _Strategy({n: ins for n, ins in strategy.fitins.items() if n not in exc.nodes})
                continue
            except Exception as exc:  # e.g. a share that does not reconstruct its secret
                failed_protocol = f"{type(exc).__name__}: {exc}"
            break
        b.failed_nodes = set(grid.lost) | set(grid.rejected)
        got: dict[int, Any] = {}
        gone = "dropped out"
        if strategy.results is None:  # halted (too few live neighbours) or failed: nothing to aggregate
            why = failed_protocol or ("fewer than 2 clients left" if len(strategy.fitins) < 2 else
                                      "the protocol halted: fewer live neighbours than the reconstruction threshold")
            events.append({"round": r, "event": "secagg_failed", "reason": why,
                           "nodes": {str(n): v for n, v in sorted({**grid.lost, **grid.rejected}.items())}})
            gone = f"the protocol failed ({why})"
        else:
            why, arrays = self._check_mean(strategy.results, shapes, max_weight, weighting, s)
            group: dict[str, torch.Tensor] = {}
            if why is None and stats is not None:
                total = sum(int(f.metrics[f"{META}num-examples"]) for _, f in strategy.results)
                why, group = stats.group_sum(arrays, len(strategy.results), total, server.task.num_clients)
            carrier = (min((client_of[int(p.node_id)] for p, _ in strategy.results), key=plan.sampled.index)
                       if stats is not None else None)
            for proxy, fitres in strategy.results:
                node = int(proxy.node_id)
                c = client_of[node]
                if why is not None:
                    got[c] = Reply(c, None, False, f"secure aggregation: {why}", {"node": node}, rejected=True)
                    continue
                m = fitres.metrics
                delta = {k: torch.from_numpy(a).to(gstate[k].dtype) for k, a in zip(params, arrays)}
                bufs = {k: (gstate[k].to(torch.float64) + torch.from_numpy(a)).to(gstate[k].dtype)
                        for k, a in zip(buffers, arrays[len(params):])}
                res = ClientResult(client_id=int(m[f"{META}client-id"]), num_examples=int(m[f"{META}num-examples"]),
                                   delta=delta, buffers=bufs,
                                   metrics={k: float(v) for k, v in m.items() if not k.startswith(META)},
                                   num_steps=int(m[f"{META}num-steps"]), flops=float(m[f"{META}flops"]))
                if stats is not None:  # the group's sum on one reply, zeros on the others: their sum is exact
                    res.extras[stats.component.name] = {k: (v.clone() if c == carrier or not v.is_floating_point()
                                                            else torch.zeros_like(v)) for k, v in group.items()}
                got[c] = Reply(c, res, True, info={"node": node}, up_bytes=grid.sent.get(node))
                if m.get(f"{META}secagg-clipped"):
                    events.append({"round": r, "event": "secagg_clipped", "client": c, "node": node,
                                   "values": int(m[f"{META}secagg-clipped"]), "clipping_range": s.clipping_range})
        if stats is not None and got and all(rep.result is not None for rep in got.values()):
            # the group's sum is one: a reply the contract refuses (its claimed examples) would lose part of it
            bad = next(((c, why) for c, rep in got.items() if (why := server.rejection(rep)) is not None), None)
            if bad is not None:
                got = {c: Reply(c, None, False, f"secure aggregation: the group's sum cannot be used, client {bad[0]}'s "
                                f"reply is refused ({bad[1]})", rep.info, rejected=True) for c, rep in got.items()}
        # a node whose update counted but whose later reply (its key shares) was refused
        events += [{"round": r, "event": "secagg_reply_rejected", "client": client_of[n], "node": n, "reason": why}
                   for n, why in sorted(grid.rejected.items()) if client_of[n] in got]
        out = []
        for c in plan.sampled:
            node = nodes.get(c, b.node_of.get(c))
            if c in got:
                out.append(got[c])
            elif node in grid.rejected:
                out.append(Reply(c, None, False, f"secure aggregation: {grid.rejected[node]}", {"node": node},
                                 rejected=True))
            else:
                reason = ("no node known to hold this client" if node is None else "its node is offline" if c not in nodes
                          else f"secure aggregation: {grid.lost.get(node, gone)}")
                out.append(Reply(c, None, False, reason, {"node": node}))
        return out, events

    def _check_mean(self, results: list[tuple[Any, Any]], shapes: list[tuple[int, ...]], max_weight: float,
                    weighting: str, settings: SecAggSettings) -> tuple[str | None, list[np.ndarray]]:
        """(why the unmasked mean cannot be used or None, its arrays). It must have the uploaded arrays' shapes,
        be finite and lie where a mean of clipped values can: each client's ``x w / max_weight`` is within
        +-clipping_range, so the mean is within ``+-clipping_range * m / sum_k(w_k / max_weight)`` (a share or
        masked vector that was wrong unmasks to values far outside)."""
        from flwr.common import parameters_to_ndarrays

        try:
            arrays = [np.asarray(a, dtype=np.float64) for a in parameters_to_ndarrays(results[0][1].parameters)]
        except Exception as exc:
            return f"the unmasked mean is unreadable ({type(exc).__name__})", []
        if len(arrays) != len(shapes) or any(tuple(a.shape) != sh for a, sh in zip(arrays, shapes)):
            return "the unmasked mean does not have the uploaded arrays' shapes", []
        if not all(np.isfinite(a).all() for a in arrays):
            return "the unmasked mean is not finite", []
        weights = [1.0 if weighting == "uniform" else float(f.metrics[f"{META}num-examples"]) for _, f in results]
        total = sum(w / max_weight for w in weights)
        bound = settings.clipping_range * len(results) / total if total > 0 else float("inf")
        top = max((float(np.abs(a).max()) for a in arrays if a.size), default=0.0)
        if top > bound * (1 + 1e-6) + 4 * settings.clipping_range / settings.quantization_range:
            return (f"the unmasked mean reaches {top:.3g}, outside the +-{bound:.3g} that {len(results)} clipped updates "
                    "can give (a key share or masked vector was wrong)"), []
        return None, arrays
