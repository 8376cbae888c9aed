"""`tfserve serve`: load a model and serve the OpenAI API over the continuous-batching engine.

torch, transformers and the server are imported inside the command, so `tfserve --help` stays instant.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import sys
from contextlib import contextmanager
from enum import Enum
from typing import Annotated

import typer

from tfserve.cli import serve_compat as compat
from tfserve.cli.completion import chat_models, choices, speech_models
from tfserve.cli.loading import check_speech_model, engine_config_from_flags, load_engine, refuse_speech_model
from tfserve.cli.options import (DEFAULT_MODEL, AttnImplementationOpt, DeviceOpt, Dtype, DtypeOpt, ModelOpt,
                                 Quantization, QuantizationOpt, TensorParallelOpt, TrustRemoteCodeOpt, CompileOpt,
                                 CudaGraphOpt)
from tfserve.cli.serve_compat import Reasoning
from tfserve.cli import serve_embeddings
from tfserve.cli.serve_embeddings import EmbeddingModelOpt
from tfserve.cli import serve_limits
from tfserve.cli.serve_limits import (MaxMessagesOpt, MaxRequestPixelsOpt, MaxSeqsPerRequestOpt, MaxStoredItemMibOpt,
                                      MaxStoreMibOpt, ModelSwapIntervalOpt, PinModelOpt)
from tfserve.distributed.autoscale import MAX_REPLICAS
from tfserve.distributed.workers import torchrun_rank
from tfserve.errors import ModelNotFoundError, TfserveError, UsageError
from tfserve.server.connection_limits import (DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS,
                                             DEFAULT_MAX_CONNECTIONS_PER_CLIENT, ConnectionLimits)

ENGINE = "Engine"
DISTRIBUTED = "Distributed"
SERVER = "Server"
MCP = "MCP tools"
MEDIA = "Media"
SPEECH = "Speech"


class GenerationConfig(str, Enum):
    auto = "auto"
    none = "none"


class LogLevel(str, Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"
    critical = "critical"
    detail = "detail"  # transformers' name for debug with file and line


def _power_of_two(value: int | None) -> int | None:
    if value is not None and value & (value - 1):
        raise typer.BadParameter(f"must be a power of two (got {value})")
    return value


def _seed(value: int | None) -> int | None:
    """--default-seed: any seed torch takes (transformers passes it to torch.manual_seed as it is), a negative
    one as torch maps it, 2**64 + seed."""
    if value is not None and not -2**63 <= value < 2**64:
        raise typer.BadParameter(f"must be an integer from -2**63 to 2**64 - 1 (got {value})")
    return value + 2**64 if value is not None and value < 0 else value


def _fraction(value: float | None) -> float | None:
    if value is not None and not 0 < value <= 1:
        raise typer.BadParameter(f"must be a fraction in (0, 1] (got {value})")
    return value
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
    ctx: typer.Context,
    model_arg: Annotated[str | None, typer.Argument(
        metavar="MODEL", show_default=False, autocompletion=chat_models,
        help="Model to serve, pinned as with --force-model (as `transformers serve MODEL`; its org/model@rev and "
             "repo-or-dir:file.gguf forms too).")] = None,
    model: ModelOpt = DEFAULT_MODEL,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0 for every interface).",
                                      rich_help_panel=SERVER)] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", min=1, max=65535, help="Port to listen on.",
                                      rich_help_panel=SERVER)] = 8000,
    dtype: DtypeOpt = Dtype.auto,
    device: DeviceOpt = "auto",
    quantization: QuantizationOpt = Quantization.none,
    attn_implementation: AttnImplementationOpt = None,
    trust_remote_code: TrustRemoteCodeOpt = False,
    generation_config: Annotated[GenerationConfig, typer.Option(
        help="auto: sampling fields a request leaves out (temperature, top_p, top_k, min_p, repetition_penalty, "
             "max_tokens) take the model's generation_config; none: OpenAI's defaults.",
        rich_help_panel=ENGINE)] = GenerationConfig.auto,
    max_batch_tokens: Annotated[int, typer.Option(min=1, help="Token budget of one engine step (prefill chunks + "
                                                              "decodes).", rich_help_panel=ENGINE)] = 512,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="Sequences decoded together, at most.",
                                              rich_help_panel=ENGINE)] = 64,
    max_model_len: Annotated[int | None, typer.Option(
        min=2, metavar="TOKENS", show_default=False, rich_help_panel=ENGINE,
        help="Longest sequence, prompt and output together (vLLM's flag; default: the model's context length).")] = None,
    long_prefill_token_threshold: Annotated[int | None, typer.Option(
        min=1, metavar="TOKENS", show_default=False, rich_help_panel=ENGINE,
        help="A prefill takes at most TOKENS of a step (vLLM's flag): long prompts and images run over several "
             "steps and the decodes beside them keep their pace (default: the step's budget).")] = None,
    kv_cache_memory: Annotated[str | None, typer.Option(
        help="KV cache size: bytes (2GiB, 512MiB) or a fraction of free memory (0.5). "
             "Default: 1 GiB on CPU, 70% of free GPU memory.", rich_help_panel=ENGINE)] = None,
    num_blocks: Annotated[int | None, typer.Option(
        min=1, show_default=False, help="KV cache blocks (instead of sizing the cache by --kv-cache-memory).",
        rich_help_panel=ENGINE)] = None,
    block_size: Annotated[int, typer.Option(min=1, callback=_power_of_two,
                                            help="Tokens per KV cache block (a power of two).",
                                            rich_help_panel=ENGINE)] = 16,
    speculative: Annotated[str | None, typer.Option(
        autocompletion=choices("ngram", "draft"),
        help="Speculative decoding for greedy requests, the same tokens several per step: ngram (prompt lookup: "
             "where the text repeats itself, as in edits, code and quotes) or draft (a smaller model of the same "
             "tokenizer guesses: --speculative-model).", rich_help_panel=ENGINE)] = None,
    speculative_model: Annotated[str | None, typer.Option(
        autocompletion=chat_models,
        help="The draft model of --speculative draft (implies it), as --model takes it: a store name, an HF "
             "directory, a .gguf file or a cached hub id.", rich_help_panel=ENGINE, show_default=False)] = None,
    num_speculative_tokens: Annotated[int, typer.Option(
        min=1, max=16, help="Tokens proposed per step with --speculative.", rich_help_panel=ENGINE)] = 4,
    compile_model: CompileOpt = False,
    cuda_graph: CudaGraphOpt = None,
    tensor_parallel_size: TensorParallelOpt = 1,
    distributed_init_method: Annotated[str | None, typer.Option(
        help="The ranks' rendezvous, tcp://HOST:PORT (default: a free local port).", rich_help_panel=DISTRIBUTED,
        show_default=False)] = None,
    data_parallel_size: Annotated[int, typer.Option(
        "--data-parallel-size", "-dp", min=1, max=MAX_REPLICAS,
        help="Engine replicas, each a process with its own KV cache; a request goes to the one most likely to hold "
             "its prompt's prefix unless that one is much busier.", rich_help_panel=DISTRIBUTED)] = 1,
    min_replicas: Annotated[int | None, typer.Option(
        "--min-replicas", min=1, show_default=False,
        help="Scale the replicas with the load, never below this (default: 1 with --max-replicas).",
        rich_help_panel=DISTRIBUTED)] = None,
    max_replicas: Annotated[int | None, typer.Option(
        "--max-replicas", min=1, max=MAX_REPLICAS, show_default=False,
        help="Scale the replicas with the load, up to this: one per --target-requests-per-replica requests in "
             "flight, added after 5 s of such load, retired after 60 s without (--data-parallel-size: the count "
             "at start).", rich_help_panel=DISTRIBUTED)] = None,
    target_requests_per_replica: Annotated[int, typer.Option(
        "--target-requests-per-replica", min=1,
        help="Requests in flight (running and queued) per replica that scaling aims at.",
        rich_help_panel=DISTRIBUTED)] = 16,
    ray: Annotated[str | None, typer.Option(
        "--ray", metavar="ADDRESS", show_default=False,
        help="Run replicas 1.. of --data-parallel-size as Ray actors on the cluster at ADDRESS (auto: the one "
             "`ray start` runs here; local: start one on this machine). Needs `pip install ray`.",
        rich_help_panel=DISTRIBUTED)] = None,
    nnodes: Annotated[int, typer.Option(
        min=1, help="Machines the ranks span (each runs this command with its --node-rank; the first serves).",
        rich_help_panel=DISTRIBUTED)] = 1,
    node_rank: Annotated[int, typer.Option(
        min=0, help="This machine's place among --nnodes: 0 serves HTTP, the others only run their ranks.",
        rich_help_panel=DISTRIBUTED)] = 0,
    distributed_timeout: Annotated[float, typer.Option(
        min=1, help="Seconds any collective may take before the engine gives up on a rank (a dead rank fails "
                    "the requests in flight, and the server exits, within this).", rich_help_panel=DISTRIBUTED)] = 60.0,
    no_prefix_caching: Annotated[bool, typer.Option("--no-prefix-caching",
                                                    help="Do not reuse the KV of shared prompt prefixes.",
                                                    rich_help_panel=ENGINE)] = False,
    max_body_size: Annotated[str, typer.Option(help="Largest request body; bigger ones get 413.",
                                               rich_help_panel=SERVER)] = "16MiB",
    max_queued: Annotated[int, typer.Option(min=0, help="Sequences waiting for their first token, at most; more get "
                                                        "429 (0: no limit).", rich_help_panel=SERVER)] = 1024,
    api_key: Annotated[str | None, typer.Option(
        envvar="TFSERVE_API_KEY", show_envvar=True, rich_help_panel=SERVER,
        help="Require `Authorization: Bearer KEY` on /v1/*, Ollama's /api/*, TGI's routes and /tokenize "
             "(/health stays open).")] = None,
    admin_key: Annotated[str | None, typer.Option(
        envvar="TFSERVE_ADMIN_KEY", show_envvar=True, rich_help_panel=SERVER, show_default=False,
        help="Turn on /admin/* (POST /admin/replicas starts engine processes), behind `Authorization: Bearer "
             "KEY`; the --api-key does not open them. Without it they answer 403.")] = None,
    header_timeout: Annotated[float, typer.Option(
        min=0.1, metavar="SECONDS", rich_help_panel=serve_limits.LIMITS,
        help="A connection whose request headers take longer is closed (slowloris; nginx's "
             "client_header_timeout).")] = DEFAULT_HEADER_TIMEOUT_S,
    max_connections: Annotated[int, typer.Option(
        min=1, rich_help_panel=serve_limits.LIMITS,
        help="Open connections at most; more get 503 and close. Lowered to fit under the open-file limit "
             "(ulimit -n) less 128.")] = DEFAULT_MAX_CONNECTIONS,
    max_connections_per_client: Annotated[int, typer.Option(
        min=0, rich_help_panel=serve_limits.LIMITS,
        help="Open connections from one client address at most; more get 503 and close (0: no cap; behind a "
             "reverse proxy every client is the proxy's address).")] = DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
    cors_allow_origins: Annotated[list[str] | None, typer.Option(
        help="Origin browsers may call from (repeatable; * for any).", rich_help_panel=SERVER)] = None,
    enable_cors: Annotated[bool, typer.Option("--enable-cors/--no-enable-cors",
                                              help="Let browsers call from any origin: --cors-allow-origins '*'.",
                                              rich_help_panel=SERVER)] = False,
    drain_timeout: Annotated[float, typer.Option(min=0, help="Seconds SIGINT/SIGTERM waits for in-flight requests.",
                                                 rich_help_panel=SERVER)] = 30.0,
    force_model: Annotated[str | None, typer.Option(help="Serve this model whatever a request's `model` names "
                                                         "(overrides --model; no other model is loaded on demand).",
                                                    rich_help_panel=SERVER)] = None,
    model_timeout: Annotated[float, typer.Option(
        min=-1, metavar="SECONDS",
        help="Unload the model after SECONDS without requests; the next request loads it again. -1 (or 0): never "
             "(transformers serve's default is 300). No effect on a pinned model.", rich_help_panel=SERVER)] = -1,
    default_seed: Annotated[int | None, typer.Option(
        callback=_seed, show_default=False,
        help="Seed torch once the model is loaded: requests without a seed then sample the same tokens after a "
             "restart (for the same requests in the same order). A negative seed is 2**64 + seed, as torch "
             "takes it.", rich_help_panel=SERVER)] = None,
    reasoning: Annotated[Reasoning, typer.Option(
        help="on/off: render chat templates with enable_thinking true/false (Qwen3 and other reasoning models); "
             "auto: the template's default.", rich_help_panel=SERVER)] = Reasoning.auto,
    chat_template: Annotated[str | None, typer.Option(
        metavar="FILE", callback=compat.chat_template, show_default=False,
        help="A Jinja chat template (a file, or the template itself) used over the model's own, as vLLM's "
             "--chat-template: a base model without one then serves /v1/chat/completions too.",
        rich_help_panel=SERVER)] = None,
    chat_template_kwargs: Annotated[str | None, typer.Option(
        metavar="JSON", callback=compat.check_json_object, show_default=False,
        help="Chat template variables for every request, a JSON object (e.g. '{\"enable_thinking\": false}'); "
             "a request's own chat_template_kwargs override them.", rich_help_panel=SERVER)] = None,
    otel: Annotated[bool, typer.Option("--otel", help="Export a trace per request and the engine's gauges over "
                                                      "OTLP (OTEL_* variables configure it; needs the otel extra).",
                                       rich_help_panel=SERVER)] = False,
    mcp_config: Annotated[str | None, typer.Option(
        metavar="FILE", show_default=False, rich_help_panel=MCP,
        help="MCP servers whose tools requests may use by server_label (/v1/responses mcp tools; chat completions "
             "with {\"type\": \"mcp\"} tools): an mcpServers JSON file as Claude Desktop and Cursor use. Stdio "
             "servers start with this server, restart if they die and stop with it.")] = None,
    mcp_allow_url: Annotated[list[str] | None, typer.Option(
        metavar="PATTERN", show_default=False, rich_help_panel=MCP,
        help="Let requests name a server_url matching PATTERN (a glob over the URL, e.g. "
             "'https://mcp.example.com/*'); repeatable. Without it a request's server_url is refused.")] = None,
    mcp_timeout: Annotated[float, typer.Option(
        min=0.001, metavar="SECONDS", rich_help_panel=MCP,
        help="A tool call running longer fails (an mcp_call error the model reads), never a hung request.")] = 60.0,
    allowed_media_domains: Annotated[list[str] | None, typer.Option(
        metavar="HOST", show_default=False, rich_help_panel=MEDIA,
        help="Only image URLs on this host are fetched (repeatable; vLLM's flag). Without it any host is, unless "
             "it resolves to a private, loopback, link-local or reserved address.")] = None,
    allowed_local_media_path: Annotated[str | None, typer.Option(
        metavar="DIR", show_default=False, rich_help_panel=MEDIA,
        help="Let requests name file:// image URLs under DIR (symlinks resolved; vLLM's flag). Without it "
             "file:// URLs are refused.")] = None,
    limit_mm_per_prompt: Annotated[str | None, typer.Option(
        metavar="N|JSON", show_default=False, rich_help_panel=MEDIA,
        help="Images one request may hold, over its whole conversation: a number or vLLM's JSON "
             "('{\"image\": 4}'). Default 16.")] = None,
    max_image_size: Annotated[str, typer.Option(
        metavar="SIZE", rich_help_panel=MEDIA,
        help="Largest image file (a data URL, a download, a file); a bigger one is a 400.")] = "20MiB",
    max_image_pixels: Annotated[int, typer.Option(
        min=1, metavar="PIXELS", rich_help_panel=MEDIA,
        help="Largest image, width x height, checked before decoding.")] = 32_000_000,
    media_fetch_timeout: Annotated[float, typer.Option(
        min=0.001, metavar="SECONDS", rich_help_panel=MEDIA,
        help="An image URL taking longer to fetch (redirects included) is a 400.")] = 10.0,
    speech_model: Annotated[str, typer.Option(
        metavar="NAME", rich_help_panel=SPEECH, autocompletion=speech_models,
        help="Whisper model for /v1/audio/* requests naming 'whisper-1' or no model; loaded on the first "
             "one (pulled first if it is a catalog model the store lacks). Requests may name others.")
    ] = "whisper-tiny.en",
    max_audio_seconds: Annotated[float, typer.Option(
        min=1.0, metavar="SECONDS", rich_help_panel=SPEECH,
        help="Longest audio file a transcription takes; a longer one is a 400.")] = 3600.0,
    max_audio_windows: Annotated[int, typer.Option(
        min=1, metavar="N", rich_help_panel=SPEECH,
        help="30-second windows of audio one speech model decodes in one batch (across requests).")] = 8,
    embedding_model: EmbeddingModelOpt = None,
    max_messages: MaxMessagesOpt = serve_limits.DEFAULT_MAX_MESSAGES,
    max_seqs_per_request: MaxSeqsPerRequestOpt = serve_limits.DEFAULT_MAX_SEQS_PER_REQUEST,
    max_request_pixels: MaxRequestPixelsOpt = serve_limits.DEFAULT_MAX_REQUEST_PIXELS,
    model_swap_interval: ModelSwapIntervalOpt = serve_limits.DEFAULT_MODEL_SWAP_INTERVAL_S,
    pin_model: PinModelOpt = False,
    max_store_mib: MaxStoreMibOpt = serve_limits.DEFAULT_STORE_MIB,
    max_stored_item_mib: MaxStoredItemMibOpt = serve_limits.DEFAULT_STORED_ITEM_MIB,
    log_level: Annotated[LogLevel, typer.Option(case_sensitive=False,
                                                help="info logs one access line per request; also sets "
                                                     "transformers' level (except info).",
                                                rich_help_panel=SERVER)] = LogLevel.info,
    continuous_batching: compat.ContinuousBatchingOpt = None,
    cb_block_size: Annotated[int | None, typer.Option(
        min=1, callback=_power_of_two, show_default=False, help="Same as --block-size.",
        rich_help_panel=compat.COMPAT)] = None,
    cb_num_blocks: Annotated[int | None, typer.Option(
        min=1, show_default=False, help="Same as --num-blocks.", rich_help_panel=compat.COMPAT)] = None,
    cb_max_batch_tokens: Annotated[int | None, typer.Option(
        min=1, show_default=False, help="Same as --max-batch-tokens.", rich_help_panel=compat.COMPAT)] = None,
    cb_max_memory_percent: Annotated[float | None, typer.Option(
        callback=_fraction, show_default=False, rich_help_panel=compat.COMPAT,
        help="Same as --kv-cache-memory FRACTION: the KV cache as a fraction of free memory.")] = None,
    cb_use_cuda_graph: compat.CbUseCudaGraphOpt = None,
    decision_config: compat.DecisionConfigOpt = None,
    input_validation: compat.InputValidationOpt = False,
    non_blocking: compat.NonBlockingOpt = False,
    load_in_4bit: compat.LoadIn4bitOpt = False,
    load_in_8bit: compat.LoadIn8bitOpt = False,
    bnb_4bit_quant_type: compat.Bnb4bitQuantTypeOpt = None,
    use_bnb_nested_quant: compat.UseBnbNestedQuantOpt = False,
    torch_dtype: compat.TorchDtypeOpt = None,
    format_: compat.FormatOpt = None,
    json_output: compat.JsonOpt = False,
    quiet: compat.QuietOpt = False,
    no_truncate: compat.NoTruncateOpt = False,
) -> None:
    """Serve a model over the OpenAI API: chat completions, responses, completions, models, health, metrics.

    Any OpenAI client works against it: point its base URL at http://HOST:PORT/v1.
    A request naming another model of the store loads it on demand, evicting the idle one.
    SIGINT/SIGTERM stop accepting requests, let in-flight ones finish (up to --drain-timeout; a second
    Ctrl+C aborts them now) and exit 0.
    `transformers serve` command lines work unchanged, underscore spellings (--max_num_seqs) included;
    docs/transformers-serve.md says what each of its flags maps to.

    [bold]Examples[/bold]

      tfserve serve                                        # the default model on 127.0.0.1:8000
      tfserve serve -m ./my-hf-model --port 9000 --api-key secret
      tfserve serve --max-num-seqs 128 --kv-cache-memory 4GiB --cors-allow-origins '*'
      tfserve serve Qwen/Qwen3-1.7B --reasoning off        # pinned, as transformers serve
      tfserve serve --mcp-config mcp.json                  # MCP tools for /v1/responses
      tfserve serve HuggingFaceTB/SmolVLM-256M-Instruct --allowed-media-domains upload.wikimedia.org
      OTEL_EXPORTER_OTLP_ENDPOINT=http://localhost:4318 tfserve serve --otel
      curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hello!"}]}'
    """
    import asyncio

    with _collector_off(then_freeze=True):  # torch, transformers, aiohttp, the server's modules
        from tfserve.models.loading import resolve_model
        from tfserve.server.app import create_app
        from tfserve.server.run import serve as run_server
        from tfserve.server.speech import SpeechOptions
        from tfserve.server.state import ServerState
        from tfserve.server.telemetry import from_options

    force_model = _pinned_model(ctx, model_arg, force_model, model)
    output_format = compat.output_format(format_, json_output, quiet)
    if output_format == compat.OutputFormat.quiet and not _given(ctx, "log_level"):
        # quiet is fewer lines; a --log-level given says how many
        log_level = LogLevel.warning
    for line in compat.notes({
        "output_format": output_format, "json_output": json_output, "no_truncate": no_truncate,
        "continuous_batching": continuous_batching,
        "decision_config": decision_config, "input_validation": input_validation, "non_blocking": non_blocking,
        "bnb_4bit_quant_type": bnb_4bit_quant_type, "use_bnb_nested_quant": use_bnb_nested_quant,
        "model_timeout": model_timeout, "force_model": force_model}):
        _note(line)
    quantization = compat.legacy_quantization(quantization.value, load_in_4bit, load_in_8bit)
    dtype = _dtype(ctx, dtype, torch_dtype)
    device = f"cuda:{device}" if device.isdigit() else device  # transformers takes a bare GPU index
    spec = force_model or model
    alone, embedding_spec = serve_embeddings.plan(spec, embedding_model)  # alone: --model is an encoder
    if spec != DEFAULT_MODEL and not alone:
        try:
            resolve_model(spec)  # a wrong name fails now, before the port is bound
        except ModelNotFoundError as exc:  # `--enable_cors maybe`: a flag's value, taken for MODEL
            raise compat.flag_value_error(ctx, model_arg) or exc from None
        refuse_speech_model(spec, "serve a chat model; /v1/audio/transcriptions loads it on demand (or give it "
                                  "as --speech-model)")
    engine_kwargs = {
        "max_batch_tokens": _same(ctx, "max_batch_tokens", max_batch_tokens, cb_max_batch_tokens),
        "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
        "long_prefill_token_threshold": long_prefill_token_threshold,
        "block_size": _same(ctx, "block_size", block_size, cb_block_size),
        "num_blocks": _same(ctx, "num_blocks", num_blocks, cb_num_blocks),
        "kv_cache_memory": _kv_cache_memory(kv_cache_memory, cb_max_memory_percent),
        "enable_prefix_caching": not no_prefix_caching, "generation_config": generation_config.value,
        "chat_template": chat_template,
        "speculative": speculative, "speculative_model": speculative_model, "num_speculative_tokens": num_speculative_tokens,
        "tensor_parallel_size": tensor_parallel_size, "distributed_init_method": _init_method(distributed_init_method),
        "distributed_timeout_s": distributed_timeout, "nnodes": nnodes, "compile": compile_model,
        "cuda_graph": _cuda_graph(cuda_graph, cb_use_cuda_graph)}
    engine_config = engine_config_from_flags(engine_kwargs)
    autoscale = _autoscale_policy(min_replicas, max_replicas, target_requests_per_replica, data_parallel_size)
    if autoscale is not None:
        data_parallel_size = max(data_parallel_size, autoscale.min_replicas)
    if ray is not None and data_parallel_size == 1 and autoscale is None:
        raise UsageError("--ray places engine replicas: give --data-parallel-size 2 or more")
    if ((data_parallel_size > 1 or autoscale is not None) and tensor_parallel_size > 1
            and (nnodes > 1 or distributed_init_method or torchrun_rank() is not None)):
        raise UsageError("replicas (--data-parallel-size, --max-replicas) split with --tensor-parallel-size run "
                         "each replica's ranks on its own machine: leave out --nnodes, --distributed-init-method "
                         "and torchrun")
    if node_rank >= nnodes:
        raise UsageError(f"--node-rank must be below --nnodes {nnodes} (got {node_rank})")
    _configure_logging(log_level.value)
    if tensor_parallel_size > 1 and (node_rank > 0 or (torchrun_rank() or 0) > 0):  # ranks only, no server
        from tfserve.distributed.workers import run_node
        from tfserve.engine.engine import worker_spec

        spec = worker_spec(force_model or model, engine_config, dtype=dtype, device=device, quantization=quantization,
                           attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
        raise typer.Exit(run_node(spec, node_rank))
    _check_attention(attn_implementation, device, dtype)
    check_speech_model(speech_model)  # the serving node's: ranks-only nodes never load it
    _clear_stale_pulls()
    load_options = {"dtype": dtype, "device": device, "quantization": quantization,
                    "attn_implementation": attn_implementation, "trust_remote_code": trust_remote_code}

    def load_on_demand(other: str) -> tuple:
        return load_engine(other, load_options, engine_config, show_progress=False)

    state = ServerState(max_queued=max_queued, force_model=force_model is not None,
                        load=None if pin_model else load_on_demand,
                        limits=serve_limits.request_limits(max_messages, max_seqs_per_request, model_swap_interval,
                                                           max_store_mib, max_stored_item_mib),
                        model_timeout_s=model_timeout if model_timeout > 0 else None,
                        chat_template_kwargs=compat.chat_template_kwargs(chat_template_kwargs, reasoning),
                        mcp=_mcp_options(mcp_config, mcp_allow_url, mcp_timeout),
                        media=_media_options(allowed_media_domains, allowed_local_media_path, limit_mm_per_prompt,
                                             max_image_size, max_image_pixels, media_fetch_timeout,
                                             max_request_pixels),
                        speech=SpeechOptions(default_model=speech_model, max_audio_s=max_audio_seconds,
                                             max_num_windows=max_audio_windows, device=device))
    state.telemetry = from_options(state, otel)
    state.embeddings.alone = alone
    origins = [*(cors_allow_origins or ()), *(["*"] if enable_cors else [])]
    limits = ConnectionLimits(header_timeout, max_connections, max_connections_per_client).within_open_files()
    app = create_app(state, api_key=api_key or None, cors_allow_origins=origins,
                     max_body_size=_body_size(max_body_size), connection_limits=limits, admin_key=admin_key or None)
    url = f"http://{host}:{port}"

    @_collector_off()
    def load():
        from tfserve.engine.runner import KVCacheTooLargeError

        if embedding_spec is not None:
            state.embeddings.load(embedding_spec, device)
        if alone:
            return None
        try:
            loaded = load_engine(spec, load_options, engine_config, data_parallel_size=data_parallel_size,
                                 ray_address=ray, scalable=autoscale is not None)
        except KVCacheTooLargeError as exc:  # refused before the allocation the kernel would kill us for
            raise TfserveError(_kv_cache_too_large(exc, kv_cache_memory, engine_config.num_blocks)) from None
        except ValueError as exc:  # e.g. a KV cache too small for one block
            raise TfserveError(f"cannot serve {spec}: {exc}") from None
        if default_seed is not None:  # after loading, so the first request draws the seed's first numbers
            import torch

            torch.manual_seed(default_seed)
        return loaded

    def on_ready():
        if alone:
            return serve_embeddings.print_banner(state, url, api_key is not None)
        print_banner(state, url, api_key is not None)

    if ray is not None:
        try:
            from tfserve.distributed.ray_replicas import connect
        except ImportError:
            raise TfserveError("--ray needs Ray: pip install ray") from None
        # on this, the main thread: a local cluster's processes end with the thread that starts them
        try:
            connect(ray)
        except (ValueError, ConnectionError, RuntimeError) as exc:  # a bad address, no cluster there
            raise TfserveError(f"--ray {ray}: cannot join a Ray cluster there: {exc}") from None
    served = None
    try:
        served = asyncio.run(run_server(app, host, port, drain_timeout=drain_timeout, load=load,
                                        on_ready=on_ready, autoscale=autoscale))
    except OSError as exc:
        raise TfserveError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    except KeyboardInterrupt:
        pass
    if state.failure is not None:
        raise TfserveError(state.failure)
    if served is False:  # stopped (Ctrl-C, a signal) while the model loaded: not a success, and said so
        from tfserve.cli.output import err_console

        err_console.print("Stopped before the model was loaded: nothing was served", highlight=False)
        raise typer.Exit(130)


@contextmanager
def _collector_off(then_freeze: bool = False):
    """Python's cyclic collector off inside. A start makes about a million objects (imports, the model's load)
    and next to no garbage: the collections they triggered, the full ones each over every object made so far,
    cost 0.45 s of a 2-core machine's 5 s start. Then, `then_freeze` (imports: what they make lives as long as
    the process): what was made is moved where no collection looks again; else one collection frees the garbage
    made meanwhile (over the unfrozen objects only)."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze() if then_freeze else gc.collect()
        gc.enable()


