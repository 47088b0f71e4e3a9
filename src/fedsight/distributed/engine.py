"""The distributed backend: a round's clients trained by long-lived ranks, the server on rank 0.

Rank 0 is the in-process simulation (``engine.simulation.Simulation``) with ``DistributedBackend`` in place of
``InProcessBackend``: it samples, broadcasts, accepts, aggregates, steps the server optimizer, evaluates and
alone writes the run directory, exactly as one process does. Only the client half of a round is shared out:

1. rank 0 splits the round's sampled clients over the ranks by estimated cost (``split_clients``: a client's
   local steps x examples a step x the model's training FLOPs an example; greedy, largest first, onto the least
   loaded rank);
2. it sends each rank its order: the round and the global model state (packed once, the same bytes to every
   rank), and per client what it receives besides the model (``RoundPlan.broadcast_for``) and its stored state
   (SCAFFOLD's control variate, FedBN's personal entries: every key the store holds for it), read from the run
   directory's store;
3. every rank trains its share with ``InProcessBackend.train``, the one-process engine's own client half
   (vectorised or one client at a time, simulated dropout and deadline, ``keep``), rank 0 included;
4. rank 0 receives each rank's replies and the state its clients saved as one message, writes that state into
   the same store, and hands the server every reply in the sampled order: aggregation, robust rules and server
   optimizers see what one process would. Rank 0 checks a rank's uploads for non-finite values in one pass over
   the message's buffer and seals them (``contract.FiniteSeal``), so the server's contract check does not read
   them again, as for rank 0's own clients.

Every message is a small pickled header and one flat tensor of its tensors' bytes (``wire``: pickling each tensor
took as long as the bench's small CNN took to train), sent point to point on the CPU.

Clients train from the same streams (seed, "client", round, client) wherever they run, so with clients trained
one at a time the run equals the one-process run bit for bit, whatever the number of ranks; vectorised, a
rank trains its share as one group, which equals other groupings to float tolerance. Nothing lives on a
worker from one round to the next but its data and work model: a run resumes with any number of ranks.
A worker that fails (its training raises) answers with its error: rank 0 raises ``RankFailed`` naming it, before
this round is checkpointed. The clients' local test sets (``eval.local``) are evaluated the same way, split over
the ranks by test-set size (``DistributedBackend.client_evaluation``); the global model's evaluation runs on rank 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..engine.contract import FiniteSeal
from ..engine.loop import ClientEvaluation, InProcessBackend
from ..engine.plan import Reply, RoundPlan
from ..errors import ConfigError
from ..metrics import MetricState
from ..records import ClientResult
from ..rng import np_rng
from ..state import ClientStateStore
from . import shm, wire
from .world import LAUNCH_ENV, RankFailed, World, lost, one_line, wire_group


def client_costs(server: Any, runtime: Any, r: int, clients: Sequence[int]) -> list[float]:
    """Each client's estimated training FLOPs in round ``r``: local steps x examples a step (the batch size,
    or the client's examples when fewer) x the model's FLOPs for one example's forward and backward
    (``cost.ModelCost.train_step``). A client the simulated dropout removes costs 0. A proxy: a component that
    adds forwards (a teacher, a distillation) scales every client alike."""
    local, task, seed, sch = server.local, server.task, server.seed, server.schedule
    flops = runtime.cost.train_step(1, "all") or 1.0
    out = []
    for cid in clients:
        if sch.dropout > 0 and np_rng(seed, "dropout", r, cid).random() < sch.dropout:
            out.append(0.0)
            continue
        n = task.num_train_examples(cid)
        out.append(float(local.num_steps(n, seed, r, cid)) * min(local.batch_size, max(n, 1)) * flops)
    return out


def split_clients(clients: Sequence[int], costs: Sequence[float], ranks: int) -> list[list[int]]:
    """``clients`` over ``ranks`` shares of about equal total cost: the most costly first, each onto the least
    loaded rank (the lowest rank on a tie; equal costs then go round-robin); each share in client-id order."""
    loads, shares = [0.0] * ranks, [[] for _ in range(ranks)]
    for cost, cid in sorted(zip(costs, clients), key=lambda p: (-p[0], p[1])):
        k = min(range(ranks), key=lambda i: (loads[i], len(shares[i]), i))
        loads[k] += cost
        shares[k].append(cid)
    return [sorted(s) for s in shares]


class ShippingStore(ClientStateStore):
    """A worker's client-state store for one round: the state rank 0 shipped for the worker's clients, in memory,
    and every save the clients make (``outbox``), which goes back to rank 0 with the replies and into the run's
    store there. It holds no secret: the clients' own secrets (``privacy.noise = "secret"``) and a key shared by
    the clients live in rank 0's run directory only (``check_secrets`` refuses such a run before it starts)."""

    def __init__(self) -> None:
        super().__init__(None, one_client=True)
        self.outbox: list[tuple[str, int, int, dict[str, torch.Tensor]]] = []

    def receive(self, states: dict[int, dict[str, dict[str, torch.Tensor]]]) -> None:
        """This round's state, {client: {key: tensors}} (the round a version was written in matters only to rank 0's
        files); the outbox starts empty."""
        self._index, self._mem, self.outbox = {}, {}, []
        for cid, by_key in states.items():
            for key, tensors in by_key.items():
                self._index.setdefault(key, {})[cid] = -1
                self._mem[(key, cid)] = tensors

    def put(self, key: str, client: int, round: int, tensors: dict[str, torch.Tensor]) -> None:
        super().put(key, client, round, tensors)
        self.outbox.append((key, client, round, self._mem[(key, client)]))

    def secret(self, name: str) -> bytes:
        raise ConfigError(f"client secret {name!r}: a distributed run keeps the clients' secrets on rank 0 only; run "
                          'on one process, or with privacy.noise = "simulated"')


