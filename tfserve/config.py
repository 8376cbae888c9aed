"""Engine configuration: one dataclass, validated where it is made."""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_BYTES = 1 * GiB
DEFAULT_CUDA_KV_CACHE_FRACTION = 0.7


@dataclass(slots=True)
class EngineConfig:
    """Sizes of the KV cache and of each step. Defaults serve a laptop CPU."""

    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV blocks; None: from kv_cache_memory
    kv_cache_memory: float | int | None = None  # bytes (> 1) or a fraction of free memory (<= 1)
    max_batch_tokens: int = 512  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 64  # running sequences at most
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # longest prompt + output; None: the model's context length
    generation_config: str = "auto"  # "auto": the model's generation_config gives absent sampling fields; "none"

    def __post_init__(self) -> None:
        _check(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0, "block_size",
               f"must be a power of two (got {self.block_size})")
        _check(self.num_blocks is None or self.num_blocks >= 1, "num_blocks", f"must be >= 1 (got {self.num_blocks})")
        _check(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory",
               f"must be bytes > 1 or a fraction in (0, 1] (got {self.kv_cache_memory})")
        _check(self.max_batch_tokens >= 1, "max_batch_tokens", f"must be >= 1 (got {self.max_batch_tokens})")
        _check(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1 (got {self.max_num_seqs})")
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
               f"must be >= 2 (got {self.max_model_len})")
        _check(self.generation_config in ("auto", "none"), "generation_config",
               f"must be auto or none (got {self.generation_config!r})")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")