def _clear_stale_pulls() -> None:
    """The temp dirs of pulls killed outright (tens of MB each) go at start; a running pull's stay."""
    from tfserve.models import store
    from tfserve.models.pull import remove_stale_work_dirs

    try:
        root = store.models_dir()
        removed = remove_stale_work_dirs(root) if root.is_dir() else []
    except (OSError, TfserveError):  # the store's trouble is said by whatever reads it
        return
    if removed:
        logging.getLogger("tfserve.server").info("removed %d temp folder(s) of killed pulls from %s", len(removed),
                                                 root)


def _autoscale_policy(min_replicas: int | None, max_replicas: int | None, target: int, data_parallel_size: int):
    """The AutoscalePolicy of --min-replicas/--max-replicas, or None when neither is given."""
    if min_replicas is None and max_replicas is None:
        return None
    if max_replicas is None:
        raise UsageError("--min-replicas scales with the load up to --max-replicas: give --max-replicas too")
    from tfserve.distributed.autoscale import AutoscalePolicy

    if data_parallel_size > max_replicas:
        raise UsageError(f"--data-parallel-size ({data_parallel_size}) must not be above --max-replicas "
                         f"({max_replicas})")
    try:
        return AutoscalePolicy(min_replicas or 1, max_replicas, target)
    except ValueError as exc:  # said in the flags' words
        raise UsageError(str(exc).replace("min_replicas", "--min-replicas").replace("max_replicas", "--max-replicas")
                         ) from None


