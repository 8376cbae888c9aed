"""`tfserve serve`: load a model and serve the OpenAI API over the continuous-batching engine.

torch, transformers and the server are imported inside the command, so `tfserve --help` stays instant.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Annotated

import typer

from tfserve.cli.options import (DEFAULT_MODEL, AttnImplementationOpt, DeviceOpt, Dtype, DtypeOpt, ModelOpt,
                                 Quantization, QuantizationOpt, TrustRemoteCodeOpt)
from tfserve.errors import TfserveError

ENGINE = "Engine"
SERVER = "Server"
_SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, name: str) -> float:
    """'4GiB', '512MB', '1000000' -> bytes; a plain number <= 1 stays a fraction."""
    match = _SIZE.match(text)
    if match is None:
        raise typer.BadParameter(f"{text!r} is not a size (e.g. 0.5, 2GiB, 512MiB)", param_hint=name)
    value = float(match.group(1))
    unit = (match.group(2) or "").lower()
    return value * _UNITS[unit] if unit else value


def serve(
    model: ModelOpt = DEFAULT_MODEL,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0 for every interface).",
                                      rich_help_panel=SERVER)] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", help="Port to listen on.", rich_help_panel=SERVER)] = 8000,
    dtype: DtypeOpt = Dtype.auto,
    device: DeviceOpt = "auto",
    quantization: QuantizationOpt = Quantization.none,
    attn_implementation: AttnImplementationOpt = None,
    trust_remote_code: TrustRemoteCodeOpt = False,
    max_batch_tokens: Annotated[int, typer.Option(help="Token budget of one engine step (prefill chunks + decodes).",
                                                  rich_help_panel=ENGINE)] = 512,
    max_num_seqs: Annotated[int, typer.Option(help="Sequences decoded together, at most.",
                                              rich_help_panel=ENGINE)] = 64,
    kv_cache_memory: Annotated[str | None, typer.Option(
        help="KV cache size: bytes (2GiB, 512MiB) or a fraction of free memory (0.5). "
             "Default: 1 GiB on CPU, 70% of free GPU memory.", rich_help_panel=ENGINE)] = None,
    block_size: Annotated[int, typer.Option(help="Tokens per KV cache block (a power of two).",
                                            rich_help_panel=ENGINE)] = 16,
    no_prefix_caching: Annotated[bool, typer.Option("--no-prefix-caching",
                                                    help="Do not reuse the KV of shared prompt prefixes.",
                                                    rich_help_panel=ENGINE)] = False,
    max_body_size: Annotated[str, typer.Option(help="Largest request body; bigger ones get 413.",
                                               rich_help_panel=SERVER)] = "16MiB",
    max_queued: Annotated[int, typer.Option(help="Sequences waiting for their first token, at most; more get 429 "
                                                 "(0: no limit).", rich_help_panel=SERVER)] = 1024,
    api_key: Annotated[str | None, typer.Option(envvar="TFSERVE_API_KEY", show_envvar=True,
                                                help="Require `Authorization: Bearer KEY` on /v1/* (/health stays open).",
                                                rich_help_panel=SERVER)] = None,
    cors_allow_origins: Annotated[list[str] | None, typer.Option(
        help="Origin browsers may call from (repeatable; * for any).", rich_help_panel=SERVER)] = None,
    drain_timeout: Annotated[float, typer.Option(help="Seconds SIGINT/SIGTERM waits for in-flight requests.",
                                                 rich_help_panel=SERVER)] = 30.0,
    force_model: Annotated[str | None, typer.Option(help="Serve this model whatever a request's `model` names "
                                                         "(overrides --model; no other model is loaded on demand).",
                                                    rich_help_panel=SERVER)] = None,
    otel: Annotated[bool, typer.Option("--otel", help="Export a trace per request and the engine's gauges over "
                                                      "OTLP (OTEL_* variables configure it; needs the otel extra).",
                                       rich_help_panel=SERVER)] = False,
    log_level: Annotated[str, typer.Option(help="debug, info (one access-log line per request), warning or error.",
                                           rich_help_panel=SERVER)] = "info",
) -> None:
    """Serve a model over the OpenAI API: chat completions, responses, completions, models, health, metrics.

    Any OpenAI client works against it: point its base URL at http://HOST:PORT/v1.
    A request naming another model of the store loads it on demand, evicting the idle one.
    SIGINT/SIGTERM stop accepting requests, let in-flight ones finish (up to --drain-timeout) and exit 0.

    [bold]Examples[/bold]

      tfserve serve                                        # the default model on 127.0.0.1:8000
      tfserve serve -m ./my-hf-model --port 9000 --api-key secret
      tfserve serve --max-num-seqs 128 --kv-cache-memory 4GiB --cors-allow-origins '*'
      OTEL_EXPORTER_OTLP_ENDPOINT=http://localhost:4318 tfserve serve --otel
      curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hello!"}]}'
    """
    import asyncio

    from tfserve.models.loading import resolve_model
    from tfserve.server.app import create_app
    from tfserve.server.run import serve as run_server
    from tfserve.server.state import ServerState
    from tfserve.server.telemetry import from_options

    spec = force_model or model
    if spec != DEFAULT_MODEL:
        resolve_model(spec)  # a wrong name fails now, before the port is bound
    kv_bytes = parse_size(kv_cache_memory, "--kv-cache-memory") if kv_cache_memory else None
    engine_kwargs = {"max_batch_tokens": max_batch_tokens, "max_num_seqs": max_num_seqs, "block_size": block_size,
                     "kv_cache_memory": kv_bytes, "enable_prefix_caching": not no_prefix_caching}
    _check_engine_config(engine_kwargs)
    _configure_logging(log_level)
    load_options = {"dtype": dtype, "device": device, "quantization": quantization,
                    "attn_implementation": attn_implementation, "trust_remote_code": trust_remote_code}

    def load_on_demand(other: str) -> tuple:
        return load_engine(other, load_options, engine_kwargs, show_progress=False)

    state = ServerState(max_queued=max_queued, force_model=force_model is not None, load=load_on_demand)
    state.telemetry = from_options(state, otel)
    app = create_app(state, api_key=api_key or None, cors_allow_origins=cors_allow_origins or (),
                     max_body_size=int(parse_size(max_body_size, "--max-body-size")))
    url = f"http://{host}:{port}"

    def load():
        return load_engine(spec, load_options, engine_kwargs)

    def on_ready():
        print_banner(state, url, api_key is not None)

    try:
        asyncio.run(run_server(app, host, port, drain_timeout=drain_timeout, load=load, on_ready=on_ready))
    except OSError as exc:
        raise TfserveError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    except KeyboardInterrupt:
        pass


def load_engine(spec: str, load_options: dict, engine_kwargs: dict, show_progress: bool = True) -> tuple:
    """Load the model and start the engine: the arguments of `ServerState.set_engine`. Loads on demand
    show no progress bars (they would tangle with the access log)."""
    from contextlib import nullcontext

    from tfserve.cli.progress import step_progress
    from tfserve.engine.async_engine import AsyncEngine
    from tfserve.engine.engine import Engine
    from tfserve.models.loading import load_model

    with step_progress() if show_progress else nullcontext(lambda *args, **kwargs: None) as progress:
        loaded = load_model(spec, progress=progress, **load_options)
        progress("Allocating the KV cache")
        engine = Engine(loaded.model, loaded.tokenizer, **engine_kwargs)
    engine.model_name = loaded.name
    engine.device, engine.dtype = loaded.device, loaded.dtype
    return engine, AsyncEngine(engine).start(), loaded.name, loaded.path


def print_banner(state, url: str, has_api_key: bool) -> None:
    """Model, dtype, device, KV cache and URL, once the server is ready."""
    from rich.filesize import decimal
    from rich.panel import Panel
    from rich.table import Table

    from tfserve.cli.output import console

    engine = state.engine
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    table.add_row("Model", state.model_name)
    table.add_row("Dtype", str(getattr(engine, "dtype", engine.runner.dtype)).removeprefix("torch."))
    table.add_row("Device", str(getattr(engine, "device", engine.runner.device)))
    table.add_row("KV cache", f"{engine.block_pool.num_blocks} blocks x {engine.block_pool.block_size} tokens, "
                              f"{decimal(engine.runner.kv_cache_bytes)}")
    table.add_row("Context", f"{engine.max_model_len} tokens")
    table.add_row("URL", f"{url}/v1" + ("  (API key required)" if has_api_key else ""))
    console.print(Panel(table, title="tfserve serve", expand=False))
    console.print(f"Health: {url}/health   Metrics: {url}/metrics   Ctrl+C drains and stops.")


def _check_engine_config(engine_kwargs: dict) -> None:
    from tfserve.config import EngineConfig

    try:
        EngineConfig(**engine_kwargs)
    except ValueError as exc:
        raise TfserveError(f"--{str(exc).replace('_', '-')}") from None


def _configure_logging(level: str) -> None:
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise typer.BadParameter(f"unknown log level {level!r}", param_hint="--log-level")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger("tfserve")
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    root.propagate = False
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
