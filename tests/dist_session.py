"""One torchrun session of the distributed tests (``tests/test_distributed.py``): every rank runs this script
with the same arguments and calls ``fedsight.api.execute`` for each case: rank 0 runs it, the other serves it, as
``fedsight run CONFIG --nproc N`` does. Each rank writes what happened to OUT/session-RANK.json.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist_session.py OUT

The cases (``CASES``) are the issue's: FedAvg, SCAFFOLD (client state, stopped after round 2 and resumed in one
process by the test), FedBN (personal entries), Krum (needs every update), a staged recipe, FedAvg vectorised;
DP-SGD (client noise and privacy spent), central DP; then runs that must not start or must fail: ranks disagreeing
on the config, clients drawing noise from their own secrets, a rank whose training fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import pipeline_config, tiny  # noqa: E402

BASE = {"engine.threads": 1}

#: name -> (raw config, stop_after)
CASES: dict[str, tuple[dict[str, Any], int | None]] = {
    "fedavg": (tiny(**BASE), None),
    "scaffold": (tiny(**BASE, **{"recipe.components": ["scaffold"], "eval.every": 1}), 2),
    "fedbn": (tiny(**BASE, **{"model.norm": "batch", "recipe.sharing": "fedbn"}), None),
    "krum": (tiny(**BASE, **{"recipe.aggregator": {"name": "krum", "byzantine": 1}, "server.clients_per_round": 5}),
             None),
    "staged": (pipeline_config(**BASE), None),
    "vectorised": (tiny(**BASE, **{"engine.vectorize": True, "server.clients_per_round": 4}), None),
    # client-side noise from the seed's streams, and privacy spent kept even for a rejected update
    "dp_sgd": (tiny(**BASE, **{"recipe.components": [{"name": "dp_sgd", "noise_multiplier": 0.5}]}), None),
    # rank 0's admission of the round's releases
    "central_dp": (tiny(**BASE, **{"recipe.weighting": "uniform", "privacy.noise": "simulated",
                                  "privacy.central_dp": {"noise_multiplier": 1.1, "clipping_norm": 0.5}}), None),
}
#: refused before it starts: the clients' own secrets stay in rank 0's run directory
SECRET = tiny(**BASE, **{"privacy.noise": "secret", "recipe.components": [{"name": "dp_sgd", "noise_multiplier": 0.5}]})
#: the failing case: rank 1's clients raise from round 3 on (one process never does)
FAILING = tiny(**BASE, **{"recipe.components": ["fail_on_rank_1"], "eval.every": 1})


def register() -> None:
    """The test component ``fail_on_rank_1`` (every process of the session and the test register it)."""
    from fedsight.registry import COMPONENTS, NoParams
    from fedsight.training import Component

    class FailOnRank1(Component):
        name = "fail_on_rank_1"

        def client_start(self, ctx: Any) -> None:
            import torch.distributed as dist

            if ctx.round >= 3 and dist.is_initialized() and dist.get_rank() == 1:
                raise RuntimeError(f"client {ctx.client_id} cannot train (a test failure)")

    if "fail_on_rank_1" not in COMPONENTS.names():
        COMPONENTS.register("fail_on_rank_1", params=NoParams)(lambda params: FailOnRank1())


def main(out: Path) -> None:
    import torch.distributed as dist

    from fedsight.api import execute
    from fedsight.config import validate
    from fedsight.distributed import current
    from fedsight.distributed.world import finish

    register()
    world = current()
    assert world is not None, "run me under torchrun"
    runs: list[tuple[str, dict[str, Any], int | None]] = [(n, raw, stop) for n, (raw, stop) in CASES.items()]
    # the seed differs on rank 1: the ranks disagree on the config
    runs.append(("disagree", tiny(**BASE, seed=world.rank), None))
    runs.append(("secret", SECRET, None))
    runs.append(("failing", FAILING, None))
    said: dict[str, Any] = {}
    for name, raw, stop in runs:
        raw = {**raw, "run": {**raw["run"], "output_dir": str(out), "name": name}}
        try:  # the same call on every rank: rank 0 runs the server, rank 1 serves ("served", or "refused")
            got = execute(validate(raw), out / name, stop_after=stop)
            said[name] = {"status": got.status}
        except Exception as exc:  # noqa: BLE001 - what the test checks
            said[name] = {"error": f"{type(exc).__name__}: {exc}"}
    (out / f"session-{world.rank}.json").write_text(json.dumps(said))
    dist.barrier()
    finish(0)  # as `fedsight` ends a rank: no C++ teardown of the process group (it can abort at exit)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
