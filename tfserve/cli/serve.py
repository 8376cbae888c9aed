"""`tfserve serve`: load a model and serve the OpenAI API over the continuous-batching engine.

The flags are declared in serve_options.py (Limits: serve_limits.py; transformers serve's: serve_compat.py) and
checked by serve_flags.py; the ready banner is serve_banner.py. torch, transformers and the server are imported
inside the command, so `tfserve --help` stays instant.
"""

from __future__ import annotations

import gc
import logging
from contextlib import contextmanager

import typer

from tfserve.cli import serve_compat as compat
from tfserve.cli import serve_embeddings, serve_flags as flags, serve_limits, serve_options as opts
from tfserve.cli.loading import check_speech_model, engine_config_from_flags, load_engine, refuse_speech_model
from tfserve.cli.options import (DEFAULT_MODEL, AttnImplementationOpt, DeviceOpt, Dtype, DtypeOpt, ModelOpt,
                                 Quantization, QuantizationOpt, TensorParallelOpt, TrustRemoteCodeOpt, CompileOpt,
                                 CudaGraphOpt)
from tfserve.cli.serve_banner import print_banner
from tfserve.cli.serve_embeddings import EmbeddingModelOpt
from tfserve.cli.serve_limits import (MaxMessagesOpt, MaxRequestPixelsOpt, MaxSeqsPerRequestOpt, MaxStoredItemMibOpt,
                                      MaxStoreMibOpt, ModelSwapIntervalOpt, PinModelOpt)
from tfserve.cli.serve_compat import Reasoning
from tfserve.cli.serve_logging import configure_logging
from tfserve.engine.parallel.workers import torchrun_rank
from tfserve.errors import ModelNotFoundError, TfserveError, UsageError
from tfserve.server.runtime.connection_limits import (DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS,
                                                      DEFAULT_MAX_CONNECTIONS_PER_CLIENT, ConnectionLimits)


