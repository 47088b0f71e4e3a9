"""The FedSight ClientApp: a SuperNode's half of a FedSight round, on Flower's Message API.

Two handlers, no algorithm logic of their own:

* ``train``: the node's client trains exactly as in the in-process simulator, on the same
  ``fedsight.engine.client_runtime.ClientRuntime`` the simulator uses: a light runtime (the client's
  data, one work model, the run's stages; no global model or server state) built once per process and
  node. The instruction's global state is loaded into the work model with this client's stored personal
  entries, the stage's trainer runs, and the node's ``ClientStateStore`` holds the client's persistent
  state (SCAFFOLD's ``c_i`` ...). Personal entries and state are kept only if the update is finite. A
  node whose client is not sampled this round replies with its partition only. Under secure aggregation
  the same training runs inside Flower's SecAgg+ protocol (``secagg_node.secagg_train``).
* ``evaluate``: the client's local-test metric state (``Task.eval_state``) on the model the simulator
  would use (the global model, or global shared + personal entries, inside the recipe's evaluation
  hooks), for the server's WMA / worst-10% summary and merged metrics.

Settings come from ``context.run_config`` (the app's ``[tool.flwr.app.config]``: the ``fedsight.*`` keys
are the resolved FedSight config, one key per value, ``run_config``) and ``context.node_config`` (``partition-id``,
``num-partitions``, ``data-dir``, ``state-dir``, ``device``: where this node trains, default the run's
``engine.device``); ``make_client_app(settings)`` overrides the run config (``flwr.simulation.run_simulation``
passes an empty one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from ..cost import ModelCost
from ..engine.client_runtime import ClientRuntime
from ..errors import ModelRefused
from ..records import ClientResult
from ..state import PERSONAL, ClientStateStore
from . import records as FR
from .secagg_node import is_secagg, secagg_train
from .node import build_node_task, node_config_model, restore_index, state_root
from .run_config import config_json


def _settings(context: Context, settings: Mapping[str, Any] | None) -> tuple[str, dict[str, Any], int, Path]:
    """(the run's FedSight config as JSON, the node config, the node's client id, its state folder)."""
    run_config = {**dict(context.run_config), **dict(settings or {})}
    config_text = config_json(run_config)  # the fedsight.* keys (or an earlier app's fedsight-config JSON)
    node_config = dict(context.node_config)
    if "partition-id" not in node_config:
        raise KeyError("node config has no 'partition-id' (start the SuperNode with --node-config 'partition-id=K ...')")
    partition = int(node_config["partition-id"])
    state_dir = state_root(node_config, context.run_id, partition, run_config.get("state-dir"))
    return config_text, node_config, partition, state_dir


@lru_cache(maxsize=8)
def _runtime(config_text: str, node_items: tuple, state_dir: Path, class_names: tuple | None,
             cost: tuple | None) -> ClientRuntime:
    """The node's ``ClientRuntime``: its client's data, one work model, the run's stages (client side
    only: no global model, no server optimizer state), its client-state folder. Built once per
    process and node (a Ray actor serves many virtual nodes and rounds; a deployment's ClientApp process
    one message)."""
    from ..api import build_stages
    from ..device import configure_threads, keep_freed_memory, resolve_device

    cfg = node_config_model(config_text)
    node_config = dict(node_items)
    configure_threads(cfg.engine.threads)
    # the node decides where it trains: node config "device", else the run's engine.device
    if "device" in node_config:
        device = resolve_device(str(node_config["device"]), "node config device")
    else:
        device = resolve_device(cfg.engine.device)
    if device.type == "cpu":
        keep_freed_memory(cfg.engine.heap_keep_mb)
    task = build_node_task(cfg, node_config, list(class_names) if class_names else None).to(device)
    model_cost = ModelCost(forward=float(cost[0]), head=float(cost[1])) if cost else None
    # a deployment's noise and keys are always secret: the node's own, in its state folder (fedsight.secret)
    return ClientRuntime(task, build_stages(cfg, task), cfg.seed, ClientStateStore(state_dir, one_client=True), device,
                         model_cost, eval_batch_size=cfg.eval.batch_size, noise="secret")


def node_runtime(context: Context, config: Mapping[str, Any], settings: Mapping[str, Any] | None = None) -> tuple[ClientRuntime, int]:
    """(the node's runtime with its store's index read back from disk, its client id)."""
    config_text, node_config, partition, state_dir = _settings(context, settings)
    names = tuple(config["class-names"]) if config.get("class-names") else None
    cost = tuple(config["model-cost"]) if config.get("model-cost") else None
    rt = _runtime(config_text, tuple(sorted(node_config.items())), state_dir, names, cost)
    restore_index(rt.store)  # another process may have written it (a deployment: one process per message)
    return rt, partition


@dataclass
class Trained:
    """What a node's client made of a training instruction: ``result`` is None when it was not sampled."""

    partition: int
    global_state: dict[str, torch.Tensor]
    result: ClientResult | None = None
    accepted: bool = False


