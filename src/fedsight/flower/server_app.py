"""The FedSight ServerApp: FedSight's round loop over Flower's ``Grid``.

No algorithm logic here: the server builds the run's ``Server`` (``fedsight.api.build_server``) and runs
the one round loop of every engine (``fedsight.engine.loop.run_round``) with a ``FlowerBackend`` that
sends the client half of each round to the SuperNodes:

1. ``Server.begin_round(r)`` samples the FedSight client ids and collects the components' broadcasts
   (SCAFFOLD's ``c``);
2. the instruction (global state, broadcasts, round, sampled ids) goes to the SuperNodes holding the
   sampled clients (a node's FedSight client id is its ``partition-id``; the server learns which node
   holds which client from the nodes' replies: in the first round every node gets the instruction and
   the unsampled ones answer with their partition only);
3. the replies become ``Reply``s (``records.read_result``) that ``Server.collect`` accepts or rejects,
   in the sampled order, so the aggregation sums in the same order as the in-process simulator;
4. ``Server.end_round`` weights, aggregates, steps the server optimizer, averages shared buffers and
   runs the components' server hooks (SCAFFOLD's control update).

With ``secagg`` (run config), steps 2-3 are Flower's SecAgg+ protocol instead (``secagg.SecAggRound``): the
server receives only the weighted mean of the sampled clients' updates.

Evaluation is the loop's (``engine.loop.evaluate``): the global test set on the server, and, with
``eval.local``, each client's local test set on its node (an ``evaluate`` message; the node returns the
metric state of the model the simulator would evaluate) summarised on the server into ``local/wma``,
``local/worst10`` and the merged metrics. FedBN/SiloBN evaluate the global test set with the clients'
example-weighted mean normalisation entries (``NormSharing.client_average``); for that the nodes send
their stored personal entries with the evaluation reply, and the server holds them in memory for that
evaluation only.

Faults: a sampled client whose node does not answer within ``round-timeout`` seconds (or answers with
an error) is left out of the round and recorded as a ``client_lost`` event (round, client, node,
reason) in ``metrics.jsonl``; a round with fewer than ``min-clients`` accepted updates is not
aggregated (``too_few_clients`` and ``round_skipped`` events). Per-client state never reaches the
server: its ``Server`` has an in-memory client store that stays empty.

The run directory is the usual one (``config.json``, ``metrics.jsonl``, ``client_weights.jsonl``,
checkpoints, ``model.safetensors``, ``status.json``, ``summary.md``), written by this ServerApp to the
``run-dir`` run-config path on the SuperLink host. ``flower.json`` adds the node map and the options.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import shutil
import time
from collections.abc import Mapping
from logging import INFO, WARN
from pathlib import Path
from typing import Any

from flwr.app import Context, Message, MessageType
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from ..cost import model_cost
from ..runs import INTERRUPTED, Replacement, atomic_write_text
from ..device import to_device
from ..engine.loop import ClientEvaluation
from ..engine.plan import Reply
from . import records as FR
from .exchange import exchange, exchange_messages
from .options import ServerOptions


class FlowerBackend:
    """The client half of FedSight's round on Flower SuperNodes (``engine.loop.Backend``): training and
    evaluation instructions go to the nodes over a ``Grid``; replies come back as ``Reply``s and
    metric states. The server learns which node holds which client from the nodes' replies."""

    def __init__(self, server: Any, grid: Grid, opts: ServerOptions, task_info: dict[str, Any], dp: Any = None):
        self.server, self.grid, self.opts, self.task_info, self.dp = server, grid, opts, task_info, dp
        self.node_of: dict[int, int] = {}  # FedSight client id -> Flower node id
        #: which node key may answer for which client (provisioning.py); None: client identity is not authenticated
        self.provisioned = None
        if opts.provisioning:
            from .provisioning import read_provisioning

            self.provisioned = read_provisioning(opts.provisioning, server.task.num_clients)
        self.refused_nodes: set[int] = set()  # nodes a provisioning file does not list (``node_refused``, once)
        self._keys: dict[int, str] = {}  # node id -> public key, as last listed
        self.max_reply_bytes = int(opts.max_reply_mb * 2**20)
        # the reply contract's sizes: the server's own partition, or (nodes' own data) a bound
        server.sizes_known = opts.data == "partition"
        server.max_examples = opts.max_examples
        self.online: set[int] = set()
        self.failed_nodes: set[int] = set()  # nodes that failed in the last training exchange
        self.secagg = None
        if opts.secagg:
            from .secagg import SecAggRound

            self.secagg = SecAggRound(self, opts.secagg_settings())

    def wait_for_nodes(self) -> list[dict[str, Any]]:
        want = self.opts.min_nodes or self.server.task.num_clients
        deadline = time.monotonic() + self.opts.node_wait_timeout
        while True:
            online = len(list(self.grid.get_node_ids()))
            if online >= want:
                return []
            if time.monotonic() >= deadline:
                return [{"round": 0, "event": "nodes_missing", "online": online, "expected": want}]
            time.sleep(1.0)

    def _node_keys(self) -> dict[int, str]:
        """Node id -> its authenticated public key (hex) as the SuperLink lists it; empty without node
        authentication (and on grids that list no keys)."""
        try:
            return {int(n.node_id): bytes(n.public_key).hex() for n in self.grid.get_nodes()
                    if getattr(n, "public_key", b"")}
        except Exception:  # a grid without node listings: identities fall back to node ids
            return {}

    def _why_not(self, node: int, pid: int) -> str | None:
        """Why ``node`` may not answer for client ``pid`` (None: it may). With a provisioning file only the node
        key provisioned for ``pid`` may, from any node id (a restarted SuperNode reclaims its client); a key not in
        the file never answers, and what answers first decides nothing. Without one, client identity is not
        authenticated: any node may answer for any client (Flower gives a SuperNode started without a key a new
        temporary key each time, so keys identify nothing then)."""
        if self.provisioned is None:
            return None
        return self.provisioned.why_not(node, self._keys.get(node), pid)

    def _told(self, targets: list[int], sampled: list[int]) -> dict[int, list[int]]:
        """Which sampled clients each target node is told of: the node's own client when it is sampled (the client
        it is known to hold, or the one a provisioning file lists for its key), else none. A node whose client the
        server cannot tell (no provisioning file, not yet identified: a new or restarted SuperNode) is told the
        sampled clients that have no online node, any of which it may hold; no node learns the rest of the
        sample."""
        client_of = {n: c for c, n in self.node_of.items()}
        orphans = [c for c in sampled if self.node_of.get(c) not in self.online]
        told: dict[int, list[int]] = {}
        for n in targets:
            c = client_of.get(n)
            if c is None and self.provisioned is not None:
                c = self.provisioned.partition_of.get(self._keys.get(n))
            told[n] = orphans if c is None else [c] if c in sampled else []
        return told

    def _unidentified(self, known: set[int], r: int, events: list[dict[str, Any]]) -> set[int]:
        """The online nodes not yet known to hold a client that may be sent the model: with a provisioning file,
        only those whose key it lists. A node it does not list never receives the global model; it is a
        ``node_refused`` event, once per node."""
        nodes = self.online - known
        if self.provisioned is None:
            return nodes
        allowed = {n for n in nodes if self._keys.get(n) in self.provisioned.partition_of}
        for n in sorted(nodes - allowed - self.refused_nodes):
            self.refused_nodes.add(n)
            events.append({"round": r, "event": "node_refused", "node": n,
                           "reason": self.provisioned.why_not(n, self._keys.get(n), -1) + ": it is sent nothing"})
        return allowed

    def _learn(self, node: int, content, r: int) -> tuple[list[dict[str, Any]], str | None]:
        """Map the replying node to the partition it names; a partition answered by another node it may answer
        from (a restarted SuperNode gets a new id) moves to it. Returns the events and why the node may not
        answer for that partition (then nothing moves)."""
        pid = FR.reply_partition(content)
        if pid is None:
            return [], None
        why = self._why_not(node, pid)
        if why is not None:
            return [], why
        other = self.node_of.get(pid)
        self.node_of[pid] = node
        if other is not None and other != node:
            return [{"round": r, "event": "client_moved", "client": pid, "from_node": other, "to_node": node}], None
        return [], None

    def enter_round(self, r: int) -> None:
        pass

    def identify(self, r: int) -> list[dict[str, Any]]:
        """Learn which client each online node not yet known holds: a training instruction that samples no one
        (and carries no model) is answered by every node with its partition only. Returns the events."""
        self.online = set(int(n) for n in self.grid.get_node_ids())
        self._keys = self._node_keys()
        events: list[dict[str, Any]] = []
        unknown = sorted(self._unidentified(set(self.node_of.values()), r, events))  # (a key not provisioned: nothing)
        if not unknown:
            return events
        content = FR.instruction_content(r, [], {}, **self.task_info)
        replies, _ = exchange(self.grid, unknown, content, MessageType.TRAIN, f"identify-{r}", self.opts.round_timeout,
                              self.opts.poll_interval)
        for node, reply in replies.items():
            self._admit(node, reply.content, r, events)
        return events

    def _admit(self, node: int, content: Any, r: int, events: list[dict[str, Any]]) -> bool:
        """``_learn`` from a node's reply, its events appended to ``events``; False (with a ``rejected_update``
        event) when the node may not answer for the partition it names."""
        learned, why = self._learn(node, content, r)
        events += learned
        if why is not None:
            events.append({"round": r, "event": "rejected_update", "client": FR.reply_partition(content), "node": node,
                           "reason": why})
        return why is None

    def train(self, plan: Any) -> tuple[list[Reply], list[dict[str, Any]]]:
        if not plan.sampled:  # a server-only round
            return [], []
        if self.secagg is not None:
            return self.secagg.train(plan)
        r, opts = plan.round, self.opts
        # nodes not yet known (the first round, a restarted SuperNode) name their client first, so each node is
        # sent only its own client's instruction (``_told``)
        refused = self.identify(r)
        known = set(self.node_of.values())
        # the nodes of the sampled clients (if Flower still lists them online) and every node still unidentified
        targets = sorted({self.node_of[c] for c in plan.sampled if self.node_of.get(c) in self.online}
                         | self._unidentified(known, r, refused))
        nonce = secrets.token_hex(16)  # fresh per exchange: a reply resent from an earlier one echoes another
        contents = FR.instructions_per_node(r, self._told(targets, plan.sampled), self.server.global_model.state_dict(),
                                            plan.broadcast, plan.client_broadcast, nonce=nonce, **self.task_info)
        wanted = set(plan.sampled)

        def enough(replies: dict[int, Message]) -> bool:  # every sampled client answered (a restarted node may)
            return wanted <= {pid for n, m in replies.items() if not FR.is_skipped(m.content)
                              and (pid := FR.reply_partition(m.content)) is not None and self._why_not(n, pid) is None}

        messages = [Message(contents[n], dst_node_id=n, message_type=MessageType.TRAIN, group_id=str(r)) for n in targets]
        replies, failed = exchange_messages(self.grid, messages, opts.round_timeout, opts.poll_interval, enough)
        self.failed_nodes = set(failed)
        events = refused
        got: dict[int, Reply] = {}
        for node, reply in replies.items():
            if not self._admit(node, reply.content, r, events):
                continue
            if FR.is_skipped(reply.content):
                continue
            pid = FR.reply_partition(reply.content)
            if pid is None:  # unreadable meta: the client this node is known to hold, if any
                pid = next((c for c, n in self.node_of.items() if n == node), None)
            stale = FR.echo_problem(reply.content, r, nonce)
            if stale is not None:  # a replayed (or unbound) reply: rejected before anything in it is read
                if pid in wanted:
                    got[pid] = Reply(pid, None, False, stale, {"node": node}, rejected=True)
                else:
                    events.append({"round": r, "event": "rejected_update", "client": pid, "node": node, "reason": stale})
                continue
            refusal = FR.read_refusal(reply.content)
            if refusal is not None and pid in wanted:
                got[pid] = Reply(pid, None, False, refusal[0], {"node": node, **refusal[1]}, refused=True)
                continue
            try:
                FR.read_partition(reply.content)  # unreadable: the reply is refused, though its node's client is known
                res, ok = FR.read_result(reply.content, self.max_reply_bytes)
                if pid not in wanted:
                    raise FR.MalformedReply(f"a reply for partition {pid}, which was not sampled")
                if res.client_id != pid:
                    raise FR.MalformedReply(f"the node of partition {pid} replies as client {res.client_id}")
            except FR.MalformedReply as exc:
                if pid in wanted:  # the sampled client's reply is unusable: rejected (not lost)
                    got[pid] = Reply(pid, None, False, f"malformed reply: {exc}", {"node": node}, rejected=True)
                else:
                    events.append({"round": r, "event": "rejected_update", "client": pid, "node": node,
                                   "reason": f"malformed reply: {exc}"})
                continue
            got[pid] = Reply(pid, res, ok, info={"node": node})
        out = []
        for cid in plan.sampled:
            if cid in got:
                out.append(got[cid])
                continue
            node = self.node_of.get(cid)
            if node is None:
                unknown = [n for n in targets if n in failed and n not in self.node_of.values()]
                reason = "no node known to hold this client" + (
                    "; unidentified nodes that did not answer: " + "; ".join(f"{n}: {failed[n]}" for n in unknown)
                    if unknown else "")
            elif node not in self.online:
                reason = "its node is offline"
            else:
                reason = failed.get(node, "no reply")
            out.append(Reply(cid, None, False, reason, {"node": node}))
        return out, events

    def admit(self, plan: Any, results: list[Any], events: list[dict[str, Any]]) -> list[Any]:
        r, opts = plan.round, self.opts
        if results and len(results) < opts.min_clients:
            events.append({"round": r, "event": "too_few_clients", "accepted": len(results), "min_clients": opts.min_clients})
            return []
        return self.dp.admit(r, results, events) if self.dp is not None else results

    def round_metrics(self) -> dict[str, Any]:
        row: dict[str, Any] = {"flower/nodes_online": len(self.online)}
        if self.dp is not None:
            row.update(self.dp.privacy_spent())
        return row

    def client_evaluation(self, r: int, *, local: bool, personal: bool) -> ClientEvaluation:
        """One ``evaluate`` exchange with every reachable node (none if neither is asked): local-test
        metric states (``local``) and stored personal entries (``personal``; FedBN/SiloBN evaluate the
        global test set with the clients' mean normalisation entries). The entries stay in memory for
        this evaluation only. Every reply is checked like a training reply before it counts
        (``engine.contract.check_evaluation``, ``check_personal``): its round and nonce, a size cap (``max-reply-mb``)
        before its arrays are parsed, the test count against the server's own (bounded by ``max-examples`` with the
        nodes' own data), the metric state's form and every value within its metric's range; a reply that breaks
        any of it is an ``eval_rejected`` event and counts nowhere."""
        from ..engine.contract import check_evaluation, check_personal
        from ..recipe.norm_sharing import nonnegative_statistics
        from ..state import PERSONAL, ClientStateStore

        store = ClientStateStore()
        out = ClientEvaluation(store=store)
        if not (local or personal):
            return out
        server, skip = self.server, self.failed_nodes
        online = set(int(n) for n in self.grid.get_node_ids())
        self._keys = self._node_keys()
        known = set(self.node_of.values())
        self.online = online
        nodes = sorted({n for n in known if n not in skip and n in online}
                       | (self._unidentified(known, r, out.events) - skip))
        nonce = secrets.token_hex(16)
        gstate = server.global_model.state_dict()
        content = FR.instruction_content(r, [], gstate, None, local=local, personal=personal, nonce=nonce,
                                         **self.task_info)
        replies, failed = exchange(self.grid, nodes, content, MessageType.EVALUATE, f"eval-{r}", self.opts.round_timeout,
                                   self.opts.poll_interval)
        metrics = server.task.metrics
        own = {k: (tuple(gstate[k].shape), gstate[k].dtype) for k in server.layout.personal_keys}
        signed = frozenset(nonnegative_statistics(server.global_model) & set(own))
        for node, reply in replies.items():
            learned, why = self._learn(node, reply.content, r)
            out.events += learned
            try:
                if why is not None:
                    raise FR.MalformedReply(why)
                why = FR.echo_problem(reply.content, r, nonce)
                if why is not None:
                    raise FR.MalformedReply(why)
                pid, tensors, n, pers = FR.read_eval(reply.content, self.max_reply_bytes)
                if not 0 <= pid < server.task.num_clients:
                    raise FR.MalformedReply(f"partition {pid} is not a client of this federation")
                known = server.task.num_test_examples(pid) if server.sizes_known else None
                why = (check_evaluation(metrics, tensors, n, known=known, max_examples=server.max_examples) if local
                       else "a metric state it was not asked for" if tensors else None)
                if why is None and pers is not None:
                    why = check_personal(pers, own, signed) if personal else "personal entries it was not asked for"
                if why is not None:
                    raise FR.MalformedReply(why)
                state = metrics.state_from(tensors)
            except Exception as exc:  # a reply that cannot be read or used is dropped, never raised
                out.events.append({"round": r, "event": "eval_rejected", "node": node,
                                   "client": FR.reply_partition(reply.content), "reason": str(exc)})
                continue
            out.states[pid] = (state, n)
            if pers is not None:
                store.put(PERSONAL, pid, r, pers)
        out.events += [{"round": r, "event": "eval_lost", "client": c, "node": n,
                        "reason": failed.get(n, "skipped: lost in training" if n in skip else "its node is offline")}
                       for c, n in sorted(self.node_of.items()) if c not in out.states]
        out.events += [{"round": r, "event": "eval_lost", "client": c, "node": None, "reason": "no node holds this client"}
                       for c in range(server.task.num_clients) if c not in self.node_of]
        if not local:
            out.states = {}
        return out