def _init_method(given: str | None) -> str | None:
    """The rendezvous: as given, else torchrun's environment when it started this process, else None (local)."""
    return given or ("env://" if torchrun_rank() is not None else None)


def attention_label(runner) -> str:
    """How the engine attends over its paged KV cache: flash-attn, the CPU kernels' paged kernel (where its vector
    path takes the cache: float32 caches), or SDPA over the blocks."""
    if runner.flash_attention:
        return "flash-attn over the paged KV cache"
    cache = runner.kv_caches[0][0] if getattr(runner, "kv_caches", None) else None
    if runner.cpu_ops is not None and cache is not None and str(cache.dtype) == "torch.float32":
        return f"paged, CPU kernel ({runner.cpu_ops.isa})"
    return "paged (SDPA over the KV blocks)"


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
    dtype = str(engine.dtype).removeprefix("torch.")
    if engine.quantization != "none":
        table.add_row("Weights", f"{engine.quantization} (compute {dtype})")
    else:
        table.add_row("Dtype", dtype)
    table.add_row("Device", str(engine.device))
    formats_by_unit: dict[str, list[str]] = {}
    for fmt, unit in getattr(engine, "matmul_units", {}).items():
        formats_by_unit.setdefault(unit, []).append(fmt)
    for i, (unit, formats) in enumerate(formats_by_unit.items()):
        table.add_row("" if i else "Matrix units", f"{'/'.join(sorted(formats))}: {unit}")
    load_seconds = getattr(engine, "load_seconds", None)
    if load_seconds is not None:  # from the start of the load (the file read, the kernels) to a ready engine
        table.add_row("Loaded in", f"{load_seconds:.1f} s")
    table.add_row("Attention", attention_label(engine.runner))
    table.add_row("KV cache", f"{engine.block_pool.num_blocks} blocks x {engine.block_pool.block_size} tokens, "
                              f"{decimal(engine.runner.kv_cache_bytes)}")
    table.add_row("Context", context_label(engine))
    graphs = engine.runner.graphs
    if graphs is not None:
        table.add_row("Decode", f"CUDA graphs, captured per batch bucket up to {graphs.max_batch} sequences")
    config, draft = engine.config, engine.runner.draft
    if config.speculative == "ngram":
        table.add_row("Speculative", f"n-gram lookup, up to {config.num_speculative_tokens} tokens a step")
    elif draft is not None:
        formats = "/".join(sorted(getattr(draft.runner.forward, "weight_formats", None) or {"float32": 1}))
        table.add_row("Speculative", f"draft {config.speculative_model or 'model'} ({formats}), up to "
                                     f"{config.num_speculative_tokens} tokens a step, KV {decimal(draft.kv_cache_bytes)}")
    states = getattr(state.async_engine, "states", None)
    if callable(states):  # engine replicas (-dp): the KV cache above is each one's
        where = "Ray actors" if getattr(state.async_engine, "ray_address", None) else "processes"
        table.add_row("Replicas", f"{len(states())} (replica 0 here, the others {where}; each its own KV cache)")
    for row in serve_embeddings.banner_rows(state):  # --embedding-model's, beside the chat model
        table.add_row(*row)
    table.add_row("URL", f"{url}/v1" + ("  (API key required)" if has_api_key else ""))
    console.print(Panel(table, title="tfserve serve", expand=False))
    console.print(f"Health: {url}/health   Metrics: {url}/metrics   Ctrl+C drains and stops.")


