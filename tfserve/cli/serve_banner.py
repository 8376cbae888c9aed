"""The panel `tfserve serve` prints once the server is ready: the model, how its weights are held and multiplied,
attention, the KV cache and context, speculative decoding, replicas and the URL."""

from __future__ import annotations

from tfserve.cli import serve_embeddings


def attention_label(runner) -> str:
    """How the engine attends over its paged KV cache: flash-attn, the CPU kernels' paged kernel (where its vector
    path takes the cache: float32 or bfloat16 caches), or SDPA over the blocks."""
    if runner.flash_attention:
        return "flash-attn over the paged KV cache"
    cache = runner.kv_caches[0][0] if getattr(runner, "kv_caches", None) else None
    if runner.cpu_ops is not None and cache is not None and str(cache.dtype) in ("torch.float32", "torch.bfloat16"):
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
    units = getattr(engine, "matmul_units", {})
    if engine.quantization != "none":  # bfloat16 on its dot products: products of bfloat16 numbers, float32 sums
        bf16_dot = engine.quantization == "bfloat16" and "BF16" in units.get("bfloat16", "")
        compute = "bfloat16 products, float32 sums" if bf16_dot else f"compute {dtype}"
        table.add_row("Weights", f"{engine.quantization} ({compute})")
    else:
        table.add_row("Dtype", dtype)
    table.add_row("Device", str(engine.device))
    formats_by_unit: dict[str, list[str]] = {}
    for fmt, unit in units.items():
        formats_by_unit.setdefault(unit, []).append(fmt)
    for i, (unit, formats) in enumerate(formats_by_unit.items()):
        table.add_row("" if i else "Matrix units", f"{'/'.join(sorted(formats))}: {unit}")
    load_seconds = getattr(engine, "load_seconds", None)
    if load_seconds is not None:  # from the start of the load (the file read, the kernels) to a ready engine
        table.add_row("Loaded in", f"{load_seconds:.1f} s")
    table.add_row("Attention", attention_label(engine.runner))
    kv_dtype = str(getattr(engine.runner, "kv_dtype", engine.dtype)).removeprefix("torch.")
    table.add_row("KV cache", f"{engine.block_pool.num_blocks} blocks x {engine.block_pool.block_size} tokens, "
                              f"{decimal(engine.runner.kv_cache_bytes)} ({kv_dtype})")
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
