"""The FedSight ClientApp: a SuperNode's half of a FedSight round, on Flower's Message API.

Two handlers, no algorithm logic of their own:

* ``train``: the node's client trains exactly as in the in-process simulator: the instruction's
  global state is loaded into a node-side ``Simulation`` (built from the same config, so the same
  recipe components, trainer, stage, frozen and personal entries), and ``Simulation.run_client``
  runs ``fedsight.client.train_client`` on the work model holding the global shared entries and this
  client's stored personal entries, with this node's ``ClientStateStore`` as the client's persistent
  state (SCAFFOLD's ``c_i`` ...). The personal entries are stored only if the update is accepted
  (finite), as ``Simulation.train_round`` does. A node whose client is not sampled this round replies
  with its partition only.
* ``evaluate``: the client's local test metrics sums (``Task.eval_sums``) on the model the simulator
  would use (the global model, or global shared + personal entries, inside the recipe's
  ``eval_context``), for the server's WMA / worst-10% summary.

Settings come from ``context.run_config`` (the app's ``[tool.flwr.app.config]``: ``fedsight-config``
is the resolved FedSight config as JSON) and ``context.node_config`` (``partition-id``,
``num-partitions``, ``data-dir``, ``state-dir``); ``make_client_app(settings)`` overrides the run config
(``flwr.simulation.run_simulation`` passes an empty one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from . import records as FR
from .node import build_node_task, node_config_model, restore_index, state_root


class NodeRuntime:
    """One message's view of the node: config, client id, task and a node-side ``Simulation``."""

    def __init__(self, context: Context, settings: Mapping[str, Any] | None = None):
        run_config = {**dict(context.run_config), **dict(settings or {})}
        if "fedsight-config" not in run_config:
            raise KeyError("run config has no 'fedsight-config' (write the app with `fedsight flower app`)")
        self.cfg = node_config_model(str(run_config["fedsight-config"]))
        self.node_config = dict(context.node_config)
        if "partition-id" not in self.node_config:
            raise KeyError("node config has no 'partition-id' (start the SuperNode with --node-config 'partition-id=K ...')")
        self.partition = int(self.node_config["partition-id"])
        self.state_dir = state_root(self.node_config, context.run_id, self.partition, run_config.get("state-dir"))

    def simulation(self, round: int, global_state: Mapping[str, torch.Tensor], config: Mapping[str, Any]):
        """A node-side ``Simulation`` in the stage of ``round``, holding ``global_state``; its client
        store is this node's state folder."""
        from ..api import build_simulation

        names = list(config["class-names"]) if config.get("class-names") else None
        task = build_node_task(self.cfg, self.node_config, names)
        from ..cost import ModelCost

        # the server's measurement of the same model: counting again costs ~1.7 s in every fresh process
        cost = config.get("model-cost")
        cost = ModelCost(forward=float(cost[0]), head=float(cost[1])) if cost else None
        sim = build_simulation(self.cfg, task, run_dir=self.state_dir, cost=cost)
        restore_index(sim.store)
        sim.enter_round(round)
        sim.global_model.load_state_dict(dict(global_state))
        return sim


def handle_train(msg: Message, context: Context, settings: Mapping[str, Any] | None = None) -> Message:
    from ..engine.simulation import RoundPlan

    node = NodeRuntime(context, settings)
    config, global_state, broadcast = FR.read_instruction(msg.content)
    r = int(config["round"])
    if node.partition not in config["sampled"]:
        return Message(FR.skipped_content(node.partition), reply_to=msg)
    sim = node.simulation(r, global_state, config)
    gstate = sim.global_model.state_dict(keep_vars=True)
    plan = RoundPlan(r, None, list(config["sampled"]), broadcast, {k: gstate[k].detach() for k in sim.shared_params})
    res, state = sim.run_client(plan, node.partition)
    accepted = sim.keep_client(res, state)
    sim.store.commit()
    return Message(FR.result_content(res, partition=node.partition, accepted=accepted), reply_to=msg)


def handle_evaluate(msg: Message, context: Context, settings: Mapping[str, Any] | None = None) -> Message:
    """The client's local-test sums (config ``local``) and/or its stored personal entries (config
    ``personal``: FedBN/SiloBN evaluate the global test set with the clients' mean normalisation
    entries, ``NormSharing.client_average``)."""
    from ..engine.simulation import PERSONAL

    node = NodeRuntime(context, settings)
    config, global_state, _ = FR.read_instruction(msg.content)
    sim = node.simulation(int(config["round"]), global_state, config)
    cid = node.partition
    n = sim.task.num_test_examples(cid)
    sums: dict[str, float] = {}
    if config.get("local", True) and n > 0:
        sums = sim.client_eval_sums(cid)
    personal = sim.store.get(PERSONAL, cid) if config.get("personal", False) else None
    return Message(FR.eval_content(cid, sums, n, personal), reply_to=msg)


def make_client_app(settings: Mapping[str, Any] | None = None) -> ClientApp:
    """A FedSight ``ClientApp``; ``settings`` override the run config (e.g. ``fedsight-config``)."""
    app = ClientApp()
    fixed = dict(settings or {})

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return handle_train(msg, context, fixed)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return handle_evaluate(msg, context, fixed)

    return app


app = make_client_app()
