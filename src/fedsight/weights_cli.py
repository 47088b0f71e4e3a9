"""``fedsight weights``: published checkpoints converted once into FedSight's safetensors (``fedsight.weights``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from .weights import LAYOUTS

weights_app = typer.Typer(help="Published checkpoints (torchvision's ...) converted into FedSight's safetensors.",
                          no_args_is_help=True)
console = Console(highlight=False)


@weights_app.command("convert")
def convert_cmd(
    src: Annotated[Path, typer.Argument(help="The checkpoint: .pth/.pt/.bin (read with torch.load(weights_only=True)) "
                                              "or .safetensors.")],
    dst: Annotated[Path, typer.Argument(help="The FedSight safetensors file to write.")],
    layout: Annotated[str, typer.Option("--from", help=f"Whose key names SRC uses: {', '.join(LAYOUTS)}.")] = "torchvision",
    force: Annotated[bool, typer.Option(help="Replace DST if it exists.")] = False,
) -> None:
    """Convert SRC, published in another library's layout, into FedSight's key names once; a config's
    init.weights = DST then loads it with the default layout (add init.exclude = ["head.*"] for another number of
    classes)."""
    from .errors import OutputPathError
    from .safe_write import check_output
    from .weights import convert_file

    try:
        if layout not in LAYOUTS:
            raise ValueError(f"--from {layout}: unknown layout; choose one of: {', '.join(LAYOUTS)}")
        check_output(dst, "DST", force=force)
        n = convert_file(src, dst, layout)
    except (ValueError, FileNotFoundError, OSError, OutputPathError) as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from None
    console.print(escape(f"wrote {dst}: {n} tensors in FedSight's names (from {src}, {layout} layout)"), soft_wrap=True)
