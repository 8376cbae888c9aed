"""The `tfserve` Typer app: the root group, its subcommands (one module each) and `--version`.

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
    """The root group: a `TfserveError` raised anywhere below it becomes one red line and exit code 1 (2 for a
    `UsageError`: option values tfserve itself refuses); a usage error of Click's (a bad option value, a missing
    argument, an unknown option or command) one red line with Click's message and its help hint, and exit code 2.

    (Typer vendors its own click, so a `click.ClickException` raised here would escape as a traceback;
    printing and raising `typer.Exit` works with either.)"""

    def make_context(self, info_name, args, parent=None, **extra):
        try:  # the root's own options (`tfserve --bogus`) are parsed here
            return super().make_context(info_name, args, parent, **extra)
        except typer.TyperException as exc:
            _usage_error(exc)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TfserveError as exc:
            from tfserve.cli.output import error

            error(str(exc))
            raise typer.Exit(exc.exit_code) from None
        except typer.TyperException as exc:  # Click's errors: every subcommand's parsing runs in here
            _usage_error(exc)


def _usage_error(exc: typer.TyperException):
    """Click's error `exc` as one line, e.g. "Error: Invalid value for '--port' / '-p': ... Try 'tfserve serve
    --help' for help.", and its exit code (2 for usage errors); Click's no-arguments help is left to Click."""
    if type(exc).__name__ == "NoArgsIsHelpError":  # `tfserve models` alone: Click prints the help
        raise exc
    from tfserve.cli.output import bad_value_message, error

    message = bad_value_message(exc).strip()
    ctx = getattr(exc, "ctx", None)
    if ctx is not None and ctx.command.get_help_option(ctx) is not None:
        help_option = "--help" if "--help" in ctx.help_option_names else ctx.help_option_names[0]
        stop = "" if message.endswith((".", "?", "!")) else "."  # "Did you mean 'list'?" ends a sentence too
        message += f"{stop} Try '{ctx.command_path} {help_option}' for help."
    error(message)
    raise typer.Exit(exc.exit_code) from None


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
