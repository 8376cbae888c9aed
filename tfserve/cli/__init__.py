"""The `tfserve` command line: one Typer app, one module per subcommand.

Torch and transformers are imported only inside the commands that need them, so `tfserve --help` and
`tfserve --version` answer instantly.
"""

from __future__ import annotations

from typing import Annotated

import click
import typer
from typer.core import TyperGroup

from tfserve import __version__
from tfserve.cli import models as models_cli
from tfserve.errors import TfserveError

class _CliError(click.ClickException):
    """A library error shown as one red line (exit code 1), never a traceback."""

    def show(self, file=None) -> None:
        from tfserve.cli.output import error

        error(self.message)


class _Group(TyperGroup):
    """The root group: turns a `TfserveError` raised anywhere below it into a `_CliError`."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except TfserveError as exc:
            raise _CliError(str(exc)) from None


app = typer.Typer(
    name="tfserve",
    cls=_Group,
    help="Serve, chat with and benchmark Hugging Face transformers models.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
)
app.add_typer(models_cli.app, name="models")


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"tfserve {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", "-V", help="Print the version and exit.", callback=_version_callback, is_eager=True),
    ] = False,
) -> None:
    """Serve, chat with and benchmark Hugging Face transformers models.

    [bold]Examples[/bold]

      tfserve models pull                 # fetch the default model (SmolLM2-135M-Instruct)
      tfserve models list
    """


def main() -> None:
    """Console-script entry point."""
    app()
