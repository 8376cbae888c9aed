"""The model runner: packs one `SchedulerOutput` into a single forward pass and samples.

Every scheduled sequence's new tokens are concatenated into one row (`[1, num_tokens]`, no padding),
with their positions and cache slots; logits are computed only where a sequence samples, then where one checks
proposals, then where one scores its prompt (prompt logprobs). Which forward computes them is the backend's
business (engine/backends), picked once here from the EngineConfig.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from tfserve.config import DEFAULT_CPU_KV_CACHE_BYTES, DEFAULT_CUDA_KV_CACHE_FRACTION, EngineConfig
from tfserve.engine import attention, host_memory, kernels
from tfserve.engine.attention import AttentionGroup, AttentionMetadata
from tfserve.engine.backends import cuda_graphs, select_backend
from tfserve.engine.backends.compiled import CompiledForward
from tfserve.engine.prompt_logprobs import positions_to_score, score
from tfserve.engine.request import Request
from tfserve.engine.sampler import Sampler, SamplerOutput
from tfserve.engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


def kv_cache_dtype(forward, dtype: torch.dtype, head_dim: int, cpu_ops, vision) -> torch.dtype:
    """The KV cache's element: bfloat16 where the lean forward holds bfloat16 weights on the CPU kernels (their
    keys and values already go into bfloat16 dot products for a prompt: held in bfloat16, a batch's decode reads
    half the bytes, and the cache holds twice the tokens; vLLM's cache for `--dtype bfloat16` too) and every
    attention row goes through the kernels (heads of whole vectors, no image tokens); else the model's dtype."""
    if (getattr(forward, "weight_formats", {}).keys() == {"bfloat16"} and dtype == torch.float32 and vision is None
            and cpu_ops is not None and attention.vector_head(cpu_ops, head_dim)):
        return torch.bfloat16
    return dtype


