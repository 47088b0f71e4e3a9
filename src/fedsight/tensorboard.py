"""TensorBoard event files of a run (``[run] tensorboard = true``): ``RUN_DIR/tensorboard/``.

Every numeric metric of every round is a scalar at step = round (events such as ``client_lost`` are not);
when the run completes, its plots (``plots/*.png``) are images and the config's scalar settings with the final
metrics are an hparams record (``RUN_DIR/tensorboard/hparams``). ``tensorboard --logdir runs/`` then shows
every run of a sweep side by side. A resumed session opens the log with ``purge_step`` = the run's first
round and logs ``metrics.jsonl``'s rows up to its checkpoint again, so TensorBoard drops what a killed session
had logged after that checkpoint and holds the rounds of sessions that ran without it: every round appears
once, with the values of ``metrics.jsonl``. Needs the ``tensorboard`` package (``pip install
'fedsight[tensorboard]'``); ``run.tensorboard = true`` without it fails at validation, before anything runs."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

LOG_DIR = "tensorboard"


def available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


class EventLog:
    """One session's writer into ``run_dir/tensorboard``; ``first_round``: the first round this session logs;
    ``earlier``: the rows of ``metrics.jsonl`` before it (a resumed run's, cut back to its checkpoint). These
    are logged again over whatever the event files hold from them on (``purge_step``), so every round of the
    run appears once, with its ``metrics.jsonl`` values, also when TensorBoard was turned on at a resume or
    off for some sessions."""

    def __init__(self, run_dir: Path, first_round: int, earlier: list[dict[str, Any]] = ()):
        from torch.utils.tensorboard import SummaryWriter

        earlier = [row for row in earlier if row["round"] < first_round]
        purge = earlier[0]["round"] if earlier else (first_round if first_round > 1 else None)
        self.dir = Path(run_dir) / LOG_DIR
        self.writer = SummaryWriter(log_dir=str(self.dir), purge_step=purge)
        for row in earlier:
            self.round(row["round"], row)

    def round(self, r: int, row: dict[str, Any]) -> None:
        for key, value in row.items():
            if key != "round" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, float(value), r)
        self.writer.flush()

    def finish(self, run_dir: Path, config: dict[str, Any], final: dict[str, Any], r: int) -> None:
        """The run's plots as images and its hparams (flattened scalar settings) with the final metrics."""
        import numpy as np
        from PIL import Image

        for png in sorted((Path(run_dir) / "plots").glob("*.png")):
            with Image.open(png) as im:
                self.writer.add_image(f"plots/{png.stem}", np.asarray(im.convert("RGB")), r, dataformats="HWC")
        hparams = {k: v for k, v in _flat(config).items() if isinstance(v, (int, float, str, bool))}
        metrics = {f"final/{k}": float(v) for k, v in final.items()
                   if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        self.writer.add_hparams(hparams, metrics, run_name="hparams")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        elif isinstance(v, list):
            out[key] = str(v)  # hparams take scalars: a list is shown as text
        else:
            out[key] = v
    return out