def check_secrets(cfg: Any, stages: Any, world: World) -> None:
    """Refuse, before the run starts, a distributed run whose clients draw noise or keys from their own secrets."""
    from ..secret import secret_users

    users = secret_users(stages)
    if cfg.privacy.noise == "secret" and users:
        raise ConfigError(f'privacy.noise = "secret" with {world.size} ranks: the clients\' secrets '
                          f'({", ".join(users)}) live in rank 0\'s run directory only; run on one process, or with '
                          'privacy.noise = "simulated"')


def _portable(rep: Reply) -> Reply:
    """A reply fit to cross to rank 0: no finite seal (a seal holds only in its process: rank 0 checks the message
    and seals the replies it received, ``_sealed``). ``wire.pack`` copies each tensor's own elements (a vectorised
    client's delta is a row of a larger stack) to the CPU."""
    return dataclasses.replace(rep, finite_seal=None)


def _sealed(replies: list[Reply], finite: bool) -> list[Reply]:
    """A rank's replies, each accepted one sealed when every floating-point tensor of its message was found finite
    here (``wire.finite_sections``); otherwise as received (the server checks each)."""
    if not finite:
        return replies
    return [dataclasses.replace(rep, finite_seal=FiniteSeal.of(rep.result))
            if rep.accepted and isinstance(rep.result, ClientResult) else rep for rep in replies]


def _local_states(runtime: Any, clients: Sequence[int], gstate: dict[str, torch.Tensor],
                  gmodel: Any = None) -> dict[int, tuple[MetricState, int]]:
    """Each client's local-test metric state and test-set size (``InProcessBackend.client_evaluation``'s)."""
    return {cid: (runtime.local_state(cid, gstate, gmodel), runtime.task.num_test_examples(cid)) for cid in clients}


class _ServerView:
    """What ``InProcessBackend.train`` reads of the server, on a worker: the schedule, the seed, the round's
    global state."""

    def __init__(self, schedule: Any, seed: int):
        self.schedule, self.seed, self.state = schedule, seed, {}

    def global_state(self) -> dict[str, torch.Tensor]:
        return self.state


