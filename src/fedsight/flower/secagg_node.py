"""The node side of SecAgg+ (``fedsight.flower.secagg``): FedSight's training instruction carried as the legacy
``FitIns`` Flower's SecAgg+ mod expects, and back, and the training inside the protocol (``secagg_train``), which
quantises the update (or a statistics stage's two-limb sums, ``secagg_stats``) for the masked sum."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .secagg_stats import encode_statistic


# -- the instruction as a legacy FitIns, and back ---------------------------------------------------

INSTRUCTION = "fedsight"  # the FitIns config key holding the instruction's records and config (JSON)


def instruction_fitins(content: Any) -> Any:
    """A FedSight instruction (``records.instruction_content``) as a legacy ``FitIns``: every array of every
    array record in order as the parameters, and the records' names, keys and the config as JSON."""
    from flwr.common import FitIns, ndarrays_to_parameters

    entries, arrays = [], []
    for name, record in content.array_records.items():
        for key, arr in record.items():
            entries.append([name, key])
            arrays.append(arr.numpy())
    meta = {"entries": entries, "config": dict(content["config"])}
    return FitIns(ndarrays_to_parameters(arrays), {INSTRUCTION: json.dumps(meta)})


def fitins_instruction(fitins: Any) -> Any:
    """The instruction ``RecordDict`` of a ``FitIns`` written by ``instruction_fitins``."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
    from flwr.common import parameters_to_ndarrays

    meta = json.loads(str(fitins.config[INSTRUCTION]))
    arrays = parameters_to_ndarrays(fitins.parameters)
    content = RecordDict()
    for (name, key), arr in zip(meta["entries"], arrays, strict=True):
        if name not in content.array_records:
            content[name] = ArrayRecord()
        content[name][key] = Array(np.ascontiguousarray(arr))
    content["config"] = ConfigRecord(meta["config"])
    return content


# -- the node side ----------------------------------------------------------------------------------

META = "meta/"  # prefix of the reply's plain scalars (client-id, num-examples, ...) among the FitRes metrics


def secagg_train(msg: Any, context: Any, train: Callable[[Any], Any]) -> Any:
    """A node's answer to a SecAgg+ message: Flower's ``secaggplus_mod`` runs the protocol; its masked-vector
    stage calls ``train(instruction RecordDict)``, FedSight's training (``client_app.train_instruction``: the
    result, whether it is finite, the global state it started from); a refusal of the model, a client that was
    not sampled or a non-finite update raises, and the node drops out."""
    from flwr.app import Message
    from flwr.client.mod import secaggplus_mod
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

    from ..errors import ModelRefused
    from ..rng import derive_seed

    def call_next(m: Any, ctx: Any) -> Any:
        import flwr.compat.common.recorddict_compat as compat

        instruction = fitins_instruction(compat.recorddict_to_fitins(m.content, keep_input=True))
        cfg = dict(instruction["config"])
        try:
            trained = train(instruction)
        except ModelRefused as exc:
            raise RuntimeError(f"refused the global model: {exc}") from None
        res, gstate = trained.result, trained.global_state
        if res is None:
            raise RuntimeError("this node's client was not sampled")
        if not trained.accepted:
            raise RuntimeError("non-finite update (dropped out of the secure aggregation)")
        if cfg.get("secagg-stats"):  # a statistics pass: its statistics (all C classes), two limbs each
            from ..functional.ridge import dense_statistics

            stats = dense_statistics(res.extras[str(cfg["secagg-stats"])], int(cfg["secagg-classes"]))
            encoded = [encode_statistic(stats[k].detach().to(torch.float64).cpu().numpy(), float(bound),
                                        int(cfg["secagg-levels"]))
                       for k, bound in zip(cfg["secagg-stat-names"], cfg["secagg-stat-bounds"], strict=True)]
            vector, clipped, weight = [v for v, _ in encoded], sum(c for _, c in encoded), 1
        else:
            vector = [res.delta[k] for k in cfg["secagg-params"]] + [res.buffers[k] - gstate[k] for k in cfg["secagg-buffers"]]
            vector = [v.detach().to(torch.float64).numpy() for v in vector]
            weight = 1 if cfg["secagg-weighting"] == "uniform" else int(res.num_examples)
            ratio = weight / float(cfg["secagg-max-weight"])
            clipped = sum(int((np.abs(v * ratio) > float(cfg["secagg-clipping-range"])).sum()) for v in vector)
        metrics: dict[str, Any] = {k: float(v) for k, v in res.metrics.items()}
        metrics.update({f"{META}client-id": int(res.client_id), f"{META}num-examples": int(res.num_examples),
                        f"{META}num-steps": int(res.num_steps), f"{META}flops": float(res.flops),
                        f"{META}secagg-clipped": clipped,
                        # the instruction's round and nonce: a masked vector resent in a later round is refused
                        f"{META}round": int(cfg["round"]), f"{META}nonce": int(cfg["secagg-nonce"])})
        # the mod's stochastic rounding draws from NumPy's global generator right after this returns
        np.random.seed(derive_seed(int(cfg["secagg-seed"]), "secagg", int(cfg["round"]), int(res.client_id)) % (2**32))
        fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(vector), weight, metrics)
        return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=m)

    return secaggplus_mod(msg, context, call_next)


def is_secagg(content: Any) -> bool:
    """Whether a message is one of the SecAgg+ protocol's (it carries the protocol's config record)."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    return RECORD_KEY_CONFIGS in content.config_records
