"""`Engine.from_pretrained`: a model found or pulled and loaded, the CPU kernels built beside it, a draft model
for speculation, the ranks of a tensor-parallel split started, and the engine (its KV cache) made over it.

The functions take the engine class (`cls`) rather than import it, so this module sits below `core.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from tfserve.config import EngineConfig
from tfserve.engine.cpu_linear import matmul_units
from tfserve.engine.kernel_paths import describe as describe_paths
from tfserve.engine.kernel_paths import unused_units
from tfserve.errors import DeviceError

logger = logging.getLogger(__name__)


def load_engine(cls, model: str | None = None, config: EngineConfig | None = None, *, dtype: str = "auto",
                device: str = "auto", quantization: str = "none", attn_implementation: str | None = None,
                trust_remote_code: bool = False, progress=None, **overrides: Any):
    """`cls.from_pretrained` on the caller's thread (the torch work of loading makes that thread's OpenMP pool:
    `tfserve.engine.threads`)."""
    from tfserve.engine import kernels
    from tfserve.engine.backends.lean import SUPPORTED
    from tfserve.models.gguf_weights import gguf_source, is_native
    from tfserve.models.loading import DEFAULT_MODEL, load_model, resolve_device
    from tfserve.models.pull import no_progress

    config = with_overrides(config, overrides)  # checked before a long load
    dtype, quantization = str(getattr(dtype, "value", dtype)), str(getattr(quantization, "value", quantization))
    config, load_kwargs = _load_plan(config, dtype, device, quantization, attn_implementation, trust_remote_code)
    report = progress or no_progress
    if config.tensor_parallel_size > 1:
        if resolve_device(device) != "cpu":
            raise DeviceError("tensor parallelism runs CPU ranks for now (CUDA ranks, on NCCL, are not built "
                              "yet); use --device cpu, or one GPU without --tensor-parallel-size")
        if config.cpu_kernels:  # built once, before the worker ranks load them
            kernels.build_with_progress(report)
        return _tensor_parallel(cls, _worker_spec(model or DEFAULT_MODEL, config, load_kwargs), progress)
    if config.cpu_kernels and resolve_device(device) == "cpu":
        kernels.start_building()  # a first run compiles while the model is pulled and loaded
    # a .gguf file the lean forward runs loads natively: no weight expanded, the kernels multiply its blocks
    native = frozenset(SUPPORTED) if (config.cpu_kernels and config.forward_backend != "hf"
                                      and config.weights in ("auto", "gguf")) else frozenset()
    start = time.perf_counter()
    loaded = load_model(model or DEFAULT_MODEL, progress=progress, gguf_native=native, **load_kwargs)
    if config.cpu_kernels and loaded.device == "cpu":
        kernels.build_with_progress(report)
    if is_native(loaded.model) and kernels.cpu_ops() is None:  # no compiler here: transformers expands it
        loaded = load_model(model or DEFAULT_MODEL, progress=progress, **load_kwargs)
    _use_chat_template(loaded, config)
    gguf_file = gguf_source(loaded.path) if loaded.device == "cpu" and dtype == "auto" else None
    if gguf_file is not None and config.weights in ("auto", "gguf") and not config.gguf_file:
        config = dataclasses.replace(config, gguf_file=str(gguf_file))
    draft, draft_gguf = None, None
    if config.speculative == "draft" and config.speculative_model is not None:  # (without: Engine says so)
        # as its own files say, whatever --dtype the served model has: a GGUF draft runs its blocks
        _, draft_kwargs = _load_plan(config, "auto", device, quantization, attn_implementation, trust_remote_code)
        draft = load_model(config.speculative_model, progress=progress, **draft_kwargs)
        _check_draft_tokenizer(loaded, draft)
        draft_gguf = gguf_source(draft.path) if draft.device == "cpu" and config.cpu_kernels else None
    report("Allocating the KV cache" + (" (and compiling, where the model's own forward runs)"
                                        if config.compile else ""))
    engine = cls(loaded.model, loaded.tokenizer, config, processor=loaded.processor,
                 draft_model=draft.model if draft else None,
                 draft_gguf_file=str(draft_gguf) if draft_gguf is not None else None)
    _describe(engine, loaded)
    formats = getattr(engine.runner.forward, "weight_formats", {})
    if set(formats) - {"float32"}:  # the CPU kernels hold the weights: say how (compute stays float32)
        engine.quantization = "/".join(sorted(formats))
    if config.weights == "auto" and not config.gguf_file and "bfloat16" in formats:  # backends.auto_weights' choice
        logger.info("weights auto: bfloat16, as the checkpoint stores them, through the CPU's bfloat16 dot products "
                    "(--dtype float32 keeps float32 arithmetic)")
    engine.matmul_units = matmul_units(formats, getattr(engine.runner.forward, "ops", None))
    for unit in dict.fromkeys(engine.matmul_units.values()):
        formats = "/".join(sorted(f for f, u in engine.matmul_units.items() if u == unit))
        logger.info("%s weights multiply through %s", formats, unit)
    ops = engine.runner.cpu_ops
    if ops is not None:  # the build's every path (/metrics has them too), at info where no line above named units
        notes = unused_units(ops, kernels.cpu_features())
        logger.log(logging.DEBUG if engine.matmul_units else logging.INFO, "%s",
                   describe_paths(engine.kernel_paths, notes))
        if engine.matmul_units and notes:  # why a better unit the CPU has is unused: always said
            logger.info("CPU units unused: %s", "; ".join(notes))
    engine.load_seconds = time.perf_counter() - start
    logger.info("%s ready in %.1f s (%s)", loaded.name, engine.load_seconds,
                "its GGUF blocks as stored" if is_native(loaded.model) else f"weights {engine.quantization}")
    return engine


def close_ranks(tp: Any, workers: Any) -> None:
    """Stop the worker ranks of a tensor-parallel split (`tp`: rank 0's; `workers`: the processes this one
    started, or None) and leave the process group."""
    import torch.distributed

    from tfserve.engine.parallel import tensor_parallel

    try:
        tensor_parallel.send_step(None, tp)
    except tensor_parallel.TensorParallelError:
        pass  # a worker already died: it has nothing to stop
    if workers is not None:
        workers.stop()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def with_overrides(config: EngineConfig | None, overrides: dict[str, Any]) -> EngineConfig:
    """`config` (default: EngineConfig()) with some fields replaced, validated again."""
    config = config or EngineConfig()
    return dataclasses.replace(config, **overrides) if overrides else config


def worker_spec(model: str | None, config: EngineConfig, *, dtype: str = "auto", device: str = "auto",
                quantization: str = "none", attn_implementation: str | None = None, trust_remote_code: bool = False):
    """What the worker ranks of `from_pretrained(model, config, ...)` load (tfserve.engine.parallel.workers): for a
    node past the first, which starts only worker ranks."""
    from tfserve.models.loading import DEFAULT_MODEL

    config, load_kwargs = _load_plan(config, dtype, device, quantization, attn_implementation, trust_remote_code)
    return _worker_spec(model or DEFAULT_MODEL, config, load_kwargs)


def _describe(engine, loaded) -> None:
    """Where the engine's model came from, for banners and /v1/models."""
    engine.model_name, engine.model_path = loaded.name, str(loaded.path)
    engine.device, engine.dtype, engine.quantization = loaded.device, loaded.dtype, loaded.quantization