class DistributedBackend(InProcessBackend):
    """Rank 0's backend: the round's clients trained over every rank (the module's steps 1-4); the rest
    (admission with central DP, evaluation on rank 0's runtime) is ``InProcessBackend``'s."""

    #: run.json's ``backend`` of the sessions this backend trains
    name = "distributed"

    def __init__(self, server: Any, runtime: Any, world: World):
        super().__init__(server, runtime)
        self.world = world
        #: what run.json records besides the backend (``api.start_run_dir``)
        self.session: dict[str, Any] = {"ranks": world.size, "dist_backend": dist.get_backend(),
                                        "messages": "shared memory" if shm.enabled() else "gloo"}
        launched = os.environ.get(LAUNCH_ENV)
        if launched:  # `fedsight run ... --nproc N`: the ranks' own command (run.json's "command") lacks --nproc
            self.session["launched_by"] = json.loads(launched)
        self.closed = False

    def _shipped(self, cid: int) -> dict[str, dict[str, torch.Tensor]]:
        """Every kind of state the run's store holds for ``cid`` (read and checked as one process reads it)."""
        store = self.runtime.store
        return {key: got for key in store.keys() if (got := store.get(key, cid)) is not None}

    def train(self, plan: RoundPlan) -> tuple[list[Reply], list[dict[str, Any]]]:
        costs = client_costs(self.server, self.runtime, plan.round, plan.sampled)
        shares = split_clients(plan.sampled, costs, self.world.size)
        works = [[(cid, plan.broadcast_for(cid), self._shipped(cid)) for cid in share] for share in shares[1:]]
        (replies, events), theirs = self._exchange(
            plan.round, ("train", plan.round, self.server.global_state()), works,
            lambda: InProcessBackend.train(self, dataclasses.replace(plan, sampled=shares[0])))
        by_client = {rep.client: rep for rep in replies}
        store = self.runtime.store
        for (their_replies, their_events, outbox), finite in theirs:
            by_client.update((rep.client, rep) for rep in _sealed(their_replies, finite))
            # (the one-process backend reports a stage's sequential training once: rank 0 did)
            events += [e for e in their_events if e.get("event") != "sequential_training"]
            for key, cid, rnd, tensors in outbox:  # (the store copies: views of the message's buffer are fine)
                store.put(key, cid, rnd, tensors)
        return [by_client[cid] for cid in plan.sampled], events

    def client_evaluation(self, r: int, *, local: bool, personal: bool) -> ClientEvaluation:
        """The clients' local-test metric states, split over the ranks by test-set size and computed as one
        process computes them (``ClientRuntime.local_state``, on each client's model), gathered in client-id
        order; the global evaluation itself runs on rank 0."""
        if not local:
            return super().client_evaluation(r, local=local, personal=personal)
        task, runtime = self.server.task, self.runtime
        clients = [cid for cid in range(task.num_clients) if task.num_test_examples(cid) > 0]
        shares = split_clients(clients, [float(task.num_test_examples(cid)) for cid in clients], self.world.size)
        mine, theirs = self._exchange(r, ("eval", r, self.server.global_state()),
                                      [[(cid, self._shipped(cid)) for cid in share] for share in shares[1:]],
                                      lambda: _local_states(runtime, shares[0], self.server.global_state(),
                                                            self.server.global_model))
        device = self.server.device
        states = dict(mine)
        for got, _ in theirs:
            states.update((cid, (MetricState(st.reductions, {k: v.to(device, copy=True) for k, v in
                                                             st.tensors().items()}), n))
                          for cid, (st, n) in got.items())
        out = ClientEvaluation(store=runtime.store)
        out.states = {cid: states[cid] for cid in clients}
        return out

    def _exchange(self, r: int, common: Any, works: list[Any], own: Any) -> tuple[Any, list[tuple[Any, bool]]]:
        """Send rank k (1, 2, ...) the message (``common``, ``works[k - 1]``): ``common`` packed once, the same
        bytes to every rank; run ``own()`` here; receive each rank's answer. Returns (own result, [(rank k's
        answer, whether every floating-point tensor in it is finite)]); a rank's error is a ``RankFailed`` naming
        it."""
        group = wire_group()
        try:
            shared = wire.pack(common)
            for rank, work in enumerate(works, start=1):
                wire.send([shared, wire.pack(work)], rank, group)
        except RuntimeError as exc:
            raise lost(exc, f"the other ranks in round {r}") from None
        del works, shared
        own_error, mine = None, None
        try:
            mine = own()
        except Exception as exc:  # noqa: BLE001 - receive first, so that no rank is left waiting; raised below
            own_error = exc
        got = []
        try:
            for rank in range(1, self.world.size):
                got.append(wire.recv(rank, group))
        except RuntimeError as exc:
            raise lost(exc, f"the other ranks in round {r}") from None
        if own_error is not None:
            raise own_error
        theirs = []
        for rank, [(header, buf)] in enumerate(got, start=1):
            status, answer = wire.unpack(header, buf)
            if status == "error":
                raise RankFailed(f"rank {rank}: {answer}")
            theirs.append((answer, wire.finite_sections(header, buf)))
        return mine, theirs

    def close(self, failed: bool = False) -> None:
        """Tell every worker that this run is over (it goes on to the next run of a sweep, or exits), and whether
        it ended in an error (``failed``). Errors are not raised: a worker that died already made rank 0's last
        exchange fail, and that error is the one reported."""
        if self.closed:
            return
        self.closed = True
        try:
            for rank in range(1, self.world.size):
                wire.send_stop(rank, wire_group(), failed)
        except Exception:  # noqa: BLE001
            pass


def serve(runtime: Any, schedule: Any, seed: int, world: World) -> bool:
    """A worker's rounds: train each order's clients, answer rank 0, until it says stop; whether the run ended
    without an error (rank 0's word with the stop). A failure of this rank's training is answered as the error's
    one line (rank 0 fails the run naming this rank); the worker then waits for the stop."""
    store = runtime.store
    backend = InProcessBackend(_ServerView(schedule, seed), runtime)  # type: ignore[arg-type]
    group = wire_group()
    while True:
        try:
            message = wire.recv(0, group)
        except RuntimeError as exc:
            raise lost(exc, "rank 0") from None
        if isinstance(message, wire.Stop):
            return not message.failed
        try:
            (kind, r, gstate), work = (wire.unpack(header, buf) for header, buf in message)
            del message
            store.receive({cid: item[-1] for cid, *item in work})
            backend.server.state = {k: v.to(runtime.device) for k, v in gstate.items()}
            backend.enter_round(r)
            if kind == "eval":
                answer: Any = ("ok", {cid: (MetricState(st.reductions, st.tensors()), n) for cid, (st, n) in
                                      _local_states(runtime, [cid for cid, _ in work], backend.server.state).items()})
            else:
                plan = RoundPlan(r, None, [cid for cid, _, _ in work], {}, {},
                                 client_broadcast={cid: sent for cid, sent, _ in work})
                replies, events = backend.train(plan)
                answer = ("ok", ([_portable(rep) for rep in replies], events, store.outbox))
            packed = wire.pack(answer)
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the run naming this rank
            packed = wire.pack(("error", one_line(exc)))
        answer = work = gstate = None
        try:
            wire.send([packed], 0, group)
        except RuntimeError as exc:
            raise lost(exc, "rank 0") from None
