"""FedSight records <-> Flower message records, one to one and bit-exact.

A round's instruction (``fedsight.engine.simulation.RoundPlan``) and a client's upload
(``fedsight.records.ClientResult``) travel as a Flower ``RecordDict``:

instruction (server -> SuperNode)::

    "global"            ArrayRecord   the whole global model state (shared, personal-default and frozen entries)
    "broadcast:<name>"  ArrayRecord   one per component broadcast (SCAFFOLD's server control variate c)
    "config"            ConfigRecord  round, sampled client ids, evaluation batch size

reply (SuperNode -> server)::

    "delta"             ArrayRecord   ClientResult.delta   (shared trainable parameters, local - global)
    "buffers"           ArrayRecord   ClientResult.buffers (shared buffers, e.g. BatchNorm statistics)
    "extras:<name>"     ArrayRecord   ClientResult.extras[name] (SCAFFOLD's Delta c_i, FedDyn, ...)
    "metrics"           MetricRecord  ClientResult.metrics (``train/loss`` ...)
    "meta"              MetricRecord  client-id, partition-id, num-examples, num-steps, flops, accepted

evaluation reply (SuperNode -> server)::

    "state"             ArrayRecord   the client's local-test metric state (``Task.eval_state``): the task
                                      declares its entries and how they merge (``MetricSet.state_from``)
    "meta"              MetricRecord  partition-id, num-test-examples
    "personal"          ArrayRecord   only when asked: the client's stored personal entries (FedBN's
                                      global-test evaluation averages them)

Tensors cross the wire as ``numpy.save`` bytes of the CPU tensor (Flower's ``Array``), so dtype, shape
and every bit survive the round trip; key order is preserved. Python floats travel as doubles and
ints as int64, both exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from ..engine.plan import merge_broadcast
from ..records import ClientResult

BROADCAST = "broadcast:"
EXTRAS = "extras:"
#: reply of a SuperNode whose client was not sampled this round (it only reports its partition)
SKIPPED = "skipped"


def tensors_to_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """An ``ArrayRecord`` holding ``tensors`` in order (CPU copies; the input is not modified)."""
    rec = ArrayRecord()
    for k, v in tensors.items():
        rec[k] = Array(v.detach().cpu().contiguous().numpy())  # (0-d stays 0-d)
    return rec


def record_to_tensors(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """The tensors of an ``ArrayRecord`` in its key order (writable, owned copies)."""
    return {k: torch.from_numpy(np.array(a.numpy(), copy=True)) for k, a in record.items()}


# -- the instruction ------------------------------------------------------------------------------


def instruction_content(
    round: int,
    sampled: Sequence[int],
    global_state: Mapping[str, torch.Tensor],
    broadcast: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
    per_client: Mapping[int, Mapping[str, Mapping[str, torch.Tensor]]] | None = None,
    **config: Any,
) -> RecordDict:
    """The train/evaluate instruction of ``round``: global state, broadcasts (to all, and ``per_client``:
    ``broadcast:<name>@<client>``), and a ConfigRecord with the round, the sampled FedSight client ids and
    ``config`` (scalars)."""
    content = RecordDict({"global": tensors_to_record(global_state)})
    for name, tensors in (broadcast or {}).items():
        content[BROADCAST + name] = tensors_to_record(tensors)
    for cid, sent in (per_client or {}).items():
        for name, tensors in sent.items():
            content[f"{BROADCAST}{name}@{int(cid)}"] = tensors_to_record(tensors)
    content["config"] = ConfigRecord({"round": int(round), "sampled": [int(c) for c in sampled], **config})
    return content


def read_instruction(content: RecordDict, client: int | None = None
                     ) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """(config, global state, broadcasts) of an instruction written by ``instruction_content``; with
    ``client``, that client's own broadcasts merged in (``engine.plan.merge_broadcast``)."""
    config = dict(content["config"])
    config["sampled"] = [int(c) for c in config.get("sampled", [])]
    global_state = record_to_tensors(content["global"])
    common: dict[str, dict[str, torch.Tensor]] = {}
    own: dict[str, dict[str, torch.Tensor]] = {}
    for key, record in content.array_records.items():
        if not key.startswith(BROADCAST):
            continue
        name, _, cid = key[len(BROADCAST):].partition("@")
        if not cid:
            common[name] = record_to_tensors(record)
        elif client is not None and int(cid) == client:
            own[name] = record_to_tensors(record)
    return config, global_state, merge_broadcast(common, own)