def _cpu_weights(config: EngineConfig, dtype: str, quantization: str, device: str) -> tuple[str, str, str]:
    """What to load and how the lean forward holds its weights, for a user's dtype and quantization: on CPU with
    the kernels, float16/bfloat16 and int8 are weight formats of the engine over a float32 model (16-bit or
    8-bit storage, float32 arithmetic); elsewhere they go to transformers as they are (bitsandbytes for
    int8 on CUDA). Returns (load dtype, load quantization, weights)."""
    from tfserve.models.loading import resolve_device

    on_cpu_kernels = config.cpu_kernels and config.forward_backend != "hf" and resolve_device(device) == "cpu"
    if quantization == "int8":
        if on_cpu_kernels:
            return "float32", "none", "int8"
        return dtype, "bnb-8bit", config.weights
    if dtype in ("float32", "float16", "bfloat16") and quantization == "none" and on_cpu_kernels \
            and config.weights == "auto":  # (float32 asked for: kept, where auto may hold a bfloat16 checkpoint so)
        return "float32", "none", dtype
    return dtype, quantization, config.weights


def _check_draft_tokenizer(loaded, draft) -> None:
    """A draft model must speak the served model's tokens: its proposals are token ids."""
    from tfserve.errors import ModelLoadError

    if loaded.tokenizer is None or draft.tokenizer is None:
        return
    if loaded.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise ModelLoadError(f"the draft model {draft.name} has another tokenizer than {loaded.name}: its "
                             "proposals would be other tokens; pick a draft of the same family")