def context_label(engine) -> str:
    """The longest sequence a request may have: the model's context, or all the KV cache holds where that is
    less (a request longer than that is refused, so the banner says the smaller)."""
    cache_tokens = engine.block_pool.num_blocks * engine.block_pool.block_size
    if cache_tokens >= engine.max_model_len:
        return f"{engine.max_model_len} tokens"
    return f"{cache_tokens} tokens: all the KV cache holds (the model's context is {engine.max_model_len})"


def _kv_cache_too_large(exc, kv_cache_memory: str | None, num_blocks: int | None) -> str:
    """The KV cache asked for does not fit in the free memory: one line naming the flag, the size and what is
    free."""
    from rich.filesize import decimal

    given = f"--kv-cache-memory {kv_cache_memory}" if exc.field == "kv_cache_memory" else f"--num-blocks {num_blocks}"
    return (f"{given} asks for a KV cache of {decimal(exc.num_bytes)}, but {decimal(exc.available)} of memory is "
            f"free on {exc.device}: ask for less, or for a fraction of what is free (--kv-cache-memory 0.5)")


def _mcp_options(config: str | None, allow_url: list[str] | None, timeout_s: float):
    """--mcp-config (read now: a bad file is one line before anything loads), --mcp-allow-url, --mcp-timeout."""
    from tfserve.mcp.config import load_mcp_config
    from tfserve.server.mcp_tools import McpOptions

    try:
        configs = load_mcp_config(config) if config is not None else {}
    except ValueError as exc:
        raise TfserveError(f"--mcp-config: {exc}") from None
    return McpOptions(configs=configs, allow_url_patterns=tuple(allow_url or ()), timeout_s=timeout_s)


