"""`tfserve serve`'s flags read and checked before anything loads: sizes, the options objects the server takes,
and transformers serve's spellings of the same settings reconciled with ours. Each problem is one line naming the
flag."""

from __future__ import annotations

import re

import typer

from tfserve.cli.options import Dtype
from tfserve.engine.parallel.workers import torchrun_rank
from tfserve.errors import TfserveError, UsageError

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


def autoscale_policy(min_replicas: int | None, max_replicas: int | None, target: int, data_parallel_size: int):
    """The AutoscalePolicy of --min-replicas/--max-replicas, or None when neither is given."""
    if min_replicas is None and max_replicas is None:
        return None
    if max_replicas is None:
        raise UsageError("--min-replicas scales with the load up to --max-replicas: give --max-replicas too")
    from tfserve.serving.autoscale import AutoscalePolicy

    if data_parallel_size > max_replicas:
        raise UsageError(f"--data-parallel-size ({data_parallel_size}) must not be above --max-replicas "
                         f"({max_replicas})")
    try:
        return AutoscalePolicy(min_replicas or 1, max_replicas, target)
    except ValueError as exc:  # said in the flags' words
        raise UsageError(str(exc).replace("min_replicas", "--min-replicas").replace("max_replicas", "--max-replicas")
                         ) from None


def init_method(given: str | None) -> str | None:
    """The rendezvous: as given, else torchrun's environment when it started this process, else None (local)."""
    return given or ("env://" if torchrun_rank() is not None else None)


def kv_cache_too_large(exc, kv_cache_memory: str | None, num_blocks: int | None) -> str:
    """The KV cache asked for does not fit in the free memory: one line naming the flag, the size and what is
    free."""
    from rich.filesize import decimal

    given = f"--kv-cache-memory {kv_cache_memory}" if exc.field == "kv_cache_memory" else f"--num-blocks {num_blocks}"
    return (f"{given} asks for a KV cache of {decimal(exc.num_bytes)}, but {decimal(exc.available)} of memory is "
            f"free on {exc.device}: ask for less, or for a fraction of what is free (--kv-cache-memory 0.5)")


def mcp_options(config: str | None, allow_url: list[str] | None, timeout_s: float):
    """--mcp-config (read now: a bad file is one line before anything loads), --mcp-allow-url, --mcp-timeout."""
    from tfserve.mcp.config import load_mcp_config
    from tfserve.server.tools.mcp_tools import McpOptions

    try:
        configs = load_mcp_config(config) if config is not None else {}
    except ValueError as exc:
        raise TfserveError(f"--mcp-config: {exc}") from None
    return McpOptions(configs=configs, allow_url_patterns=tuple(allow_url or ()), timeout_s=timeout_s)


def media_options(domains: list[str] | None, local_path: str | None, limit: str | None, max_size: str,
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


def pinned_model(ctx: typer.Context, model_arg: str | None, force_model: str | None, model: str) -> str | None:
    """The positional MODEL is transformers serve's pinned model: the same as --force-model. A --model given
    beside it that names another model would be ignored without a word, so it is refused as --force-model's is."""
    if model_arg is not None and force_model is not None and model_arg != force_model:
        raise UsageError(f"MODEL {model_arg!r} and --force-model {force_model!r} disagree: give one")
    if model_arg is not None and model != model_arg and given(ctx, "model"):
        raise UsageError(f"MODEL {model_arg!r} and --model {model!r} disagree: give one")
    return model_arg or force_model


def given(ctx: typer.Context, param: str) -> bool:
    """Whether `param` was set (on the command line or from the environment), not left at its default."""
    return ctx.get_parameter_source(param).name not in ("DEFAULT", "DEFAULT_MAP")


def same(ctx: typer.Context, param: str, ours, theirs, their_flag: str | None = None):
    """An option and transformers' spelling of it (its --cb-* one, or `their_flag`): either one, or both when
    they agree."""
    if theirs is None or ours == theirs:
        return ours
    if given(ctx, param):
        name = "--" + param.replace("_", "-")
        raise UsageError(f"{name} {ours} and {their_flag or '--cb-' + name[2:]} {theirs} disagree: give one")
    return theirs


def cuda_graph(ours: bool | None, theirs: bool | None) -> bool | None:
    """--cuda-graph, or transformers' --cb-use-cuda-graph: either one, or both when they agree."""
    if ours is not None and theirs is not None and ours != theirs:
        raise UsageError(f"--{'' if ours else 'no-'}cuda-graph and --{'' if theirs else 'no-'}cb-use-cuda-graph "
                         "disagree: give one")
    return theirs if ours is None else ours


def dtype(ctx: typer.Context, dtype: Dtype, torch_dtype: str | None) -> str:
    """--dtype, or transformers 4.x's --torch-dtype: either one, or both when they agree."""
    if torch_dtype is None:
        return dtype.value
    try:
        theirs = Dtype(torch_dtype.lower()).value
    except ValueError:
        raise typer.BadParameter(f"{torch_dtype!r} is not one of {', '.join(d.value for d in Dtype)}",
                                 param_hint="--torch-dtype") from None
    return same(ctx, "dtype", dtype.value, theirs, "--torch-dtype")


def kv_cache_memory(text: str | None, fraction: float | None) -> float | int | None:
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


def body_size(text: str) -> int:
    """--max-body-size in bytes, at least one."""
    num_bytes = int(parse_size(text, "--max-body-size"))
    if num_bytes < 1:
        raise typer.BadParameter(f"{text!r} is not a size of at least one byte (e.g. 16MiB)",
                                 param_hint="--max-body-size")
    return num_bytes


def check_attention(attn_implementation: str | None, device: str, dtype: str) -> None:
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
