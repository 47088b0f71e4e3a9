"""What a run of a config logs, and whether higher or lower is better for each metric.

``RUN_DIR/run.json`` records this table (``runs.RunDir.write_run_meta``) and reports read directions from
there, never from metric names (NME and LPIPS are lower-is-better without saying "loss"). The table is
built from declarations: the task's metric specs (``TaskSpec``), the engine's own metrics below, and
the ``metrics`` each recipe part declares in its registry entry.
"""

from __future__ import annotations

from typing import Any

from . import registry as R
from .config import stage_configs
from .metrics import MetricSpec

#: metrics every engine logs, with their direction (None: informational)
ENGINE_METRICS = (
    MetricSpec("train/*", False, "mean local objective (train/loss) and trainers' own losses"),
    MetricSpec("cost/*", False, "bytes and FLOPs (lower is cheaper)"),
    MetricSpec("time/*", False, "seconds"),
    MetricSpec("clients/*", None, "clients sampled and aggregated"),
    MetricSpec("flower/*", None, "Flower deployment facts"),
    MetricSpec("dp/epsilon", False, "cumulative privacy loss"),
    MetricSpec("dp/*", None, "differential-privacy bookkeeping"),
)

#: what a run spends rather than achieves, per round or cumulative: communication (bytes), compute (FLOPs,
#: passes, seconds) and privacy loss (epsilon). Lower is cheaper, but no round of them is a result to select: the
#: "best" of a running total is its first round. Reports show their final value (or the protocol's mean of the
#: last evaluations) and never a best. Patterns as in ``MetricSpec.matches`` (``*`` spans ``/`` too).
BUDGET_METRICS = ("cost/*", "time/*", "*epsilon*", "*bytes*", "*flops*",
                  "fedvg/server_passes", "fedvg/server_examples", "fedvg/score_s")


def is_budget(key: str) -> bool:
    """Whether ``key`` is a budget metric (``BUDGET_METRICS``): bytes, FLOPs, seconds or privacy loss."""
    return any(MetricSpec(pattern, False).matches(key) for pattern in BUDGET_METRICS)


def metric_directions(cfg: Any) -> tuple[dict[str, bool | None], str]:
    """Every metric key (or ``prefix/*`` family) a run of ``cfg`` logs, with whether higher is better,
    and its primary key (``test/<primary>``): what ``RUN_DIR/run.json`` records and reports read."""
    spec = R.TASKS.get(cfg.task.name).meta["spec"](cfg.task)
    out: dict[str, bool | None] = {}
    for m in spec.metrics:
        for split in ("test", "local", "val", "test_*"):  # test_*: a task's extra test sets (test_unseen/miou)
            out[f"{split}/{m.key}"] = m.higher_is_better
    primary = next((m.higher_is_better for m in spec.metrics if m.matches(spec.primary)), True)
    out["local/wma"] = out["local/worst10"] = primary
    if cfg.eval.class_split:  # fedsight.class_split: the clients' own classes (higher is better) and the others (none)
        out["personal/acc_local_classes"] = out["personal/acc_local_classes/*"] = True
        out["personal/acc_nonlocal_classes"] = out["personal/acc_nonlocal_classes/*"] = None
    for s in ENGINE_METRICS:
        out[s.key] = s.higher_is_better
    from .model_selection import selection_directions

    out.update(selection_directions(cfg))  # eval.select = "best": selected/round, selected/val/*, selected/test/*
    for c in [cfg] + [scfg for _, _, scfg in stage_configs(cfg)]:
        rc = c.recipe
        parts = [(R.WEIGHTINGS, rc.weighting), (R.AGGREGATORS, rc.aggregator), (R.SHARING, rc.sharing),
                 (R.SERVER_OPTIMIZERS, c.server.optimizer)] + [(R.COMPONENTS, x) for x in rc.components]
        for reg, part in parts:
            for s in reg.get(part.name).meta.get("metrics", ()):
                out[s.key] = s.higher_is_better
    return out, f"test/{spec.primary}"