class FlowerServer:
    """FedSight's server over a ``Grid``: ``run()`` executes every round with the one round loop
    (``engine.loop``) and a ``FlowerBackend``, and writes the run directory."""

    def __init__(self, cfg: Any, options: ServerOptions):
        from ..api import build_server

        self.cfg, self.opts = cfg, options.checked_for(cfg)
        self.server = build_server(cfg)  # in-memory client store: client state lives on the nodes
        self.dp = self.opts.install(self.server)  # (the options with the config's [privacy.central_dp])
        splits = getattr(self.server.task, "splits", None)
        #: what a data-dir node needs to build the run's model whatever classes it holds
        self.task_info: dict[str, Any] = {"class-names": list(splits.train.class_names)} if splits is not None else {}
        #: the per-example model cost, so nodes need not measure it again (same model, same numbers)
        cost = model_cost(self.server.global_model, to_device(self.server.task.example_input(), self.server.device))
        self.task_info["model-cost"] = [float(cost.forward), float(cost.head)]

    def run(self, grid: Grid, on_round=None) -> Path:
        from ..runs import RunLock

        with RunLock(self.opts.run_dir):  # one writer per run directory, as in-process
            return self._run_locked(grid, on_round)

    def _run_locked(self, grid: Grid, on_round=None) -> Path:
        from ..runs import RunDir

        opts = self.opts
        backend = FlowerBackend(self.server, grid, opts, self.task_info, self.dp)
        run = RunDir(opts.run_dir)
        if run.exists() and not opts.overwrite:
            raise FileExistsError(f"{run.path} already holds a run; choose another run-dir or set overwrite = true")
        # a new run that fails before its first round leaves nothing (a Flower run cannot be resumed, and a
        # half-written one would block the retry): the folders it created go, an empty one that was there stays
        created = [d for d in (run.path, *run.path.parents) if not d.exists()]
        was_empty = run.path.is_dir() and not any(run.path.iterdir())
        # overwrite: the old run is set aside (never another kind of directory) and deleted after round 1
        replaced = Replacement(run.path)
        self.rounds_done = 0
        try:
            return self._run(grid, run, backend, replaced, on_round)
        except BaseException:
            replaced.undo()
            if not self.rounds_done and (created or was_empty):
                shutil.rmtree(run.path, ignore_errors=True)
                if was_empty:
                    run.path.mkdir()
                for d in created[1:]:
                    try:
                        d.rmdir()  # only if empty
                    except OSError:
                        break
            # a signal (Flower's exit handler raises SystemExit on SIGINT/SIGTERM), a stopped run (`flwr stop`: the
            # Grid's next call fails) or an error: the run is over at its last recorded round, and not "running"
            if self.rounds_done:
                run.write_status(INTERRUPTED, self.rounds_done, self.cfg.server.rounds)
            raise

    def _run(self, grid: Grid, run: Any, backend: "FlowerBackend", replaced: Any, on_round=None) -> Path:
        from ..api import finish, record_round, start_run_dir
        from ..engine.loop import evaluate_initial, run_round
        from ..models.base import save_weights

        server, cfg, opts = self.server, self.cfg, self.opts
        run.path.mkdir(parents=True, exist_ok=True)
        # with the nodes' own data (data-dir) the server's partition describes nothing
        from ..secret import privacy_note

        from .provisioning import identity_note

        identity = identity_note(backend.provisioned)  # what binds a client to a node: run.json and the log say it
        log(INFO if backend.provisioned is not None else WARN, "FedSight: client identity %s", identity)
        start_run_dir(run, cfg, server.task, server.device, partition=opts.data == "partition", backend="flower",
                      privacy_noise=privacy_note(server.stages, "secret", ("central_dp",) if self.dp is not None else ()),
                      client_identity=identity)
        if self.dp is not None:  # the server's noise secret: its private run files only (fedsight.secret)
            self.dp.keep_secret(run.path)
        if self.dp is not None:  # which accountant and assumption produce the rows' dp/epsilon
            desc = self.dp.describe()  # its note goes under "reason", which summary.md's event table shows
            run.append_metrics({"stage": server.stage, "round": 0, "event": "dp_accounting", "reason": desc.pop("note"), **desc})
        for e in backend.wait_for_nodes():
            run.append_metrics({"stage": server.stage, **e})
        if server.schedule.eval_initial:
            row, events = evaluate_initial(server, backend)
            record_round(run, server, cfg, 0, row, events)
            if on_round is not None:
                on_round(0, row, events)
        for r in range(1, cfg.server.rounds + 1):
            row, events = run_round(server, backend, r)
            record_round(run, server, cfg, r, row, events)
            self.rounds_done = r
            replaced.done()
            if on_round is not None:
                on_round(r, row, events)
        if server.store.state_dict():
            raise RuntimeError("client state reached the server")  # by construction it cannot
        save_weights(server.global_model, run.path / "model.safetensors")
        info = {"node_of_client": {str(c): n for c, n in sorted(backend.node_of.items())}, "options": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(opts).items()}}
        if self.dp is not None:
            info["dp"] = {**self.dp.describe(), **self.dp.privacy_spent()}
        atomic_write_text(run.path / "flower.json", json.dumps(info, indent=2) + "\n")
        run.write_status("complete", cfg.server.rounds, cfg.server.rounds)
        finish(run.path, server.task, server.global_model, server.recipe.weighting.name, facts=server.facts,
               plots=cfg.run.plots,
               events=run.events, tracking=run.tracking)
        run.close_events()
        return run.path


def server_main(grid: Grid, context: Context, settings: Mapping[str, Any] | None = None) -> Path:
    """The ServerApp's main: read the run config (``settings`` override it) and run."""
    from ..config import validate
    from .run_config import config_from_run_config

    rc = {**dict(context.run_config), **dict(settings or {})}
    cfg = validate(config_from_run_config(rc), "flower run config (fedsight.*)")
    return FlowerServer(cfg, ServerOptions.from_run_config(rc)).run(grid)


def make_server_app(settings: Mapping[str, Any] | None = None) -> ServerApp:
    """A FedSight ``ServerApp``; ``settings`` override the run config."""
    app = ServerApp()
    fixed = dict(settings or {})

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        server_main(grid, context, fixed)

    return app


app = make_server_app()
