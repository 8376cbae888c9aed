"""Engine configuration: one dataclass, validated where it is made. Every switch of the engine lives here,
the forward backend and the CPU kernels included; the two environment variables operators used before
(`TFSERVE_LEAN_FORWARD=0`, `TFSERVE_CPU_KERNELS=0`) are read here only, as the defaults of their fields."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_BYTES = 1 * GiB
DEFAULT_CUDA_KV_CACHE_FRACTION = 0.7


@dataclass(slots=True)
class EngineConfig:
    """Sizes of the KV cache and of each step, and how a step runs. Defaults serve a laptop CPU."""

    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV blocks; None: from kv_cache_memory
    kv_cache_memory: float | int | None = None  # bytes (> 1) or a fraction of free memory (<= 1)
    max_batch_tokens: int = 512  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 64  # running sequences at most
    # a prefill takes at most this many tokens of a step (vLLM's long_prefill_token_threshold): long prompts, an
    # image's tokens, then run over several steps, and the decodes beside them keep their pace; None: the budget
    long_prefill_token_threshold: int | None = None
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # longest prompt + output; None: the model's context length
    chat_template: str | None = None  # a Jinja chat template over the model's own (vLLM's --chat-template); None: its own
    generation_config: str = "auto"  # "auto": the model's generation_config gives absent sampling fields; "none"
    # how a step's packed tokens become logits (engine/backends): "auto" picks the lean forward where it
    # applies, "hf" the model's own forward, "lean" insists on the lean forward (an error where it cannot run)
    forward_backend: str = field(default_factory=lambda: _env_default("TFSERVE_LEAN_FORWARD", "auto", "hf"))
    # torch.compile the model's own forward (engine/backends/compiled.py) where it runs, i.e. where the lean
    # forward does not; compiled at load time
    compile: bool = False
    # replay decode steps as CUDA graphs, one per bucket of batch sizes (engine/backends/cuda_graphs.py): None
    # where the model is on a CUDA device (and not on flash-attn), True likewise (a warning where it cannot),
    # False never
    cuda_graph: bool | None = None
    cpu_kernels: bool = field(default_factory=lambda: _env_default("TFSERVE_CPU_KERNELS", True, False))
    pack_weights: bool | None = None  # panel-packed float32 linear weights (lean forward, CPU); None: where they help
    # how the lean forward holds linear weights on CPU (engine/cpu_linear.py): float32, float16, bfloat16 (16-bit
    # storage, float32 arithmetic), int8 (Q8_0 blocks), gguf (the file's own blocks, K-quants too); "auto":
    # gguf where the model came from a GGUF file (gguf_file), else float32
    weights: str = "auto"
    gguf_file: str | None = None  # the GGUF file the model was loaded from (Engine.from_pretrained fills it in)
    # speculative decoding for greedy requests: "ngram" proposes tokens by prompt lookup (engine/spec_decode.py),
    # "draft" by a smaller model of the same tokenizer (engine/draft.py): `speculative_model`, as --model takes it
    speculative: str | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int = 4  # proposals per step at most
    # tensor parallelism (tfserve.engine.parallel): the model split across this many ranks (processes), rank 0 this one
    tensor_parallel_size: int = 1
    distributed_init_method: str | None = None  # the ranks' rendezvous (tcp://host:port, env://); None: local
    nnodes: int = 1  # machines the ranks span; rank 0's starts ranks 1..tensor_parallel_size/nnodes-1 itself
    distributed_timeout_s: float = 60.0  # every collective fails after this: a dead rank never hangs a step

    def __post_init__(self) -> None:
        _check(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0, "block_size",
               f"must be a power of two (got {self.block_size})")
        _check(self.num_blocks is None or self.num_blocks >= 1, "num_blocks", f"must be >= 1 (got {self.num_blocks})")
        _check(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory",
               f"must be bytes > 1 or a fraction in (0, 1] (got {self.kv_cache_memory})")
        _check(self.max_batch_tokens >= 1, "max_batch_tokens", f"must be >= 1 (got {self.max_batch_tokens})")
        _check(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1 (got {self.max_num_seqs})")
        _check(self.long_prefill_token_threshold is None or self.long_prefill_token_threshold >= 1,
               "long_prefill_token_threshold", f"must be >= 1 (got {self.long_prefill_token_threshold})")
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
               f"must be >= 2 (got {self.max_model_len})")
        _check(self.generation_config in ("auto", "none"), "generation_config",
               f"must be auto or none (got {self.generation_config!r})")
        _check(self.weights in WEIGHT_FORMATS, "weights",
               f"must be one of {', '.join(WEIGHT_FORMATS)} (got {self.weights!r})")
        _check(self.speculative in (None, "ngram", "draft"), "speculative",
               f"must be ngram or draft, or unset (got {self.speculative!r})")
        _check(self.speculative_model is None or self.speculative == "draft", "speculative_model",
               f"is the draft model of speculative draft (speculative is {self.speculative!r})")
        _check(self.speculative != "draft" or self.tensor_parallel_size == 1, "speculative",
               "draft runs without tensor parallelism for now")
        _check(1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens",
               f"must be in [1, 16] (got {self.num_speculative_tokens})")
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size",
               f"must be >= 1 (got {self.tensor_parallel_size})")
        _check(self.nnodes >= 1 and self.tensor_parallel_size % self.nnodes == 0, "nnodes",
               f"must divide tensor_parallel_size {self.tensor_parallel_size} (got {self.nnodes})")
        _check(self.nnodes == 1 or self.distributed_init_method is not None, "distributed_init_method",
               "must be given (tcp://HOST:PORT of the first node) when the ranks span several nodes")
        _check(self.distributed_timeout_s > 0, "distributed_timeout_s",
               f"must be > 0 (got {self.distributed_timeout_s})")
        _check(self.forward_backend in FORWARD_BACKENDS, "forward_backend",
               f"must be one of {', '.join(FORWARD_BACKENDS)} (got {self.forward_backend!r})")


FORWARD_BACKENDS = ("auto", "hf", "lean")
WEIGHT_FORMATS = ("auto", "float32", "float16", "bfloat16", "int8", "gguf")


def _env_default(name: str, default, when_off):
    """`when_off` where the operator set the variable `name` to 0, else `default`."""
    return when_off if os.environ.get(name, "1") == "0" else default


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")
