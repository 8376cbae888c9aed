"""CUDA graphs of decode steps, with continuous batching (`EngineConfig.cuda_graph`).

A small model's decode step on a GPU is mostly launch overhead: the forward issues a few hundred kernels from
Python, each a few microseconds of work. Replaying the step as a captured CUDA graph costs one launch. A graph
fixes every shape and address while continuous batching changes the batch every step, so a decode step of n
sequences whose longest block table has k blocks replays the graph of its bucket (B >= n, K >= k): B one of 1, 2,
4, 8, then steps of 8 up to `max_num_seqs` (as vLLM buckets), K a power of two, so keys gathered for attention are
at most twice those needed. The step's inputs go into the graph's own buffers in one host-to-device copy; the
B - n spare rows decode token 0 at position 0 into a scratch block no sequence owns (the runner allocates the KV
cache one block larger than the pool hands out) and their logits are dropped.

A bucket is captured the first time a step needs it (an eager warm-up, then the capture), into one memory pool
that all graphs share: they never run at once, and every graph copies its logits into one output buffer outside
the pool. Prefills, checked proposals, prompt logprobs and images run eagerly. A capture that fails (a forward
that reads a tensor's value on the host, e.g. a dynamic rotary scaling) turns graphs off with one line saying why,
and every step runs eagerly.

A graph changes only shapes (padded rows, masked keys past each sequence's end), so its tokens are an eager
run's but where a near-tie falls the other way under another kernel's order of summation, as in vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tfserve.engine import attention
from tfserve.engine.attention import AttentionGroup, AttentionMetadata

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, 16, 24, ..., the last the first >= `max_batch`."""
    buckets = [1, 2, 4, *range(8, max_batch + 8, 8)]
    return [b for b in buckets if b < max_batch] + [next(b for b in buckets if b >= max_batch)]


def why_not(device: torch.device, flash: bool, tp) -> str | None:
    """Why decode steps cannot replay CUDA graphs here, or None when they can."""
    if device.type != "cuda":
        return f"the model is on {device.type}, not a CUDA device"
    if flash:
        return "flash-attn's varlen layout has sizes known only when a step runs"
    if tp is not None:
        return "the model is split across ranks"
    return None


class CudaGraph:
    """One captured step: `step` run once eagerly on a side stream (lazily made handles and workspaces), then
    captured into `pool`; `replay()` runs it again on the current stream."""

    def __init__(self, step: Callable[[], None], pool) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the server's other threads may use CUDA meanwhile (none does inside a step)
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            step()

    def replay(self) -> None:
        self.graph.replay()

    @staticmethod
    def pool():
        return torch.cuda.graph_pool_handle()


