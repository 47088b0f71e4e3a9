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
    "echo"              ConfigRecord  the instruction's round and nonce (``echo_problem``: a replayed reply is refused)

evaluation reply (SuperNode -> server)::

    "state"             ArrayRecord   the client's local-test metric state (``Task.eval_state``): the task
                                      declares its entries and how they merge (``MetricSet.state_from``)
    "meta"              MetricRecord  partition-id, num-test-examples
    "personal"          ArrayRecord   only when asked: the client's stored personal entries (FedBN's
                                      global-test evaluation averages them)
    "echo"              ConfigRecord  the instruction's round and nonce

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


def instructions_per_node(
    round: int,
    sampled_of: Mapping[int, Sequence[int]],
    global_state: Mapping[str, torch.Tensor],
    broadcast: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
    per_client: Mapping[int, Mapping[str, Mapping[str, torch.Tensor]]] | None = None,
    **config: Any,
) -> dict[int, RecordDict]:
    """One instruction per node (``sampled_of``: node -> the sampled clients it is told of, normally its own or
    none): each names only those clients and carries only their own broadcasts, so a node does not learn which
    other clients the round sampled, nor their per-client state. The global model and the common broadcasts are
    converted once and shared by every instruction (they are serialised per message anyway)."""
    shared = instruction_content(round, [], global_state, broadcast, **config)
    out: dict[int, RecordDict] = {}
    for node, sampled in sampled_of.items():
        content = RecordDict({k: v for k, v in shared.items() if k != "config"})
        for cid in sampled:
            for name, tensors in ((per_client or {}).get(cid) or {}).items():
                content[f"{BROADCAST}{name}@{int(cid)}"] = tensors_to_record(tensors)
        content["config"] = ConfigRecord({**dict(shared["config"]), "sampled": [int(c) for c in sampled]})
        out[int(node)] = content
    return out


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


ECHO = "echo"


def instruction_echo(content: RecordDict) -> dict[str, Any] | None:
    """What a reply to the instruction ``content`` echoes: its round and the server's nonce (None: it has no nonce,
    as an identification request)."""
    config = content.get("config") if isinstance(content, RecordDict) else None
    if not isinstance(config, ConfigRecord) or "nonce" not in config:
        return None
    return {"round": int(config["round"]), "nonce": str(config["nonce"])}


def _echoed(content: RecordDict, echo: Mapping[str, Any] | None) -> RecordDict:
    if echo is not None:
        content[ECHO] = ConfigRecord({"round": int(echo["round"]), "nonce": str(echo["nonce"])})
    return content


def echo_problem(content: RecordDict, round: int, nonce: str) -> str | None:
    """Why a reply is not an answer to this exchange's instruction (round ``round``, the server's fresh ``nonce``),
    or None: a reply resent from an earlier round or exchange echoes another nonce (a replay)."""
    rec = content.get(ECHO) if isinstance(content, RecordDict) else None
    if not isinstance(rec, ConfigRecord):
        return "replay check: the reply echoes no round and nonce ('echo' record)"
    got_round, got_nonce = rec.get("round"), rec.get("nonce")
    if got_round != round:
        return f"replay: the reply echoes round {got_round!r}, this is round {round}"
    if not isinstance(got_nonce, str) or got_nonce != nonce:
        return f"replay: the reply echoes another nonce than round {round}'s instruction"
    return None


def result_content(res: ClientResult, *, partition: int, accepted: bool = True,
                   echo: Mapping[str, Any] | None = None) -> RecordDict:
    """A client's upload as a reply ``RecordDict`` (see the module docstring); ``echo``: the instruction's
    (``instruction_echo``)."""
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
    return _echoed(content, echo)


def skipped_content(partition: int, echo: Mapping[str, Any] | None = None) -> RecordDict:
    """The reply of a node whose client was not sampled: only its partition (for the node map)."""
    return _echoed(RecordDict({"meta": MetricRecord({"partition-id": int(partition), SKIPPED: 1})}), echo)


REFUSED = "refused"