def _use_chat_template(loaded, config: EngineConfig) -> None:
    """The caller's chat template over the model's own (a base model has none)."""
    if config.chat_template is not None:
        loaded.tokenizer.chat_template = config.chat_template


def _load_plan(config: EngineConfig, dtype: str, device: str, quantization: str, attn_implementation: str | None,
               trust_remote_code: bool) -> tuple[EngineConfig, dict[str, Any]]:
    """`config` with the weight format the user's dtype and quantization mean, and `load_model`'s keywords."""
    load_dtype, load_quantization, weights = _cpu_weights(config, dtype, quantization, device)
    load_kwargs = {"dtype": load_dtype, "device": device, "quantization": load_quantization,
                   "attn_implementation": attn_implementation, "trust_remote_code": trust_remote_code}
    return (dataclasses.replace(config, weights=weights) if weights != config.weights else config), load_kwargs


def _worker_spec(model: str, config: EngineConfig, load_kwargs: dict[str, Any]):
    from tfserve.engine.parallel import workers

    init_method = config.distributed_init_method or workers.free_init_method()
    return workers.WorkerSpec(model, load_kwargs, config, config.tensor_parallel_size, init_method,
                              config.distributed_timeout_s)


def _tensor_parallel(cls, spec, progress):
    """An engine over `spec.model` split `spec.world_size` ways: this process is rank 0 and starts the ranks
    of its node (tfserve.engine.parallel)."""
    import torch

    from tfserve.engine.parallel import tensor_parallel, workers
    from tfserve.models.gguf_weights import gguf_source
    from tfserve.models.loading import load_model
    from tfserve.models.pull import no_progress

    world, init_method, config, model, load_kwargs = (spec.world_size, spec.init_method, spec.config, spec.model,
                                                      spec.load_kwargs)
    report = progress or no_progress
    local = workers.local_ranks(spec, node_rank=0)[1:]  # under torchrun: none, it started every rank
    if local:
        report(f"Starting {len(local)} tensor-parallel worker process(es)")
    started = workers.spawn_workers(spec, local)
    try:
        torch.set_num_threads(tensor_parallel.torch_threads(world, config.nnodes))
        tensor_parallel.init_process_group(0, world, init_method, config.distributed_timeout_s)
        loaded = load_model(model, progress=progress, **load_kwargs)
        _use_chat_template(loaded, config)
        if loaded.device == "cpu" and gguf_source(loaded.path) is not None:  # as one engine would have run it
            logger.warning("tensor parallelism splits %s's %s weights; the GGUF file's quantized blocks, which one "
                           "engine runs, are not split across ranks (about 4x the memory of Q4 blocks)",
                           loaded.name, loaded.dtype)
        tp = tensor_parallel.shard(loaded.model, 0, world)
        report("Allocating the KV cache")
        engine = cls(loaded.model, loaded.tokenizer, config, processor=loaded.processor, tensor_parallel=tp,
                     workers=started)
        tensor_parallel.send_step(engine.runner.num_blocks, tp)  # the workers size their slices alike
        tensor_parallel.connect_shared_memory(tp, engine.runner.cpu_ops, tensor_parallel.one_machine(config),
                                              config.distributed_timeout_s)
        tensor_parallel.keep_alive(tp, config.distributed_timeout_s)  # an idle server's ranks wait on
    except BaseException:
        started.stop(timeout=0)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        raise
    _describe(engine, loaded)
    return engine
