"""BlockPool: allocation, the chained prefix-cache hashes, ref counts, the LRU of freed cached blocks.

No model and no torch: requests are plain `Request`s with made-up token ids.
"""

from __future__ import annotations

import pytest

from tfserve.engine.kv_cache import BlockPool
from tfserve.engine.request import Request
from tfserve.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=8))


def admit(pool: BlockPool, request: Request) -> list[int]:
    """Schedule a whole prompt the way the scheduler does on first admission; returns the hit blocks."""
    cached = pool.find_cached_prefix(request)
    num_new = request.num_tokens - len(cached) * pool.block_size
    assert pool.allocate(request, num_new, cached)
    request.num_computed_tokens += len(cached) * pool.block_size  # the scheduler's part of taking a hit
    return cached


def snapshot(pool: BlockPool) -> tuple:
    return (list(pool.ref_counts), list(pool.free), dict(pool.cached), list(pool.block_hash))


def test_allocate_and_free_counts():
    pool = BlockPool(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(10)))  # 10 tokens -> 3 blocks
    assert pool.allocate(request, 10)
    assert len(request.block_ids) == 3
    assert len(set(request.block_ids)) == 3
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 3
    assert all(pool.ref_counts[b] == 1 for b in request.block_ids)

    # Growing within the last block needs nothing; crossing its end takes one more.
    request.num_computed_tokens = 10
    request.token_ids.append(10)
    assert pool.allocate(request, 1)
    assert len(request.block_ids) == 3
    request.num_computed_tokens = 11
    request.token_ids.append(11)
    assert pool.allocate(request, 1)
    assert len(request.block_ids) == 3  # token 12 of 12 still fits
    request.num_computed_tokens = 12
    request.token_ids.append(12)
    assert pool.allocate(request, 1)
    assert len(request.block_ids) == 4

    pool.free_request(request)
    assert request.block_ids == [] and request.num_computed_tokens == 12  # the scheduler's to reset, not the pool's
    assert pool.num_free_blocks == 8
    assert pool.ref_counts == [0] * 8


def test_num_blocks_for():
    pool = BlockPool(num_blocks=2, block_size=BLOCK_SIZE)
    assert [pool.num_blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_invalid_sizes_raise():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=0, block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(num_blocks=4, block_size=0)


def test_equal_prefixes_share_blocks_with_ref_counts():
    pool = BlockPool(num_blocks=16, block_size=BLOCK_SIZE)
    prefix = list(range(100, 108))  # two full blocks
    a = make_request("a", prefix + [1, 2])
    b = make_request("b", prefix + [3, 4, 5])
    assert admit(pool, a) == []
    hit = admit(pool, b)
    assert hit == a.block_ids[:2]
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.num_computed_tokens == 8  # the hit counts as computed; only the suffix is new
    assert b.block_ids[2] != a.block_ids[2]
    for block_id in a.block_ids[:2]:
        assert pool.ref_counts[block_id] == 2
    assert pool.ref_counts[a.block_ids[2]] == 1

    # Freeing one holder keeps the shared blocks out of the free list.
    shared = a.block_ids[:2]
    pool.free_request(a)
    assert all(pool.ref_counts[b_id] == 1 for b_id in shared)
    assert not set(shared) & set(pool.free)
    pool.free_request(b)
    assert pool.num_free_blocks == 16


def test_different_prefix_does_not_share():
    pool = BlockPool(num_blocks=16, block_size=BLOCK_SIZE)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(pool, a)
    # Same second block, different first: the chain differs, so nothing is shared.
    b = make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert admit(pool, b) == []
    assert not set(a.block_ids) & set(b.block_ids)
    # Same first block, different second: only the first is shared.
    c = make_request("c", [1, 2, 3, 4, 5, 6, 7, 0, 9])
    assert admit(pool, c) == a.block_ids[:1]


def test_full_prompt_hit_leaves_last_token_to_compute():
    pool = BlockPool(num_blocks=16, block_size=BLOCK_SIZE)
    prompt = list(range(8))  # exactly two full blocks
    a = make_request("a", prompt)
    admit(pool, a)
    b = make_request("b", prompt)
    hit = pool.find_cached_prefix(b)
    assert hit == a.block_ids[:1]  # the second block holds the last token, which must run for logits
    assert pool.allocate(b, b.num_tokens - len(hit) * BLOCK_SIZE, hit)
    assert b.block_ids[:1] == hit and len(b.block_ids) == 2

    # One token past the blocks: both blocks hit, one token left.
    c = make_request("c", prompt + [99])
    hit = pool.find_cached_prefix(c)
    assert hit == a.block_ids[:2]
    assert c.num_tokens - len(hit) * BLOCK_SIZE == 1


def test_freed_cached_blocks_are_hit_again():
    pool = BlockPool(num_blocks=16, block_size=BLOCK_SIZE)
    prompt = list(range(50, 63))  # 3 full blocks + 1 token
    a = make_request("a", prompt)
    admit(pool, a)
    full_blocks = a.block_ids[:3]
    pool.free_request(a)
    assert pool.num_free_blocks == 16
    assert all(b in pool.free for b in full_blocks)  # free, but still cached

    b = make_request("b", prompt)
    assert admit(pool, b) == full_blocks
    assert all(pool.ref_counts[x] == 1 for x in full_blocks)
    assert not set(full_blocks) & set(pool.free)


def test_eviction_prefers_uncached_blocks_then_the_tail_of_a_freed_request():
    pool = BlockPool(num_blocks=6, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(12)))  # 3 full blocks, all cached
    admit(pool, a)
    head, middle, tail = a.block_ids
    pool.free_request(a)

    b = make_request("b", list(range(200, 214)))  # 14 tokens: 4 blocks, the 3 uncached free ones + 1 evicted
    assert admit(pool, b) == []
    assert tail in b.block_ids
    assert head not in b.block_ids and middle not in b.block_ids

    # a's head and middle survive and are hit again.
    again = make_request("a2", list(range(12)) + [7])
    assert pool.find_cached_prefix(again) == [head, middle]