def _media_options(domains: list[str] | None, local_path: str | None, limit: str | None, max_size: str,
                   max_pixels: int, timeout_s: float, max_request_pixels: int):
    """The Media flags, checked now (a missing directory is one line before anything loads)."""
    from pathlib import Path

    from tfserve.server.media import DEFAULT_MAX_IMAGES, MediaOptions

    num_bytes = int(parse_size(max_size, "--max-image-size"))
    try:
        return MediaOptions(allowed_domains=tuple(domains or ()),
                            allowed_local_path=Path(local_path) if local_path else None,
                            max_images=_image_limit(limit) if limit is not None else DEFAULT_MAX_IMAGES,
                            max_image_bytes=num_bytes, max_image_pixels=max_pixels, fetch_timeout_s=timeout_s,
                            max_request_pixels=max_request_pixels)
    except ValueError as exc:  # "allowed_local_path must be a directory (got ...)": said with the flag's name
        message = str(exc)
        for name, flag in _MEDIA_FLAGS.items():
            message = message.replace(name, flag)
        raise UsageError(message) from None


_MEDIA_FLAGS = {"allowed_local_path": "--allowed-local-media-path", "max_images": "--limit-mm-per-prompt",
                "max_image_bytes": "--max-image-size", "max_image_pixels": "--max-image-pixels",
                "fetch_timeout_s": "--media-fetch-timeout", "max_request_pixels": "--max-request-pixels"}