class ModelRunner:
    """Owns the KV cache tensors, the forward backend and the sampler."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, tp=None, *, vision: Any = None,
                 draft: Callable[[int], Any] | None = None) -> None:
        """`tp`: the model is this rank's shard of a tensor-parallel split (its KV heads, its cache). `vision`:
        a vision-language model's `VisionLanguage` (engine/multimodal.py). `draft(num_blocks)` makes the
        `DraftModel` that fills each step's proposals (engine/draft.py), once this runner's KV cache is sized:
        the draft's cache has the same blocks."""
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = model.dtype
        text_config = model.config.get_text_config()
        self.num_layers = text_config.num_hidden_layers
        self.num_kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        if tp is not None:
            self.num_kv_heads = tp.num_kv_heads
        self.head_dim = (getattr(text_config, "head_dim", None)
                         or text_config.hidden_size // text_config.num_attention_heads)
        self.block_size = block_size = config.block_size
        # the attention the model was loaded with picks ours: flash-attn for flash_attention_2, else paged SDPA
        loaded_with = getattr(model.config, "_attn_implementation", None)
        self.flash_attention = loaded_with == attention.FLASH_ATTN_IMPLEMENTATION
        graphs = config.cuda_graph is not False
        if graphs and (why_not := cuda_graphs.why_not(self.device, self.flash_attention, tp)) is not None:
            if config.cuda_graph:
                logger.warning("cuda_graph has no effect: %s", why_not)
            graphs = False
        sub_configs = getattr(model.config, "sub_configs", {}) or {}
        if not hasattr(model, "set_attn_implementation"):
            pass  # a GGUF's module tree (tfserve.models.gguf_skeleton): only the lean forward runs it
        elif "vision_config" in sub_configs and "text_config" in sub_configs:  # the vision tower keeps its own
            attention.register()
            model.set_attn_implementation({"text_config": attention.ATTN_IMPLEMENTATION})
        else:
            attention.register()
            model.set_attn_implementation(attention.ATTN_IMPLEMENTATION)
        model.eval()
        if self.device.type == "cpu":
            host_memory.keep_freed_memory()
        self.cpu_ops = kernels.cpu_ops() if config.cpu_kernels and self.device.type == "cpu" else None
        self.sampler = Sampler(self.device, self.cpu_ops)
        self.forward = select_backend(model, config, self.cpu_ops, tp)
        self.kv_dtype = kv_cache_dtype(self.forward, self.dtype, self.head_dim, self.cpu_ops, vision)
        self.num_blocks = config.num_blocks or self._num_blocks_for(config.kv_cache_memory)
        if config.num_blocks:
            self._check_fits("num_blocks", config.num_blocks * self.block_bytes)
        # with graphs, one block more than the pool hands out: the spare rows of a padded batch write there
        shape = (self.num_blocks + graphs, block_size, self.num_kv_heads, self.head_dim)
        if self.device.type == "cpu":  # one mapping, its pages made as blocks are first written
            whole = host_memory.lazy_zeros((self.num_layers, 2, *shape), self.kv_dtype)
            self.kv_caches = [(whole[i, 0], whole[i, 1]) for i in range(self.num_layers)]
        else:
            self.kv_caches = [(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                               torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
                              for _ in range(self.num_layers)]
        self.max_model_len = max_model_len(config, text_config)
        self.graphs = cuda_graphs.DecodeGraphs(
            self.forward, self.kv_caches, block_size, self.num_blocks, config.max_num_seqs, self.max_model_len,
            self.device) if graphs else None
        self.vision = vision
        self.draft = draft(self.num_blocks) if draft is not None else None
        self.warm_up()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile a compiled forward now rather than in the first request's step (with `vision`: Qwen2-VL's
        steps bring 3-D rotary positions). The step is a two-token prefill into block 0, free until the first
        request (a block's slots are written before they are read)."""
        if not isinstance(self.forward, CompiledForward):
            return
        stub = SimpleNamespace(block_ids=[0, 0], mm=None)
        extra = {}
        if self.vision is not None and self.vision.uses_mrope:
            extra["mrope_positions"] = lambda: torch.arange(2, device=self.device).repeat(3, 1)
        self.forward.warm_up(lambda: self._forward([0, 0], [0, 1], self._slots(stub, 0, 2),
                                                   [self._group([(stub, 0, 2)], 0)], 0, [1], **extra))

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block across all layers (keys and values)."""
        itemsize = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def _num_blocks_for(self, kv_cache_memory: float | int | None) -> int:
        if kv_cache_memory is None or kv_cache_memory <= 1:
            fraction = kv_cache_memory
            available = available_memory(self.device)
            if self.device.type == "cuda":
                num_bytes = int(available * (fraction or DEFAULT_CUDA_KV_CACHE_FRACTION))
            else:
                num_bytes = int(available * fraction) if fraction else min(DEFAULT_CPU_KV_CACHE_BYTES, available // 4)
        else:
            num_bytes = int(kv_cache_memory)
        num_blocks = num_bytes // self.block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory of {num_bytes} bytes holds no KV block ({self.block_bytes} bytes each)")
        if kv_cache_memory is not None and kv_cache_memory > 1:
            self._check_fits("kv_cache_memory", num_blocks * self.block_bytes)
        return num_blocks

    def _check_fits(self, field: str, num_bytes: int) -> None:
        """KVCacheTooLargeError for a cache asked for in bytes or blocks that the free memory cannot hold: the
        tensors are zeroed as they are made, so on CPU the kernel's OOM killer would end the process (exit 137,
        nothing said) and on CUDA it would be an out-of-memory traceback."""
        available = available_memory(self.device)
        if num_bytes > available:
            raise KVCacheTooLargeError(field, num_bytes, available, str(self.device))

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> tuple[list[Request], SamplerOutput | None, list[tuple[Request, list[int]]]]:
        """Run one step. Returns the requests that sampled a token (in order), their samples, and for each
        request with proposals (speculative decoding) its greedy token after each of its new tokens. Requests
        asking for prompt logprobs gather those of this step's prompt positions, once the step has run."""
        if self.draft is not None:
            self.draft.propose([r for r in plan.requests if r.spec_token_ids])
        input_ids, positions, slots, sample_index, samplers = [], [], [], [], []
        verify: list[tuple[Request, int, int]] = []  # request, first logits row, rows
        verify_index: list[int] = []
        scored: list[tuple[Request, range]] = []  # prompt logprobs: each request's positions to score
        score_index: list[int] = []
        image_rows: list[int] = []  # packed indices of image tokens, and the encoder rows that fill them
        image_features: list[tuple[Any, list[int]]] = []
        segments: list[tuple[Request, int, int]] = []  # each request's positions [start, end), in packed order
        for request, num_new in zip(plan.requests, plan.num_new_tokens):
            start = request.num_computed_tokens
            end = start + num_new
            to_score = positions_to_score(request, start, end)
            if to_score:  # packed index of position p: where this request's tokens begin, plus p - start
                scored.append((request, to_score))
                score_index.extend(len(input_ids) + p - start for p in to_score)
            segments.append((request, start, end))
            if request.mm is not None and start < request.num_prompt_tokens:  # a prefill chunk: its image rows
                for image in request.mm.images:
                    rows = image.rows_in(start, end)
                    if rows:
                        image_rows.extend(len(input_ids) + p - start for p, _ in rows)
                        image_features.append((image, [row for _, row in rows]))
            if request.spec_token_ids:  # the last token, then the proposals: every position is checked
                input_ids.extend(request.token_ids[start:] + request.spec_token_ids)
                verify.append((request, len(verify_index), num_new))
                verify_index.extend(range(len(input_ids) - num_new, len(input_ids)))
            else:
                input_ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self._slots(request, start, end))
            if end == request.num_tokens:
                sample_index.append(len(input_ids) - 1)
                samplers.append(request)
        logits = None
        if (self.graphs is not None and plan.num_decodes == len(plan.requests) and not verify and not scored
                and self.vision is None):  # a decode step as a captured graph (None: no bucket takes it)
            logits = self.graphs.run(input_ids, positions, slots, [r.block_ids for r in plan.requests])
        if logits is None:
            logits = self._eager(plan, input_ids, positions, slots, sample_index + verify_index + score_index,
                                 image_rows, image_features, segments)
        num_samples, num_checks = len(samplers), len(verify_index)
        verified = []
        if verify:
            # (a request held to a grammar gets no proposals: Scheduler._proposals)
            checks = logits[num_samples:num_samples + num_checks]
            choices = checks.max(dim=-1).indices.tolist()  # greedy, as the sampler's own
            verified = [(request, choices[first:first + rows]) for request, first, rows in verify]
        prompt_entries = score(logits[num_samples + num_checks:], scored) if scored else []
        samples = self.sampler(logits[:num_samples], samplers) if samplers else None
        # kept only now that nothing can fail: a step retried one request at a time scores them again
        for (request, _), entries in zip(scored, prompt_entries):
            request.prompt_logprobs.extend(entries)
        return samplers, samples, verified

    def _eager(self, plan: SchedulerOutput, input_ids: list[int], positions: list[int], slots: list[int],
               logits_index: list[int], image_rows: list[int], image_features: list, segments: list) -> torch.Tensor:
        """The step's forward as it comes, its attention groups made for its own shapes."""
        device = self.device
        groups = []
        # decodes, and each checked proposal as a decode of its own (the same attention as one at a time)
        num_verifies = sum(1 for r in plan.requests[plan.num_decodes:] if r.spec_token_ids)
        first_prefill = plan.num_decodes + num_verifies
        decode_rows = [(r, r.num_computed_tokens + i)
                       for r, n in zip(plan.requests[:first_prefill], plan.num_new_tokens) for i in range(n)]
        if decode_rows:
            groups.append(self._decode_group(decode_rows))
        if first_prefill < len(plan.requests):
            groups.append(self._group([(r, r.num_computed_tokens, n) for r, n in zip(
                plan.requests[first_prefill:], plan.num_new_tokens[first_prefill:])], len(decode_rows)))
        extra = {}
        if image_rows:  # the token embeddings with the images' encoder rows in place
            extra["inputs_embeds"] = lambda ids: self.vision.embed(ids, image_rows, image_features)
        if self.vision is not None and self.vision.uses_mrope:  # 3-D rotary positions, every step
            extra["mrope_positions"] = lambda: self.vision.mrope_positions(segments).to(device)
        return self._forward(input_ids, positions, slots, groups, len(decode_rows), logits_index, **extra)

    def _forward(self, input_ids: list[int], positions: list[int], slots: list[int], groups: list[AttentionGroup],
                 num_decode_tokens: int, logits_index: list[int], inputs_embeds=None,
                 mrope_positions=None) -> torch.Tensor:
        """One packed forward over the KV cache: logits at `logits_index`. `inputs_embeds(input_ids)` and
        `mrope_positions()` make a vision-language model's extra inputs."""
        device = self.device
        attention.set_metadata(AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            groups=groups, kv_caches=self.kv_caches, block_size=self.block_size, cpu_ops=self.cpu_ops,
            flash=self.flash_attention, num_decode_tokens=num_decode_tokens,
            prompt_dot=getattr(self.forward, "prompt_dot", False),
        ))
        ids = torch.tensor(input_ids, device=device)
        try:
            extra = {}
            if inputs_embeds is not None:
                extra["inputs_embeds"] = inputs_embeds(ids)
            if mrope_positions is not None:
                extra["mrope_positions"] = mrope_positions()
            return self.forward(ids, torch.tensor(positions, device=device),
                                torch.tensor(logits_index, dtype=torch.long, device=device), **extra)
        finally:
            attention.set_metadata(None)

    @torch.inference_mode()
    def greedy_next(self, chunks: list[tuple[Request, list[int], int]], vocab_size: int) -> list[int]:
        """Write each chunk's (request, tokens, first position) keys and values into this runner's cache, at the
        request's own slots, and return the greedy token after each chunk's last among the first `vocab_size`:
        a draft model's step (engine/draft.py). One-token chunks go first, as decodes."""
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i][1]) > 1)
        input_ids, positions, slots, last = [], [], [], []
        for i in order:
            request, tokens, start = chunks[i]
            end = start + len(tokens)
            input_ids.extend(tokens)
            positions.extend(range(start, end))
            slots.extend(self._slots(request, start, end))
            last.append(len(input_ids) - 1)
        decodes = [(chunks[i][0], chunks[i][2]) for i in order if len(chunks[i][1]) == 1]
        prefills = [(chunks[i][0], chunks[i][2], len(chunks[i][1])) for i in order if len(chunks[i][1]) > 1]
        groups = [self._decode_group(decodes)] if decodes else []
        if prefills:
            groups.append(self._group(prefills, len(decodes)))
        logits = self._forward(input_ids, positions, slots, groups, len(decodes), last)
        choices = logits[:, :vocab_size].argmax(dim=-1).tolist()
        tokens = [0] * len(chunks)
        for i, token in zip(order, choices):
            tokens[i] = token
        return tokens

    def _slots(self, request: Request, start: int, end: int) -> list[int]:
        """The KV cache slots of the request's positions [start, end)."""
        size, blocks = self.block_size, request.block_ids
        return [blocks[p // size] * size + p % size for p in range(start, end)]

    def _decode_group(self, rows: list[tuple[Request, int]]) -> AttentionGroup:
        """Metadata for the step's first tokens, one query each: `rows` of (request, position)."""
        device = self.device
        max_blocks = max(len(r.block_ids) for r, _ in rows)
        tables = [r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r, _ in rows]
        return AttentionGroup(
            start=0, end=len(rows),
            block_tables=torch.tensor(tables, dtype=torch.long, device=device),
            query_positions=torch.tensor([[p] for _, p in rows], dtype=torch.long, device=device),
            key_lens=torch.tensor([p + 1 for _, p in rows], dtype=torch.long, device=device),
            pad_index=None, unpad_index=None,
        )

    def _group(self, chunks: list[tuple[Request, int, int]], token_start: int) -> AttentionGroup:
        """Metadata for prefill `chunks` of (request, first position, tokens), whose tokens start at packed
        index `token_start` (after the decode rows)."""
        image_runs = None
        if self.vision is not None and self.vision.bidirectional:
            image_runs = [r.mm.runs_in(start, start + n) if r.mm is not None else [] for r, start, n in chunks]
        return AttentionGroup.prefills([(start, n) for _, start, n in chunks], [r.block_ids for r, _, _ in chunks],
                                       token_start, self.device, image_runs if image_runs and any(image_runs) else None)


class KVCacheTooLargeError(ValueError):
    """A KV cache asked for (`field`: "kv_cache_memory" or "num_blocks") that is larger than the memory free."""

    def __init__(self, field: str, num_bytes: int, available: int, device: str) -> None:
        super().__init__(f"{field}: a KV cache of {num_bytes / 1e9:.2f} GB does not fit in the "
                         f"{available / 1e9:.2f} GB of memory free on {device}")
        self.field, self.num_bytes, self.available, self.device = field, num_bytes, available, device


def max_model_len(config: EngineConfig, text_config) -> int:
    """The longest sequence (prompt and output) the engine takes: the config's, else the model's context."""
    return config.max_model_len or getattr(text_config, "max_position_embeddings", None) or 2048


def available_memory(device: torch.device | None = None) -> int:
    """Bytes of memory available to new allocations on `device`: a GPU's free memory, else this host's."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil comes with accelerate, but is not ours to require
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        return 8 << 30