def test_freed_uncached_blocks_are_reused_before_cached_ones():
    pool = BlockPool(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(6)))  # one full (cached) block + one partial (uncached)
    admit(pool, a)
    full, partial = a.block_ids
    filler = make_request("f", list(range(300, 306)))  # takes the other two blocks
    admit(pool, filler)
    pool.free_request(a)
    assert list(pool.free)[0] == partial  # uncached goes to the front

    b = make_request("b", [400, 401, 402])
    admit(pool, b)
    assert b.block_ids == [partial]
    assert pool.find_cached_prefix(make_request("a2", list(range(6)))) == [full]


def test_lru_evicts_least_recently_freed_first():
    pool = BlockPool(num_blocks=3, block_size=BLOCK_SIZE)
    first = make_request("first", [1, 1, 1, 1, 9])  # one full (cached) block + one partial
    second = make_request("second", [2, 2, 2, 2, 9])
    admit(pool, first)
    first_block = first.block_ids[0]
    pool.free_request(first)
    admit(pool, second)  # reuses first's partial block and the untouched one
    second_block = second.block_ids[0]
    pool.free_request(second)
    assert first_block != second_block

    newcomer = make_request("new", list(range(20, 28)))  # two blocks: the uncached one, then the LRU one
    admit(pool, newcomer)
    assert first_block in newcomer.block_ids
    assert second_block not in newcomer.block_ids
    assert pool.find_cached_prefix(make_request("s", [2, 2, 2, 2, 9])) == [second_block]
    assert pool.find_cached_prefix(make_request("f", [1, 1, 1, 1, 9])) == []


def test_allocate_short_returns_false_and_changes_nothing():
    pool = BlockPool(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", list(range(8)))
    admit(pool, a)
    pool.free_request(a)  # two cached blocks in the free list

    b = make_request("b", list(range(8)) + list(range(100, 120)))  # 28 tokens: 7 blocks, 2 of them hits
    hit = pool.find_cached_prefix(b)
    assert len(hit) == 2
    before = snapshot(pool)
    assert not pool.allocate(b, b.num_tokens - 8, hit)
    assert snapshot(pool) == before
    assert b.block_ids == [] and b.num_computed_tokens == 0

    # A running request that cannot grow is left as it was, too.
    c = make_request("c", list(range(500, 516)))  # 16 tokens: all 4 blocks
    assert pool.allocate(c, 16)
    c.num_computed_tokens = 16
    c.token_ids.append(1)
    before = snapshot(pool)
    assert not pool.allocate(c, 1)
    assert snapshot(pool) == before
    assert len(c.block_ids) == 4 and c.num_computed_tokens == 16


def test_hit_rate_stats():
    pool = BlockPool(num_blocks=16, block_size=BLOCK_SIZE)
    assert pool.stats.hit_rate == 0.0
    prompt = list(range(9))
    admit(pool, make_request("a", prompt))
    assert (pool.stats.num_queried_tokens, pool.stats.num_hit_tokens) == (9, 0)
    admit(pool, make_request("b", prompt))
    assert (pool.stats.num_queried_tokens, pool.stats.num_hit_tokens) == (18, 8)
    assert pool.stats.hit_rate == pytest.approx(8 / 18)


def test_hit_rate_of_a_recomputed_request_stays_at_most_one():
    pool = BlockPool(num_blocks=16, block_size=BLOCK_SIZE)
    request = make_request("a", [1, 2, 3])
    admit(pool, request)
    request.num_computed_tokens = request.num_tokens
    for token in range(10, 22):  # decode 12 tokens
        request.token_ids.append(token)
        assert pool.allocate(request, 1)
        request.num_computed_tokens += 1
    pool.free_request(request)  # preempted: recomputed later, its full blocks still cached
    assert len(pool.find_cached_prefix(request)) == 3
    assert pool.stats.num_hit_tokens <= pool.stats.num_queried_tokens
    assert pool.stats.hit_rate <= 1.0


def test_prefix_caching_disabled_never_hits():
    pool = BlockPool(num_blocks=16, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    prompt = list(range(9))
    a = make_request("a", prompt)
    admit(pool, a)
    assert admit(pool, make_request("b", prompt)) == []
    assert pool.cached == {}
    pool.free_request(a)
    assert admit(pool, make_request("c", prompt)) == []


def test_reset_prefix_cache_forgets_free_blocks_only():
    pool = BlockPool(num_blocks=16, block_size=BLOCK_SIZE)
    freed = make_request("freed", list(range(9)))
    held = make_request("held", list(range(100, 109)))
    admit(pool, freed)
    admit(pool, held)
    pool.free_request(freed)
    pool.reset_prefix_cache()
    assert pool.find_cached_prefix(make_request("x", list(range(9)))) == []
    assert pool.find_cached_prefix(make_request("y", list(range(100, 109)))) == held.block_ids[:2]
    assert all(pool.block_hash[b] is None for b in pool.free)
    assert pool.num_free_blocks == 16 - len(held.block_ids)