def train_instruction(content: RecordDict, context: Context, settings: Mapping[str, Any] | None = None) -> Trained:
    """Train the node's client on a training instruction (its state committed when it trained); a client that
    refuses the global model raises ``ModelRefused`` and stores nothing."""
    _, _, partition, _ = _settings(context, settings)
    config, global_state, broadcast = FR.read_instruction(content, partition)
    if partition not in config["sampled"]:
        return Trained(partition, global_state)
    rt, partition = node_runtime(context, config, settings)
    res, accepted = rt.train(int(config["round"]), partition, global_state, broadcast)
    rt.store.commit()
    return Trained(partition, global_state, res, accepted)


def train_content(content: RecordDict, context: Context, settings: Mapping[str, Any] | None = None) -> RecordDict:
    """The reply content to a training instruction: the client's result, its refusal of the model, or (not
    sampled) its partition only; each echoes the instruction's round and nonce (``records.echo_problem``)."""
    echo = FR.instruction_echo(content)
    try:
        t = train_instruction(content, context, settings)
    except ModelRefused as exc:  # an integrity check failed: answer with the refusal, train nothing
        return FR.refused_content(_settings(context, settings)[2], str(exc), exc.info, echo)
    if t.result is None:
        return FR.skipped_content(t.partition, echo)
    return FR.result_content(t.result, partition=t.partition, accepted=t.accepted, echo=echo)


def handle_train(msg: Message, context: Context, settings: Mapping[str, Any] | None = None) -> Message:
    """A training instruction, or a message of the SecAgg+ protocol (``secagg_node.secagg_train``, which trains
    through ``train_instruction`` in its masked-vector stage)."""
    if is_secagg(msg.content):
        return secagg_train(msg, context, lambda content: train_instruction(content, context, settings))
    return Message(train_content(msg.content, context, settings), reply_to=msg)


def handle_evaluate(msg: Message, context: Context, settings: Mapping[str, Any] | None = None) -> Message:
    """The client's local-test metric state (config ``local``) and/or its stored personal entries (config
    ``personal``: FedBN/SiloBN evaluate the global test set with the clients' mean normalisation
    entries, ``NormSharing.client_average``)."""
    config, global_state, _ = FR.read_instruction(msg.content)
    rt, cid = node_runtime(context, config, settings)
    rt.enter_round(int(config["round"]))
    n = rt.task.num_test_examples(cid)
    state: dict[str, torch.Tensor] = {}
    if config.get("local", True) and n > 0:
        state = rt.local_state(cid, global_state).tensors()
    personal = rt.store.get(PERSONAL, cid) if config.get("personal", False) else None
    return Message(FR.eval_content(cid, state, n, personal, FR.instruction_echo(msg.content)), reply_to=msg)


def make_client_app(settings: Mapping[str, Any] | None = None) -> ClientApp:
    """A FedSight ``ClientApp``; ``settings`` override the run config (e.g. the ``fedsight.*`` config keys)."""
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
