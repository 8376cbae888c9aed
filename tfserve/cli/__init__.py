"""The `tfserve` command line: one Typer app, one module per subcommand.

Torch and transformers are imported only inside the commands that need them, so `tfserve --help` and
`tfserve --version` answer instantly.
"""

from __future__ import annotations

from typing import Annotated

import typer
from typer.core import TyperGroup

from tfserve import __version__
from tfserve.cli import chat as chat_cli
from tfserve.cli import bench as bench_cli
from tfserve.cli import models as models_cli
from tfserve.cli import serve as serve_cli
from tfserve.cli import transcribe as transcribe_cli
from tfserve.cli.serve_compat import ServeCommand
from tfserve.errors import TfserveError

class _Group(TyperGroup):
    """The root group: a `TfserveError` raised anywhere below it becomes one red line and exit code 1.

    (Typer vendors its own click, so a `click.ClickException` raised here would escape as a traceback;
    printing and raising `typer.Exit` works with either.)"""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TfserveError as exc:
            from tfserve.cli.output import error

            error(str(exc))
            raise typer.Exit(1) from None


app = typer.Typer(
    name="tfserve",
    cls=_Group,
    no_args_is_help=True,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
)
app.add_typer(models_cli.app, name="models")
app.command("serve", cls=ServeCommand)(serve_cli.serve)
app.command("chat")(chat_cli.chat)
app.command("transcribe")(transcribe_cli.transcribe)
app.add_typer(bench_cli.app, name="bench")


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

    Models live in $TFSERVE_HOME (default ~/.cache/tfserve); every command has --help.

    [bold]Examples[/bold]

      tfserve models pull                 # fetch the default model (SmolLM2-135M-Instruct)
      tfserve models list
    """


def main() -> None:
    """Console-script entry point."""
    app()