class DecodeGraphs:
    """`graphs.run(input_ids, positions, slots, block_tables) -> logits [n, vocab]` for a decode step of n
    sequences, through the captured graph of its bucket; None where no bucket takes it (the caller runs the
    step eagerly). `graph` captures a step (CudaGraph; tests on CPU pass one that replays by running it)."""

    def __init__(self, forward: Callable, kv_caches: list, block_size: int, scratch_block: int, max_batch: int,
                 max_model_len: int, device: torch.device, graph=None) -> None:
        self.forward = forward
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block  # the KV block spare rows write into: the pool never hands it out
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.max_blocks = _next_power_of_two(-(-max_model_len // block_size))
        self.device = device
        self.graph = graph or CudaGraph
        self.pool = None
        self.graphs: dict[tuple[int, int], object] = {}  # (batch, blocks) -> its captured step
        self.failed: str | None = None  # why graphs are off, once a capture failed
        self.num_replays = 0
        size = self.max_batch * (4 + self.max_blocks)
        # one copy per step: ids, positions, slots, key lengths (each [B]), then block tables [B, K]
        self.inputs = torch.zeros(size, dtype=torch.long, device=device)
        self.staged = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
        self.logits_index = torch.arange(self.max_batch, device=device)
        self.logits: torch.Tensor | None = None  # [max_batch, vocab]: every graph copies its logits here
        reserve = getattr(forward, "reserve_positions", None)
        if reserve is not None:  # tables a graph reads must exist before it is captured, for every position
            reserve(max_model_len)

    @property
    def num_captured(self) -> int:
        return len(self.graphs)

    def bucket(self, num_seqs: int, num_blocks: int) -> tuple[int, int] | None:
        """The (batch, blocks) graph a step of `num_seqs` sequences of at most `num_blocks` blocks replays."""
        if num_seqs > self.max_batch or num_blocks > self.max_blocks:
            return None
        batch = next(b for b in self.buckets if b >= num_seqs)
        return batch, _next_power_of_two(max(num_blocks, 1))

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], slots: list[int],
            block_tables: list[list[int]]) -> torch.Tensor | None:
        if self.failed is not None:
            return None
        num_seqs = len(input_ids)
        key = self.bucket(num_seqs, max(map(len, block_tables)))
        if key is None:
            return None
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(*key)
            if graph is None:
                return None
        batch, blocks = key
        staged = self.staged[: batch * (4 + blocks)]
        host = staged.numpy()
        scratch_slot = self.scratch_block * self.block_size
        for i, (values, pad) in enumerate(((input_ids, 0), (positions, 0), (slots, scratch_slot))):
            host[i * batch : i * batch + num_seqs] = values
            host[i * batch + num_seqs : (i + 1) * batch] = pad
        host[3 * batch : 3 * batch + num_seqs] = host[batch : batch + num_seqs] + 1  # keys: through the position
        host[3 * batch + num_seqs : 4 * batch] = 1
        tables = host[4 * batch :].reshape(batch, blocks)
        tables.fill(self.scratch_block)
        for row, table in enumerate(block_tables):
            tables[row, : len(table)] = table
        self.inputs[: staged.shape[0]].copy_(staged, non_blocking=True)
        graph.replay()
        self.num_replays += 1
        return self.logits[:num_seqs].clone()  # the buffer is the next step's too

    def _capture(self, batch: int, blocks: int):
        """Capture the step of bucket (batch, blocks), or turn graphs off (None) if that fails."""
        inputs = self.inputs
        ids, positions, slots, key_lens = (inputs[i * batch : (i + 1) * batch] for i in range(4))
        tables = inputs[4 * batch : 4 * batch + batch * blocks].view(batch, blocks)
        # spare rows everywhere: the warm-up and the capture compute into the scratch block only
        ids.zero_(), positions.zero_(), key_lens.fill_(1)
        slots.fill_(self.scratch_block * self.block_size), tables.fill_(self.scratch_block)
        logits_index = self.logits_index[:batch]

        def step() -> None:  # metadata made anew each time: a group caches its mask, which the graph must compute
            group = AttentionGroup(start=0, end=batch, block_tables=tables, query_positions=positions[:, None],
                                   key_lens=key_lens, pad_index=None, unpad_index=None)
            attention.set_metadata(AttentionMetadata(slot_mapping=slots, groups=[group], kv_caches=self.kv_caches,
                                                     block_size=self.block_size, num_decode_tokens=batch))
            try:
                logits = self.forward(ids, positions, logits_index)
            finally:
                attention.set_metadata(None)
            if self.logits is None:  # the first warm-up, outside any capture: the output outlives every graph
                self.logits = torch.empty(self.max_batch, logits.shape[-1], dtype=logits.dtype, device=logits.device)
            self.logits[:batch].copy_(logits)

        try:
            if self.pool is None:
                self.pool = self.graph.pool()
            graph = self.graph(step, self.pool)
        except Exception as e:  # a forward that syncs, an op that cannot be captured: eager from here on
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self.failed = reason[:300]
            logger.warning("CUDA graphs off, every step runs eagerly: capturing a decode step of %d failed: %s",
                           batch, self.failed)
            return None
        self.graphs[(batch, blocks)] = graph
        logger.debug("captured the decode step of %d sequences, %d blocks (%d graphs)", batch, blocks,
                     len(self.graphs))
        return graph


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()
