"""The `tfserve` command line: one Typer app (`tfserve.cli.root`), one module per subcommand.

This module stays light: a shell's TAB after `--model` is answered from the model store before Typer and the
commands are imported (`tfserve.cli.completion`); `app` is imported when first asked for.
"""

from __future__ import annotations

import os
import sys


def __getattr__(name: str):
    if name == "app":
        from tfserve.cli.root import app

        return app
    raise AttributeError(f"module 'tfserve.cli' has no attribute {name!r}")


def main() -> None:
    """Console-script entry point."""
    if "_TFSERVE_COMPLETE" in os.environ:
        from tfserve.cli.completion import answer_quickly

        answered = answer_quickly(os.environ)
        if answered is not None:
            text, exit_code = answered
            sys.stdout.write(text)
            sys.exit(exit_code)
    from tfserve.cli.root import app

    app()