# -- the reply ------------------------------------------------------------------------------------


def result_content(res: ClientResult, *, partition: int, accepted: bool = True) -> RecordDict:
    """A client's upload as a reply ``RecordDict`` (see the module docstring)."""
    content = RecordDict({"delta": tensors_to_record(res.delta), "buffers": tensors_to_record(res.buffers)})
    for name, tensors in res.extras.items():
        content[EXTRAS + name] = tensors_to_record(tensors)
    content["metrics"] = MetricRecord({k: float(v) for k, v in res.metrics.items()})
    content["meta"] = MetricRecord(
        {
            "client-id": int(res.client_id),
            "partition-id": int(partition),
            "num-examples": int(res.num_examples),
            "num-steps": int(res.num_steps),
            "flops": float(res.flops),
            "accepted": int(bool(accepted)),
        }
    )
    return content


def skipped_content(partition: int) -> RecordDict:
    """The reply of a node whose client was not sampled: only its partition (for the node map)."""
    return RecordDict({"meta": MetricRecord({"partition-id": int(partition), SKIPPED: 1})})


def reply_partition(content: RecordDict) -> int | None:
    meta = content.get("meta")
    return int(meta["partition-id"]) if isinstance(meta, MetricRecord) and "partition-id" in meta else None


def is_skipped(content: RecordDict) -> bool:
    meta = content.get("meta")
    return isinstance(meta, MetricRecord) and int(meta.get(SKIPPED, 0)) == 1


def read_result(content: RecordDict) -> tuple[ClientResult, bool]:
    """(the ``ClientResult``, whether the node accepted it: finite values, personal entries stored)."""
    meta = content["meta"]
    res = ClientResult(
        client_id=int(meta["client-id"]),
        num_examples=int(meta["num-examples"]),
        delta=record_to_tensors(content["delta"]),
        buffers=record_to_tensors(content["buffers"]),
        metrics={k: float(v) for k, v in content["metrics"].items()},
        extras={k[len(EXTRAS):]: record_to_tensors(v) for k, v in content.array_records.items() if k.startswith(EXTRAS)},
        num_steps=int(meta["num-steps"]),
        flops=float(meta["flops"]),
    )
    return res, bool(int(meta["accepted"]))


# -- local evaluation -----------------------------------------------------------------------------


def eval_content(partition: int, state: Mapping[str, torch.Tensor], num_test: int,
                 personal: Mapping[str, torch.Tensor] | None = None) -> RecordDict:
    """A node's local-test metric state (``MetricState.tensors()``), its number of local test examples
    and, when asked, its stored personal entries (``ArrayRecord`` "personal")."""
    content = RecordDict(
        {
            "state": tensors_to_record(state),
            "meta": MetricRecord({"partition-id": int(partition), "num-test-examples": int(num_test)}),
        }
    )
    if personal is not None:
        content["personal"] = tensors_to_record(personal)
    return content


def read_eval(content: RecordDict) -> tuple[int, dict[str, torch.Tensor], int, dict[str, torch.Tensor] | None]:
    """(partition, metric-state tensors, number of local test examples, personal entries or None) of an
    evaluation reply."""
    meta = content["meta"]
    personal = record_to_tensors(content["personal"]) if "personal" in content.array_records else None
    return int(meta["partition-id"]), record_to_tensors(content["state"]), int(meta["num-test-examples"]), personal
