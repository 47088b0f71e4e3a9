"""``python -m fedsight ...``: the ``fedsight`` command (``fedsight.cli.main``), for an environment whose scripts
folder is not on PATH."""

from .cli import main

main()
