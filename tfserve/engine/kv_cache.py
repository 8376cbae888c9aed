"""The KV block pool: which physical blocks each request holds, and the prefix cache over full blocks.

No torch here: this is bookkeeping over block ids. The tensors live in the runner.

A full block is named by the hash of (its parent block's hash, its token ids, the keys of the images whose
tokens it holds), so equal prefixes give equal chains of hashes and share blocks. Blocks are ref-counted; a block nobody holds goes to the free
list, where a cached one keeps its hash (and can be hit again) until it is evicted for reuse. Blocks with
no hash are reused first, cached ones least-recently-freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tfserve.engine.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache and how many of them hit."""

    num_queried_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class BlockPool:
    """Allocates fixed-size KV blocks to requests, with ref-counted prefix sharing."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1 (got {num_blocks}, {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.uncommitted: list[int] = []  # blocks cached for a step that has not run yet
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------------

    def _hash_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Extend `request.block_hashes` to every full block within its first `num_tokens` tokens."""
        size = self.block_size
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_tokens // size):
            tokens = tuple(request.token_ids[i * size : (i + 1) * size])
            # image tokens are all one id: the block is named by the images it holds too
            images = request.mm.keys_in(i * size, (i + 1) * size) if request.mm is not None else ()
            parent = hash((parent, tokens, images)) if images else hash((parent, tokens))
            hashes.append(parent)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks already holding this request's leading full blocks. At least one prompt token is left
        to compute, because the last one must run through the model to give logits. None for a request that
        needs its prompt's logits (prompt logprobs): it computes the whole prompt, as in vLLM."""
        if not self.enable_prefix_caching or request.needs_prompt_logits:
            return []
        max_tokens = request.num_tokens - 1
        self._hash_full_blocks(request, max_tokens)
        found = []
        size = self.block_size
        for i, block_hash in enumerate(request.block_hashes[: max_tokens // size]):
            block_id = self.cached.get(block_hash)
            if block_id is None or self.block_tokens[block_id] != tuple(request.token_ids[i * size : (i + 1) * size]):
                break
            found.append(block_id)
        return found

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that nobody holds."""
        for block_id in list(self.free):
            self._evict(block_id)

    # -- allocation ---------------------------------------------------------------------------------

    def allocate(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give `request` blocks for `num_new_tokens` more tokens (after `cached_blocks`, a prefix hit
        taken on its first schedule). False, and nothing changed, when the pool is too short. The pool never
        moves `request.num_computed_tokens`: the scheduler owns it."""
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens) - len(request.block_ids) - len(cached_blocks)
        num_reusable = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        if num_needed > len(self.free) - num_reusable:
            return False
        # a first schedule (or a resume) looked up; one that may not read the cache is no miss
        if self.enable_prefix_caching and not request.block_ids and not request.needs_prompt_logits:
            self.stats.num_queried_tokens += request.num_tokens
            self.stats.num_hit_tokens += len(cached_blocks) * self.block_size
        for block_id in cached_blocks:
            if self.ref_counts[block_id] == 0:
                del self.free[block_id]
            self.ref_counts[block_id] += 1
        request.block_ids.extend(cached_blocks)
        for _ in range(max(num_needed, 0)):
            block_id, _ = self.free.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            request.block_ids.append(block_id)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))  # not proposals
        return True

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks that will be full once this step has run. Later requests in the same step
        may already share them: each layer writes its new KV before any attention reads it."""
        self._hash_full_blocks(request, num_tokens)
        size = self.block_size
        for i in range(num_tokens // size):
            block_id = request.block_ids[i]
            if self.block_hash[block_id] is not None:
                continue
            block_hash = request.block_hashes[i]
            if block_hash in self.cached:
                continue  # the same content already sits in another block
            self.block_hash[block_id] = block_hash
            self.block_tokens[block_id] = tuple(request.token_ids[i * size : (i + 1) * size])
            self.cached[block_hash] = block_id
            self.uncommitted.append(block_id)

    def commit(self) -> None:
        """The step ran: the blocks cached for it now hold their KV."""
        self.uncommitted.clear()

    def uncache_uncommitted(self) -> set[int]:
        """The step failed: forget the blocks cached for it, whose KV may never have been written.
        Returns their ids (requests that hit them in the same step must recompute)."""
        blocks = set(self.uncommitted)
        for block_id in blocks:
            self._evict(block_id)
        self.uncommitted.clear()
        return blocks

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            if self.cached.get(block_hash) == block_id:
                del self.cached[block_hash]
            self.block_hash[block_id] = None
            self.block_tokens[block_id] = None

    def free_request(self, request: Request) -> None:
        """Drop the request's hold on its blocks. The tail goes first so that it is evicted first."""
        for block_id in reversed(request.block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free[block_id] = None
                if self.block_hash[block_id] is None:
                    self.free.move_to_end(block_id, last=False)
        request.block_ids = []