def _image_limit(text: str) -> int:
    """--limit-mm-per-prompt: `4`, or vLLM's `{"image": 4}` (this server takes no other modality)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if isinstance(value, dict) and set(value) == {"image"}:
        value = value["image"]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise typer.BadParameter(f"{text!r} is not a count of images >= 1 (e.g. 4 or '{{\"image\": 4}}')",
                                 param_hint="--limit-mm-per-prompt")
    return value


def _note(message: str) -> None:
    from tfserve.cli.output import err_console

    err_console.print(f"[cyan]Note:[/] {message}", highlight=False, soft_wrap=True)


def _pinned_model(ctx: typer.Context, model_arg: str | None, force_model: str | None, model: str) -> str | None:
    """The positional MODEL is transformers serve's pinned model: the same as --force-model. A --model given
    beside it that names another model would be ignored without a word, so it is refused as --force-model's is."""
    if model_arg is not None and force_model is not None and model_arg != force_model:
        raise UsageError(f"MODEL {model_arg!r} and --force-model {force_model!r} disagree: give one")
    if model_arg is not None and model != model_arg and _given(ctx, "model"):
        raise UsageError(f"MODEL {model_arg!r} and --model {model!r} disagree: give one")
    return model_arg or force_model


def _given(ctx: typer.Context, param: str) -> bool:
    """Whether `param` was set (on the command line or from the environment), not left at its default."""
    return ctx.get_parameter_source(param).name not in ("DEFAULT", "DEFAULT_MAP")