def refused_content(partition: int, reason: str, info: Mapping[str, Any],
                    echo: Mapping[str, Any] | None = None) -> RecordDict:
    """The reply of a client that refused the global model (``ModelRefused``): its partition, why, and the
    check's numbers (e.g. the watermark score)."""
    nums = {k: float(v) for k, v in info.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return _echoed(RecordDict({"meta": MetricRecord({"partition-id": int(partition), REFUSED: 1}),
                               "refusal": ConfigRecord({"reason": str(reason)[:2000]}),
                               "refusal-info": MetricRecord(nums)}), echo)


def read_refusal(content: RecordDict) -> tuple[str, dict[str, float]] | None:
    """(reason, numbers) of a refusal reply, None for any other reply."""
    try:
        if _meta_int(_meta(content), REFUSED) != 1:
            return None
    except MalformedReply:
        return None
    rec, nums = content.get("refusal"), content.get("refusal-info")
    reason = str(rec.get("reason", "")) if isinstance(rec, ConfigRecord) else ""
    info = {str(k): float(v) for k, v in nums.items() if isinstance(v, (int, float))} if isinstance(nums, MetricRecord) else {}
    return reason or "refused the global model", info


class MalformedReply(ValueError):
    """A reply whose records cannot be read as a FedSight reply (missing or mistyped records, arrays that are
    not plain numeric arrays, more bytes than the limit): the server rejects it without reading further."""


def _meta(content: RecordDict) -> MetricRecord:
    meta = content.get("meta") if isinstance(content, RecordDict) else None
    if not isinstance(meta, MetricRecord):
        raise MalformedReply("no 'meta' record")
    return meta


def _meta_int(meta: MetricRecord, key: str) -> int:
    v = meta.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not float(v).is_integer():
        raise MalformedReply(f"meta {key!r} = {v!r} is not an integer")
    return int(v)


def _meta_float(meta: MetricRecord, key: str) -> float:
    v = meta.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise MalformedReply(f"meta {key!r} = {v!r} is not a number")
    return float(v)


def read_partition(content: RecordDict) -> int:
    """The partition a reply says it answers for; ``MalformedReply`` when it names none readable."""
    return _meta_int(_meta(content), "partition-id")


def reply_partition(content: RecordDict) -> int | None:
    """The partition a reply says it answers for (None when it names none readable)."""
    try:
        return read_partition(content)
    except MalformedReply:
        return None


def is_skipped(content: RecordDict) -> bool:
    try:
        return _meta_int(_meta(content), SKIPPED) == 1
    except MalformedReply:
        return False


def _arrays(content: RecordDict, key: str, budget: list[int]) -> dict[str, torch.Tensor]:
    """The tensors of the ArrayRecord ``key``: its size is charged to ``budget`` (bytes left) before any
    array is deserialised; only plain numeric or boolean arrays are read (never pickles)."""
    rec = content.get(key)
    if not isinstance(rec, ArrayRecord):
        raise MalformedReply(f"no {key!r} array record")
    size = sum(len(a.data) for a in rec.values())
    budget[0] -= size
    if budget[0] < 0:
        raise MalformedReply(f"{key!r} brings the reply over its size limit ({size} bytes in this record)")
    try:
        out = record_to_tensors(rec)
    except Exception as exc:  # what a tampered array raises depends on numpy's parser: all are refusals
        raise MalformedReply(f"{key!r} holds an unreadable array ({type(exc).__name__})") from None
    return out


def read_result(content: RecordDict, max_bytes: int | None = None) -> tuple[ClientResult, bool]:
    """(the ``ClientResult``, whether the node accepted it: finite values, personal entries stored). A reply
    that cannot be read raises ``MalformedReply`` (the server rejects it); ``max_bytes`` bounds the arrays
    it may bring, checked before any is deserialised. What the values must be is the server's reply
    contract (``fedsight.engine.contract``), checked afterwards."""
    meta = _meta(content)
    budget = [max_bytes if max_bytes is not None else 1 << 62]
    metrics = content.get("metrics")
    if not isinstance(metrics, MetricRecord):
        raise MalformedReply("no 'metrics' record")
    values: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise MalformedReply(f"metric {k!r} is a {type(v).__name__}, not a number")
        values[k] = float(v)
    res = ClientResult(
        client_id=_meta_int(meta, "client-id"),
        num_examples=_meta_int(meta, "num-examples"),
        delta=_arrays(content, "delta", budget),
        buffers=_arrays(content, "buffers", budget),
        metrics=values,
        extras={k[len(EXTRAS):]: _arrays(content, k, budget) for k in content.array_records if k.startswith(EXTRAS)},
        num_steps=_meta_int(meta, "num-steps"),
        flops=_meta_float(meta, "flops"),
    )
    return res, _meta_int(meta, "accepted") == 1


# -- local evaluation -----------------------------------------------------------------------------


def eval_content(partition: int, state: Mapping[str, torch.Tensor], num_test: int,
                 personal: Mapping[str, torch.Tensor] | None = None, echo: Mapping[str, Any] | None = None) -> RecordDict:
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
    return _echoed(content, echo)


def read_eval(content: RecordDict, max_bytes: int | None = None
              ) -> tuple[int, dict[str, torch.Tensor], int, dict[str, torch.Tensor] | None]:
    """(partition, metric-state tensors, number of local test examples, personal entries or None) of an
    evaluation reply; ``MalformedReply`` when it cannot be read. ``max_bytes`` bounds its arrays, checked before
    any is deserialised; what the values must be is ``engine.contract.check_evaluation``."""
    meta = _meta(content)
    budget = [max_bytes if max_bytes is not None else 1 << 62]
    personal = _arrays(content, "personal", budget) if "personal" in content.array_records else None
    n = _meta_int(meta, "num-test-examples")
    if n < 0:
        raise MalformedReply(f"num-test-examples = {n} is negative")
    return _meta_int(meta, "partition-id"), _arrays(content, "state", budget), n, personal
