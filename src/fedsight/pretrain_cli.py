"""``fedsight pretrain``: the server's feature extractor pre-trained on its own split (``fedsight.pretrain``), one
file per distinct setup of a sweep. The command's output goes through ``fedsight.cli``'s console and error
line (imported when it runs: ``fedsight.cli`` registers this command)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from .errors import ConfigError

SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", help="Override a config value: key.path=value (TOML value). Repeatable."),
]


def pretrain_(
    config: Annotated[Path, typer.Argument(help='TOML config with pretrain.source = "samples"; a sweep pre-trains each distinct setup once.')],
    set_: SetOpt = None,
    out: Annotated[
        Optional[Path],
        typer.Option(help="Write the extractor here (default: pretrain.weights, else <run.output_dir>/pretrained/<key>.safetensors)."),
    ] = None,
    force: Annotated[bool, typer.Option(help="Pre-train again even when the weights file exists.")] = False,
) -> None:
    """Pre-train the feature extractor on the server's split of the training pool (no client holds it).

    Writes the backbone (safetensors) and a .json sidecar with the training loss and the test accuracy of the pre-trained model with its own head.

    `fedsight run` on the same config loads this file, and pre-trains by itself when the file is missing.
    """
    from . import cli_common as C
    from .safe_write import check_output

    if out is not None:
        C.guard(check_output, out, "--out", force=True)  # an existing file: below (pre-trained, or --force)
    from . import sweep as S
    from .api import build_task
    from .pretrain import pretrain, pretrain_key, pretrain_weights_path, sidecar_path

    try:
        specs = S.load(config, set_ or [])
    except ConfigError as exc:
        C.fail(str(exc))
    todo: dict[Path, Any] = {}
    for spec in specs:
        if spec.config.pretrain.source == "none":
            C.fail(f'{config}: pretrain.source = "none" (run {spec.run_dir}); set pretrain.source = "samples" '
                  "in the config or pass --set pretrain.source=samples")
        todo.setdefault(out or pretrain_weights_path(spec.config), spec)
    if out is not None and len({pretrain_key(s.config) for s in specs}) > 1:
        C.fail(f"--out names one file but {config} has {len({pretrain_key(s.config) for s in specs})} distinct pretraining "
              "setups (seeds or variants); drop --out to give each its own file")
    for path in todo:  # each file it writes, and its sidecar, before anything is computed
        for target in (path, sidecar_path(path)):
            C.guard(check_output, target, "--out" if target == out else "", force=True)
        if path.is_file() and not sidecar_path(path).is_file() and not force:
            C.fail(f"{'--out ' if path == out else ''}{path}: exists without its sidecar {sidecar_path(path)} (not a "
                  "file `fedsight pretrain` wrote); pass --force to replace it")
    for path, spec in todo.items():
        cfg = spec.config
        label = f"pretrain {spec.variant or cfg.run.name} seed {cfg.seed}"
        if path.is_file() and sidecar_path(path).is_file() and not force:
            import json

            meta = json.loads(sidecar_path(path).read_text())
            C.say(f"{label}: already pre-trained (test acc {meta['test'].get('acc', float('nan')):.4f}) in {path}; "
                 "--force to redo")
            continue
        try:
            task = build_task(cfg)  # data errors surface before the progress bar
            with C.progress() as progress:
                bar = progress.add_task(escape(label), total=cfg.pretrain.epochs, detail="pre-training")

                def on_epoch(epoch: int, loss: float) -> None:
                    progress.update(bar, completed=epoch, detail=f"epoch {epoch}: train loss {loss:.4f}")

                res = pretrain(cfg, task, out=path, progress=on_epoch)
        except (ConfigError, FileNotFoundError, ValueError) as exc:
            C.fail(str(exc), 1)
        extra = res.test.get("acc_pretrain_classes")
        seen = f" ({extra:.4f} on pretrain.classes)" if extra is not None else ""
        C.console.print(
            f"{label}: {res.num_examples} server examples, {cfg.pretrain.epochs} epochs, final train loss "
            f"{res.train_loss[-1]:.4f}; test acc {res.test.get('acc', float('nan')):.4f}{seen} (own head)"
        )
        C.say(f"weights: {res.path}  details: {res.meta_path}")
        if out is not None:
            C.say(f"use it with: fedsight run {config} --set pretrain.weights={res.path}")
