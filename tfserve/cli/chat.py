"""`tfserve chat`: chat in the terminal with a server (any OpenAI-compatible one) or with a model loaded
in-process. torch, transformers and the openai SDK are imported inside the command."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from tfserve.chat.conversation import DEFAULT_MAX_TOKENS
from tfserve.cli.completion import chat_models
from tfserve.cli.options import (DEFAULT_MODEL, AttnImplementationOpt, DeviceOpt, Dtype, DtypeOpt, Quantization,
                                 QuantizationOpt, TrustRemoteCodeOpt)

GENERATION = "Generation"
TOOLS = "MCP tools"


def chat(
    ctx: typer.Context,
    url: Annotated[str | None, typer.Argument(
        help="Server to talk to: PORT, HOST:PORT or http(s)://HOST:PORT, with or without /v1. "
             "Without it, the model is loaded in this process.", show_default=False)] = None,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", show_default=False, autocompletion=chat_models,
        help="With a URL: the server's model (default: the first chat model in /v1/models; one the server "
             "does not serve is refused at start). Without: what to load, like "
             f"`serve --model` (default: {DEFAULT_MODEL}).")] = None,
    api_key: Annotated[str | None, typer.Option(
        envvar=["TFSERVE_API_KEY", "OPENAI_API_KEY"], show_envvar=True, show_default=False,
        help="Key for a protected server (sent as Authorization: Bearer KEY).")] = None,
    protocol: Annotated[str, typer.Option(
        "--protocol", metavar="auto|openai|ollama|tgi", show_default=True,
        help="The server's API: auto tries OpenAI's, then Ollama's (/api/version) and TGI's (/info).")] = "auto",
    system: Annotated[str | None, typer.Option("--system", "-s", help="System prompt.", show_default=False,
                                               rich_help_panel=GENERATION)] = None,
    temperature: Annotated[float | None, typer.Option(help="Sampling temperature; 0 is greedy.", show_default=False,
                                                      rich_help_panel=GENERATION)] = None,
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling: keep the tokens of this much probability.",
                                                show_default=False, rich_help_panel=GENERATION)] = None,
    max_tokens: Annotated[int | None, typer.Option(
        help=f"Longest reply, in tokens (default: {DEFAULT_MAX_TOKENS}, or what the context leaves if less; "
             "/set max_tokens in the chat changes it).", show_default=False, rich_help_panel=GENERATION)] = None,
    seed: Annotated[int | None, typer.Option(help="Make replies repeatable.", show_default=False,
                                             rich_help_panel=GENERATION)] = None,
    no_markdown: Annotated[bool, typer.Option("--no-markdown", help="Show replies as plain text, not markdown.",
                                              rich_help_panel=GENERATION)] = False,
    mcp_config: Annotated[Path | None, typer.Option(
        "--mcp-config", metavar="FILE", show_default=False, rich_help_panel=TOOLS,
        help="MCP servers whose tools the model may call: a JSON file in Claude Desktop's mcpServers format. "
             "Each call is shown and asked about first; /tools lists them.")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", rich_help_panel=TOOLS,
                                      help="Run tool calls without asking (/set approve auto|ask changes it). "
                                           "With piped input, tools run only with --yes.")] = False,
    mcp_timeout: Annotated[float, typer.Option(
        min=0.001, metavar="SECONDS", rich_help_panel=TOOLS,
        help="A tool call running longer fails (an error panel, and an error the model reads).")] = 60.0,
    dtype: DtypeOpt = Dtype.auto,
    device: DeviceOpt = "auto",
    quantization: QuantizationOpt = Quantization.none,
    attn_implementation: AttnImplementationOpt = None,
    trust_remote_code: TrustRemoteCodeOpt = False,
) -> None:
    """Chat with a model: replies stream as markdown, with tokens, tok/s and time to first token after each.

    Type /help in the chat for its commands (/system, /set, /retry, /save, /stats, /tools, /image...).
    With stdin from a pipe, each line is one message and the answers are printed as plain text; a line that
    fails (a reply, a command) does not stop the rest, and makes the exit code 1.
    /image PATH, or a PNG/JPEG/WebP/GIF file dropped into the terminal, sends the image with your next
    message (to a vision-language model).

    With --mcp-config, the model may call the tools of MCP servers: each call is shown and runs once
    you say y (a: always; --yes never asks); the model then answers with the results.

    [bold]Examples[/bold]

      tfserve chat localhost:8000              # a running `tfserve serve`
      tfserve chat                             # no server: the default model, in-process
      tfserve chat -m ./my-hf-model --temperature 0 --system 'Answer briefly.'
      tfserve chat https://api.example.com/v1 -m some-model --api-key KEY
      tfserve chat localhost:11434 --protocol ollama   # an Ollama server (TGI's: --protocol tgi)
      echo 'Name three colours.' | tfserve chat 8000 --max-tokens 50
      echo 'Describe ./photo.jpg' | tfserve chat 8000    # the image goes with the message
      tfserve chat 8000 --mcp-config ~/mcp.json  # tools from MCP servers (Claude Desktop's format)
    """
    from tfserve.chat.conversation import Conversation, Settings
    from tfserve.chat.session import ChatSession
    from tfserve.cli.output import console, err_console

    try:
        settings = Settings(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
    except ValueError as exc:
        name, _, why = str(exc).partition(" ")
        raise typer.BadParameter(why, param_hint=f"--{name.replace('_', '-')}") from None
    mcp_servers = _load_mcp_config(mcp_config) if mcp_config is not None else None
    if url is not None:
        from tfserve.chat.protocols import PROTOCOLS, connect_remote

        if protocol not in PROTOCOLS:
            raise typer.BadParameter(f"must be one of {', '.join(PROTOCOLS)}", param_hint="--protocol")
        if ctx.get_parameter_source("api_key").name == "ENVIRONMENT":
            api_key = None  # RemoteBackend reads the same variables, and names the one it took if the key is refused
        backend = connect_remote(url, protocol, api_key=api_key, model=model)
    else:
        load_options = {"dtype": dtype, "device": device, "quantization": quantization,
                        "attn_implementation": attn_implementation, "trust_remote_code": trust_remote_code}
        backend = load_local(model or DEFAULT_MODEL, load_options)
    piped = not sys.stdin.isatty()
    toolbox, warnings = None, None
    try:
        if mcp_servers is not None:
            warnings = _WarningLines.install()
            toolbox = _start_mcp(mcp_servers, mcp_timeout)
        session = ChatSession(backend, err_console if piped else console, conversation=Conversation(system=system),
                              settings=settings, plain=piped, markdown=not no_markdown, tools=toolbox,
                              auto_approve=yes)
        if piped:
            raise typer.Exit(_run_piped(session))
        from tfserve.chat.repl import run_repl

        run_repl(session)
    finally:
        if toolbox is not None:
            toolbox.close()  # stdio servers stop with the chat, however it ends
        if warnings is not None:
            warnings.remove()
        backend.close()


def load_local(spec: str, load_options: dict):
    """Load `spec` with the engine's defaults, as `tfserve serve` does, and chat with it in-process."""
    from tfserve.chat.local import LocalBackend
    from tfserve.cli.loading import load_engine, refuse_speech_model
    from tfserve.errors import ModelNotFoundError
    from tfserve.models import store

    refuse_speech_model(spec, "`tfserve transcribe` takes it, not `tfserve chat`")
    try:
        async_engine = load_engine(spec, load_options)
    except ModelNotFoundError as exc:  # a name that names nothing: offer the chat models, not every stored one
        if str(exc) == store.not_found_message(spec):  # the loader's last resort, the whole store's list
            raise ModelNotFoundError(store.not_found_message(spec, chat_only=True)) from None
        raise
    return LocalBackend(async_engine.manager, async_engine.engine.model_name)