def _same(ctx: typer.Context, param: str, ours, theirs, their_flag: str | None = None):
    """An option and transformers' spelling of it (its --cb-* one, or `their_flag`): either one, or both when
    they agree."""
    if theirs is None or ours == theirs:
        return ours
    if _given(ctx, param):
        name = "--" + param.replace("_", "-")
        raise UsageError(f"{name} {ours} and {their_flag or '--cb-' + name[2:]} {theirs} disagree: give one")
    return theirs


def _cuda_graph(ours: bool | None, theirs: bool | None) -> bool | None:
    """--cuda-graph, or transformers' --cb-use-cuda-graph: either one, or both when they agree."""
    if ours is not None and theirs is not None and ours != theirs:
        raise UsageError(f"--{'' if ours else 'no-'}cuda-graph and --{'' if theirs else 'no-'}cb-use-cuda-graph "
                         "disagree: give one")
    return theirs if ours is None else ours


def _dtype(ctx: typer.Context, dtype: Dtype, torch_dtype: str | None) -> str:
    """--dtype, or transformers 4.x's --torch-dtype: either one, or both when they agree."""
    if torch_dtype is None:
        return dtype.value
    try:
        theirs = Dtype(torch_dtype.lower()).value
    except ValueError:
        raise typer.BadParameter(f"{torch_dtype!r} is not one of {', '.join(d.value for d in Dtype)}",
                                 param_hint="--torch-dtype") from None
    return _same(ctx, "dtype", dtype.value, theirs, "--torch-dtype")


