"""`tfserve chat`: chat in the terminal with a server (any OpenAI-compatible one) or with a model loaded
in-process. torch, transformers and the openai SDK are imported inside the command."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from tfserve.chat.conversation import DEFAULT_MAX_TOKENS
from tfserve.cli.options import (DEFAULT_MODEL, AttnImplementationOpt, DeviceOpt, Dtype, DtypeOpt, Quantization,
                                 QuantizationOpt, TrustRemoteCodeOpt)

GENERATION = "Generation"


def chat(
    url: Annotated[str | None, typer.Argument(
        help="Server to talk to: PORT, HOST:PORT or http(s)://HOST:PORT, with or without /v1. "
             "Without it, the model is loaded in this process.", show_default=False)] = None,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", show_default=False,
        help="With a URL: the server's model (default: the first in /v1/models). Without: what to load, like "
             f"`serve --model` (default: {DEFAULT_MODEL}).")] = None,
    api_key: Annotated[str | None, typer.Option(
        envvar=["TFSERVE_API_KEY", "OPENAI_API_KEY"], show_envvar=True, show_default=False,
        help="Key for a protected server (sent as Authorization: Bearer KEY).")] = None,
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
    dtype: DtypeOpt = Dtype.auto,
    device: DeviceOpt = "auto",
    quantization: QuantizationOpt = Quantization.none,
    attn_implementation: AttnImplementationOpt = None,
    trust_remote_code: TrustRemoteCodeOpt = False,
) -> None:
    """Chat with a model: replies stream as markdown, with tokens, tok/s and time to first token after each.

    Type /help in the chat for its commands (/system, /set, /retry, /save, /load, /models, /stats...).
    With stdin from a pipe, each line is one message and the answers are printed as plain text.

    [bold]Examples[/bold]

      tfserve chat localhost:8000              # a running `tfserve serve`
      tfserve chat                             # no server: the default model, in-process
      tfserve chat -m ./my-hf-model --temperature 0 --system 'Answer briefly.'
      tfserve chat https://api.example.com/v1 -m some-model --api-key KEY
      echo 'Name three colours.' | tfserve chat 8000 --max-tokens 50
    """
    from tfserve.chat.conversation import Conversation, Settings
    from tfserve.chat.session import ChatSession
    from tfserve.cli.output import console, err_console

    try:
        settings = Settings(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
    except ValueError as exc:
        name, _, why = str(exc).partition(" ")
        raise typer.BadParameter(why, param_hint=f"--{name.replace('_', '-')}") from None
    if url is not None:
        from tfserve.chat.client import RemoteBackend

        backend = RemoteBackend(url, api_key=api_key, model=model).connect()
    else:
        load_options = {"dtype": dtype, "device": device, "quantization": quantization,
                        "attn_implementation": attn_implementation, "trust_remote_code": trust_remote_code}
        backend = load_local(model or DEFAULT_MODEL, load_options)
    piped = not sys.stdin.isatty()
    session = ChatSession(backend, err_console if piped else console, conversation=Conversation(system=system),
                          settings=settings, plain=piped, markdown=not no_markdown)
    try:
        if piped:
            raise typer.Exit(_run_piped(session))
        from tfserve.chat.repl import run_repl

        run_repl(session)
    finally:
        backend.close()


def load_local(spec: str, load_options: dict):
    """Load `spec` with the engine's defaults, as `tfserve serve` does, and chat with it in-process."""
    from tfserve.chat.local import LocalBackend
    from tfserve.cli.loading import load_engine

    async_engine = load_engine(spec, load_options)
    return LocalBackend(async_engine.manager, async_engine.engine.model_name)


def _run_piped(session) -> int:
    from tfserve.chat.repl import run_piped

    return run_piped(session, sys.stdin)