def _load_mcp_config(path: Path) -> dict:
    """The config's servers; a bad file is one line (ChatError) before anything starts."""
    from tfserve.chat.backend import ChatError
    from tfserve.mcp.config import load_mcp_config

    try:
        return load_mcp_config(path.expanduser())
    except ValueError as exc:
        raise ChatError(f"--mcp-config: {exc}") from None


def _start_mcp(configs: dict, timeout_s: float):
    """Start the servers; one that fails is a warning line (its tools are missing, the others work)."""
    from tfserve.chat.mcp_tools import McpToolbox

    toolbox = McpToolbox(configs, timeout_s=timeout_s, errlog=_stderr_file())
    try:
        toolbox.start()
    except BaseException:
        toolbox.close()
        raise
    return toolbox


class _WarningLines(logging.Handler):
    """While the chat runs, MCP warnings (a server that failed to start, or was restarted) are yellow lines on
    stderr, instead of bare log lines."""

    LOGGERS = ("tfserve.mcp", "tfserve.chat")

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.propagates: dict[str, bool] = {}  # each logger's own setting, put back by remove()

    @classmethod
    def install(cls) -> _WarningLines:
        handler = cls()
        for name in cls.LOGGERS:
            logger = logging.getLogger(name)
            handler.propagates[name] = logger.propagate
            logger.addHandler(handler)
            logger.propagate = False
        return handler

    def remove(self) -> None:
        for name, propagate in self.propagates.items():
            logger = logging.getLogger(name)
            logger.removeHandler(self)
            logger.propagate = propagate

    def emit(self, record: logging.LogRecord) -> None:
        from tfserve.cli.output import warn

        warn(record.getMessage())


def _stderr_file():
    """Where stdio MCP servers' stderr goes: ours, or the process's own when ours has no file descriptor."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return sys.__stderr__


def _run_piped(session) -> int:
    from tfserve.chat.repl import run_piped

    return run_piped(session, sys.stdin)