def _kv_cache_memory(text: str | None, fraction: float | None) -> float | int | None:
    """--kv-cache-memory (bytes, or a fraction of free memory) or --cb-max-memory-percent (a fraction)."""
    if text is not None and fraction is not None:
        raise UsageError("--kv-cache-memory and --cb-max-memory-percent both size the KV cache: give one")
    if text is None:
        return fraction
    value = parse_size(text, "--kv-cache-memory")
    if value > 1 and value != int(value):
        raise typer.BadParameter(f"{text!r} is neither a fraction in (0, 1] nor a whole number of bytes "
                                 "(e.g. 0.5, 2GiB)", param_hint="--kv-cache-memory")
    return int(value) if value > 1 else value


def _body_size(text: str) -> int:
    num_bytes = int(parse_size(text, "--max-body-size"))
    if num_bytes < 1:
        raise typer.BadParameter(f"{text!r} is not a size of at least one byte (e.g. 16MiB)",
                                 param_hint="--max-body-size")
    return num_bytes


def _check_attention(attn_implementation: str | None, device: str, dtype: str) -> None:
    """flash_attention_2 (options.attn_implementation has checked that flash-attn imports) needs CUDA and a
    16-bit dtype; one line saying what works instead, before anything loads."""
    if attn_implementation != "flash_attention_2":
        return
    from tfserve.models.loading import resolve_device

    if not resolve_device(device).startswith("cuda"):
        raise TfserveError("--attn-implementation flash_attention_2 needs a CUDA GPU (this server would run on "
                           "cpu); leave it unset for tfserve's paged attention, which runs everywhere")
    if dtype == Dtype.float32.value:
        raise UsageError("--attn-implementation flash_attention_2 runs in float16 or bfloat16: pass "
                         "--dtype bfloat16 (or leave --dtype auto)")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record is emitted, not the stream at setup: a test runner
    (or anything) that swaps stderr and closes the old one never gets "I/O on closed file"."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler sets it at init; the property decides
        pass


def _configure_logging(level: str) -> None:
    numeric = logging.DEBUG if level == "detail" else logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise typer.BadParameter(f"unknown log level {level!r}", param_hint="--log-level")
    if numeric != logging.INFO:  # as transformers serve; at info (our default) transformers' chatter stays off
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(numeric)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger("tfserve")
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    root.propagate = False
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
