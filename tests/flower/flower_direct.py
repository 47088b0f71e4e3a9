"""An engine-free Flower ``Grid`` for tests: messages go straight to ClientApp objects, one per node.

Each node has its own ``Context`` (node config with ``partition-id``, ``num-partitions``, its own
``state-dir``); a node can be "killed" (its messages are never answered) to test the server's fault
handling without Flower's runtime. Every message's content crosses Flower's own serialisation on the
way to the node and back (``wire``), as in a deployment: no object is shared between the server and a node.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.task_identity import TaskIdentity  # internal in 1.41: lets tests build messages


def wire(content: RecordDict) -> RecordDict:
    """``content`` through Flower's own serialisation (deflate every nested object, inflate)."""
    set_identity()
    msg = Message(content, dst_node_id=5, message_type="train")
    objs = get_all_nested_objects(msg)
    return inflate_object_from_contents(msg.object_id, {k: v.deflate() for k, v in objs.items()}).content


def set_identity() -> None:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 1, 1


class DirectGrid(Grid):
    def __init__(self, client_app, node_configs: list[dict], run_config: dict | None = None):
        set_identity()
        self.app = client_app
        self.contexts = {
            1000 + i: Context(run_id=7, node_id=1000 + i, node_config=dict(nc), state=RecordDict(), run_config=dict(run_config or {}))
            for i, nc in enumerate(node_configs)
        }
        self.dead: set[int] = set()
        #: node id -> the public key it authenticated with (node authentication); empty: none
        self.keys: dict[int, bytes] = {}
        self.pending: dict[str, Message] = {}
        self.sent: list[tuple[str, int]] = []  # (message type, node)
        #: called as kill_hook(grid, message) before a message is delivered (tests kill nodes there)
        self.kill_hook = None
        #: called as nodes_hook(grid) whenever the server lists the nodes (tests restart nodes there)
        self.nodes_hook = None

    def set_run(self, run):  # pragma: no cover
        raise NotImplementedError

    @property
    def run(self):  # pragma: no cover
        raise NotImplementedError

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # pragma: no cover
        raise NotImplementedError

    def get_node_ids(self):
        if self.nodes_hook is not None:
            self.nodes_hook(self)
        return [n for n in self.contexts if n not in self.dead]

    def get_nodes(self):
        """The online nodes as the SuperLink lists them, with the public key a node authenticated with
        (``keys``; none: no node authentication)."""
        from flwr.proto.node_pb2 import NodeInfo

        return [NodeInfo(node_id=n, public_key=self.keys.get(n, b"")) for n in self.get_node_ids()]

    def push_messages(self, messages):
        ids = []
        for m in messages:
            mid = uuid.uuid4().hex
            m.metadata.__dict__["_message_id"] = mid
            self.pending[mid] = m
            self.sent.append((m.metadata.message_type, m.metadata.dst_node_id))
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids):
        out = []
        for mid in list(message_ids):
            m = self.pending.pop(mid, None)
            if m is None:
                continue
            if self.kill_hook is not None:
                self.kill_hook(self, m)
            node = m.metadata.dst_node_id
            if node in self.dead:
                continue  # never answered: the server's timeout decides
            sent = m.content
            try:
                m.content = wire(sent)  # the node gets its own copy; the server's message is left as it was
                reply = self.app(m, self.contexts[node])
                if not reply.has_error():
                    reply.content = wire(reply.content)
                out.append(reply)
            except Exception as exc:  # what Flower's runtime does: an error reply
                out.append(Message(Error(code=2, reason=f"{type(exc).__name__}: {exc}"), reply_to=m))
            finally:
                m.content = sent
        return out

    def send_and_receive(self, messages, *, timeout=None):  # pragma: no cover
        return self.pull_messages(self.push_messages(messages))


def run_direct(cfg, run_dir: Path, state_dir: Path, *, num_nodes: int | None = None, options: dict | None = None,
               node_extra: list[dict] | None = None, kill_hook=None, nodes_hook=None, keys: list[bytes] | None = None):
    """A whole FedSight run through the Flower adapter over a ``DirectGrid``; returns the grid."""
    from fedsight.api import resolved
    from fedsight.flower.client_app import make_client_app
    from fedsight.flower.run_config import flat_run_config
    from fedsight.flower.server_app import server_main

    n = num_nodes or cfg.partition.num_clients
    settings = {**flat_run_config(resolved(cfg)), "run-dir": str(run_dir), "poll-interval": 0.0,
                "node-wait-timeout": 1.0, **(options or {})}
    nodes = [{"partition-id": i, "num-partitions": cfg.partition.num_clients, "state-dir": str(state_dir / f"node{i}"),
              **((node_extra or [{}] * n)[i])} for i in range(n)]
    grid = DirectGrid(make_client_app(), nodes, run_config=settings)
    grid.kill_hook, grid.nodes_hook = kill_hook, nodes_hook
    grid.keys = {1000 + i: k for i, k in enumerate(keys or [])}
    ctx = Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config=settings)
    server_main(grid, ctx)
    return grid
