"""Forward backends: how one step's packed tokens become logits. `select_backend` is the one place that
decides which runs; every backend is a small class with the same call,
`backend(input_ids, positions, logits_index) -> logits` ([num_tokens], [num_tokens], [num_samples] ->
[num_samples, vocab]), reading the step's attention metadata from `tfserve.engine.attention`.

    hf.py        the model's own forward (any architecture, dtype, quantization)
    compiled.py  the same through torch.compile (`compile`), one graph for every step
    lean.py      a lean forward for Llama-family float32 models, with fused CPU kernels and packed weights
    lean_moe.py  its mixture-of-experts MLP (Qwen3-MoE): router, top-k experts, each from its own blocks
    lean_layers.py  its parts: projections as the kernels hold them, rotary tables, torch versions of fused ops
    cuda_graphs.py  decode steps of whichever backend runs, replayed as CUDA graphs by bucket of batch size
                 (the runner decides, from `EngineConfig.cuda_graph` and the device)
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from tfserve.config import EngineConfig
from tfserve.engine import cpu_linear
from tfserve.engine.backends.compiled import CompiledForward
from tfserve.engine.backends.hf import HFForward
from tfserve.engine.backends.lean import LeanForward
from tfserve.models.gguf_weights import is_native

logger = logging.getLogger(__name__)


class ForwardBackend(Protocol):
    name: str

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 logits_index: torch.Tensor) -> torch.Tensor: ...


def auto_weights(model: torch.nn.Module, config: EngineConfig, cpu_ops, tp=None) -> str:
    """What weights "auto" holds: a GGUF file's own blocks; a checkpoint stored in bfloat16 as bfloat16 where the
    kernels have bfloat16 dot products (the same weights, twice float32's rate for prompts and batches, inputs
    rounded to bfloat16: `--dtype float32` keeps float32 arithmetic); else float32."""
    if config.gguf_file and cpu_ops is not None and tp is None:
        return "gguf"
    if getattr(cpu_ops, "bf16_dot", False) and not is_native(model) and cpu_linear.stored_in_bfloat16(model):
        return "bfloat16"
    return "float32"


def select_backend(model: torch.nn.Module, config: EngineConfig, cpu_ops, tp=None) -> ForwardBackend:
    """The backend `config.forward_backend` asks for: "hf", "lean" (ValueError where it cannot run), or "auto"
    (lean where it applies), with linear weights held as `config.weights` says; the model's own forward is
    compiled where `config.compile` asks (the runner warms it up). `cpu_ops` are the compiled CPU
    kernels, or None. `tp`: the model is this rank's shard (tfserve.engine.parallel.tensor_parallel), which only the
    lean forward runs; rank 0's sends every step to the other ranks first."""
    if tp is not None and config.forward_backend == "hf":
        raise ValueError("tensor parallelism runs on the lean forward; forward_backend hf cannot split a model")
    if tp is not None and config.weights == "gguf":
        raise ValueError("tensor parallelism splits float32 (or float16/bfloat16/int8) weights, not a GGUF "
                         "file's blocks; leave weights auto")
    if is_native(model) and (config.forward_backend == "hf" or LeanForward.why_not(model) is not None
                             or cpu_ops is None or config.weights not in ("auto", "gguf") or not config.gguf_file):
        raise ValueError("a GGUF file loaded natively runs its blocks on the lean forward with tfserve's CPU "
                         "kernels (forward_backend auto or lean, weights auto or gguf)")
    weights = config.weights if config.weights != "auto" else auto_weights(model, config, cpu_ops, tp)
    why_not = "forward_backend is hf" if config.forward_backend == "hf" else LeanForward.why_not(model)
    if why_not is not None:
        if config.forward_backend == "lean":
            raise ValueError(f"forward_backend lean cannot run this model: {why_not}; use auto or hf")
        if config.weights not in ("auto", "float32"):
            raise ValueError(f"weights {config.weights} needs the lean forward, which cannot run this model: {why_not}")
        logger.debug("the model's own forward: %s", why_not)
        return CompiledForward(model) if config.compile else HFForward(model)
    if config.compile:
        logger.info("compile: the lean forward already runs tfserve's own kernels, so nothing is compiled "
                    "(forward_backend hf compiles the model's own forward)")
    if weights != "float32" and cpu_ops is None:
        raise ValueError(f"weights {weights} needs tfserve's CPU kernels, which are off or failed to build")
    pack = config.pack_weights
    if pack is None:
        pack = cpu_linear.can_pack(model, cpu_ops)
    elif pack and not cpu_linear.can_pack(model, cpu_ops):
        raise ValueError("pack_weights needs float32 weights on CPU and the CPU kernels")
    blocks = None
    if weights == "gguf":
        if not config.gguf_file:
            raise ValueError("weights gguf needs the GGUF file the model came from (gguf_file)")
        from tfserve.models.gguf_weights import quantized_linear_weights

        blocks = quantized_linear_weights(config.gguf_file, model)
    lean = LeanForward(model, cpu_ops, pack=pack, weights=weights, blocks=blocks, tp=tp)
    if blocks is not None:
        from tfserve.models.gguf_reader import release

        del blocks
        release(config.gguf_file)  # the kernels hold their own copies now
    if tp is not None and tp.rank == 0:
        from tfserve.engine.parallel.tensor_parallel import BroadcastForward

        return BroadcastForward(lean, tp)
    return lean