def serve(
    ctx: typer.Context,
    model_arg: opts.ModelArg = None,
    model: ModelOpt = DEFAULT_MODEL,
    host: opts.HostOpt = "127.0.0.1",
    port: opts.PortOpt = 8000,
    dtype: DtypeOpt = Dtype.auto,
    device: DeviceOpt = "auto",
    quantization: QuantizationOpt = Quantization.none,
    attn_implementation: AttnImplementationOpt = None,
    trust_remote_code: TrustRemoteCodeOpt = False,
    generation_config: opts.GenerationConfigOpt = opts.GenerationConfig.auto,
    max_batch_tokens: opts.MaxBatchTokensOpt = 512,
    max_num_seqs: opts.MaxNumSeqsOpt = 64,
    max_model_len: opts.MaxModelLenOpt = None,
    long_prefill_token_threshold: opts.LongPrefillTokenThresholdOpt = None,
    kv_cache_memory: opts.KvCacheMemoryOpt = None,
    num_blocks: opts.NumBlocksOpt = None,
    block_size: opts.BlockSizeOpt = 16,
    speculative: opts.SpeculativeOpt = None,
    speculative_model: opts.SpeculativeModelOpt = None,
    num_speculative_tokens: opts.NumSpeculativeTokensOpt = 4,
    compile_model: CompileOpt = False,
    cuda_graph: CudaGraphOpt = None,
    tensor_parallel_size: TensorParallelOpt = 1,
    distributed_init_method: opts.DistributedInitMethodOpt = None,
    data_parallel_size: opts.DataParallelSizeOpt = 1,
    min_replicas: opts.MinReplicasOpt = None,
    max_replicas: opts.MaxReplicasOpt = None,
    target_requests_per_replica: opts.TargetRequestsPerReplicaOpt = 16,
    ray: opts.RayOpt = None,
    nnodes: opts.NnodesOpt = 1,
    node_rank: opts.NodeRankOpt = 0,
    distributed_timeout: opts.DistributedTimeoutOpt = 60.0,
    no_prefix_caching: opts.NoPrefixCachingOpt = False,
    max_body_size: opts.MaxBodySizeOpt = "16MiB",
    max_queued: opts.MaxQueuedOpt = 1024,
    api_key: opts.ApiKeyOpt = None,
    admin_key: opts.AdminKeyOpt = None,
    header_timeout: opts.HeaderTimeoutOpt = DEFAULT_HEADER_TIMEOUT_S,
    max_connections: opts.MaxConnectionsOpt = DEFAULT_MAX_CONNECTIONS,
    max_connections_per_client: opts.MaxConnectionsPerClientOpt = DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
    cors_allow_origins: opts.CorsAllowOriginsOpt = None,
    enable_cors: opts.EnableCorsOpt = False,
    drain_timeout: opts.DrainTimeoutOpt = 30.0,
    force_model: opts.ForceModelOpt = None,
    model_timeout: opts.ModelTimeoutOpt = -1,
    default_seed: opts.DefaultSeedOpt = None,
    reasoning: opts.ReasoningOpt = Reasoning.auto,
    chat_template: opts.ChatTemplateOpt = None,
    chat_template_kwargs: opts.ChatTemplateKwargsOpt = None,
    otel: opts.OtelOpt = False,
    mcp_config: opts.McpConfigOpt = None,
    mcp_allow_url: opts.McpAllowUrlOpt = None,
    mcp_timeout: opts.McpTimeoutOpt = 60.0,
    allowed_media_domains: opts.AllowedMediaDomainsOpt = None,
    allowed_local_media_path: opts.AllowedLocalMediaPathOpt = None,
    limit_mm_per_prompt: opts.LimitMmPerPromptOpt = None,
    max_image_size: opts.MaxImageSizeOpt = "20MiB",
    max_image_pixels: opts.MaxImagePixelsOpt = 32_000_000,
    media_fetch_timeout: opts.MediaFetchTimeoutOpt = 10.0,
    speech_model: opts.SpeechModelOpt = "whisper-tiny.en",
    max_audio_seconds: opts.MaxAudioSecondsOpt = 3600.0,
    max_audio_windows: opts.MaxAudioWindowsOpt = 8,
    embedding_model: EmbeddingModelOpt = None,
    max_messages: MaxMessagesOpt = serve_limits.DEFAULT_MAX_MESSAGES,
    max_seqs_per_request: MaxSeqsPerRequestOpt = serve_limits.DEFAULT_MAX_SEQS_PER_REQUEST,
    max_request_pixels: MaxRequestPixelsOpt = serve_limits.DEFAULT_MAX_REQUEST_PIXELS,
    model_swap_interval: ModelSwapIntervalOpt = serve_limits.DEFAULT_MODEL_SWAP_INTERVAL_S,
    pin_model: PinModelOpt = False,
    max_store_mib: MaxStoreMibOpt = serve_limits.DEFAULT_STORE_MIB,
    max_stored_item_mib: MaxStoredItemMibOpt = serve_limits.DEFAULT_STORED_ITEM_MIB,
    log_level: opts.LogLevelOpt = opts.LogLevel.info,
    continuous_batching: compat.ContinuousBatchingOpt = None,
    cb_block_size: opts.CbBlockSizeOpt = None,
    cb_num_blocks: opts.CbNumBlocksOpt = None,
    cb_max_batch_tokens: opts.CbMaxBatchTokensOpt = None,
    cb_max_memory_percent: opts.CbMaxMemoryPercentOpt = None,
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
        from tfserve.server.runtime.speech import SpeechOptions
        from tfserve.server.runtime.state import ServerState
        from tfserve.server.runtime.telemetry import from_options

    force_model = flags.pinned_model(ctx, model_arg, force_model, model)
    output_format = compat.output_format(format_, json_output, quiet)
    if output_format == compat.OutputFormat.quiet and not flags.given(ctx, "log_level"):
        # quiet is fewer lines; a --log-level given says how many
        log_level = opts.LogLevel.warning
    for line in compat.notes({
        "output_format": output_format, "json_output": json_output, "no_truncate": no_truncate,
        "continuous_batching": continuous_batching,
        "decision_config": decision_config, "input_validation": input_validation, "non_blocking": non_blocking,
        "bnb_4bit_quant_type": bnb_4bit_quant_type, "use_bnb_nested_quant": use_bnb_nested_quant,
        "model_timeout": model_timeout, "force_model": force_model}):
        _note(line)
    quantization = compat.legacy_quantization(quantization.value, load_in_4bit, load_in_8bit)
    dtype = flags.dtype(ctx, dtype, torch_dtype)
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
        "max_batch_tokens": flags.same(ctx, "max_batch_tokens", max_batch_tokens, cb_max_batch_tokens),
        "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
        "long_prefill_token_threshold": long_prefill_token_threshold,
        "block_size": flags.same(ctx, "block_size", block_size, cb_block_size),
        "num_blocks": flags.same(ctx, "num_blocks", num_blocks, cb_num_blocks),
        "kv_cache_memory": flags.kv_cache_memory(kv_cache_memory, cb_max_memory_percent),
        "enable_prefix_caching": not no_prefix_caching, "generation_config": generation_config.value,
        "chat_template": chat_template,
        "speculative": speculative, "speculative_model": speculative_model,
        "num_speculative_tokens": num_speculative_tokens, "tensor_parallel_size": tensor_parallel_size,
        "distributed_init_method": flags.init_method(distributed_init_method),
        "distributed_timeout_s": distributed_timeout, "nnodes": nnodes, "compile": compile_model,
        "cuda_graph": flags.cuda_graph(cuda_graph, cb_use_cuda_graph)}
    engine_config = engine_config_from_flags(engine_kwargs)
    autoscale = flags.autoscale_policy(min_replicas, max_replicas, target_requests_per_replica, data_parallel_size)
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
    configure_logging(log_level.value)
    if tensor_parallel_size > 1 and (node_rank > 0 or (torchrun_rank() or 0) > 0):  # ranks only, no server
        from tfserve.engine.parallel.workers import run_node
        from tfserve.engine.engine import worker_spec

        spec = worker_spec(force_model or model, engine_config, dtype=dtype, device=device, quantization=quantization,
                           attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
        raise typer.Exit(run_node(spec, node_rank))
    flags.check_attention(attn_implementation, device, dtype)
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
                        mcp=flags.mcp_options(mcp_config, mcp_allow_url, mcp_timeout),
                        media=flags.media_options(allowed_media_domains, allowed_local_media_path,
                                                  limit_mm_per_prompt, max_image_size, max_image_pixels,
                                                  media_fetch_timeout, max_request_pixels),
                        speech=SpeechOptions(default_model=speech_model, max_audio_s=max_audio_seconds,
                                             max_num_windows=max_audio_windows, device=device))
    state.telemetry = from_options(state, otel)
    state.embeddings.alone = alone
    origins = [*(cors_allow_origins or ()), *(["*"] if enable_cors else [])]
    limits = ConnectionLimits(header_timeout, max_connections, max_connections_per_client).within_open_files()
    app = create_app(state, api_key=api_key or None, cors_allow_origins=origins,
                     max_body_size=flags.body_size(max_body_size), connection_limits=limits,
                     admin_key=admin_key or None)
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
            raise TfserveError(flags.kv_cache_too_large(exc, kv_cache_memory, engine_config.num_blocks)) from None
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
            from tfserve.serving.ray_replicas import connect
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


def _note(message: str) -> None:
    from tfserve.cli.output import err_console

    err_console.print(f"[cyan]Note:[/] {message}", highlight=False, soft_wrap=True)
