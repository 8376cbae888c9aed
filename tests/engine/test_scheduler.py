"""Scheduler decisions with fake requests and no model: the engine is simulated by `run_step`."""

from __future__ import annotations

import itertools
import subprocess
import sys

from tfserve.engine.kv_cache import BlockPool
from tfserve.engine.request import Request, RequestStatus
from tfserve.engine.scheduler import Scheduler, SchedulerOutput
from tfserve.sampling_params import SamplingParams

_arrival = itertools.count()


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int = 4, first_token: int | None = None) -> Request:
    """A request whose prompt shares no prefix with any other unless `first_token` says so."""
    arrival = next(_arrival)
    start = 1000 * (arrival + 1) if first_token is None else first_token
    prompt = [start + i for i in range(num_prompt_tokens)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), arrival_time=float(arrival))


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_batch_tokens: int = 64, max_num_seqs: int = 8,
                   enable_prefix_caching: bool = True) -> Scheduler:
    return Scheduler(BlockPool(num_blocks, block_size, enable_prefix_caching), max_batch_tokens, max_num_seqs)


def check_consistent(plan: SchedulerOutput) -> None:
    assert len(plan.requests) == len(plan.num_new_tokens)
    assert plan.num_batched_tokens == sum(plan.num_new_tokens)
    assert all(n >= 1 for n in plan.num_new_tokens)
    assert plan.num_new_tokens[: plan.num_decodes] == [1] * plan.num_decodes
    # decodes are sampled tokens; after them, one token alone is a prompt's (its last, the rest cached or chunked)
    assert all(r.num_computed_tokens >= r.num_prompt_tokens for r in plan.requests[: plan.num_decodes])
    assert all(n > 1 or r.num_computed_tokens < r.num_prompt_tokens
               for r, n in zip(plan.requests[plan.num_decodes :], plan.num_new_tokens[plan.num_decodes :]))
    assert len({id(r) for r in plan.requests}) == len(plan.requests)
    for request, n in zip(plan.requests, plan.num_new_tokens):
        assert request.status == RequestStatus.RUNNING
        assert request.num_computed_tokens + n <= request.num_tokens


def run_step(scheduler: Scheduler, next_token: int = 7) -> SchedulerOutput:
    """What the engine does with a plan: compute the tokens, sample at the end of a sequence, finish."""
    plan = scheduler.schedule()
    check_consistent(plan)
    block_size = scheduler.block_pool.block_size
    for request, n in zip(plan.requests, plan.num_new_tokens):
        assert len(request.block_ids) * block_size >= request.num_computed_tokens + n
    scheduler.advance(plan)
    for request in plan.requests:
        if request.num_computed_tokens == request.num_tokens:
            request.token_ids.append(next_token)
            if request.num_output_tokens >= request.params.max_tokens:
                scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
    return plan


def run_to_completion(scheduler: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    plans = []
    while scheduler.has_unfinished:
        plans.append(run_step(scheduler))
        assert len(plans) < max_steps, "scheduler made no progress"
    return plans


def test_decodes_first_then_prefills():
    scheduler = make_scheduler()
    a, b = make_request("a", 5), make_request("b", 6)
    scheduler.add(a)
    scheduler.add(b)
    plan = run_step(scheduler)
    assert plan.requests == [a, b] and plan.num_new_tokens == [5, 6] and plan.num_decodes == 0

    c = make_request("c", 9)
    scheduler.add(c)
    plan = run_step(scheduler)
    assert plan.requests == [a, b, c]
    assert plan.num_new_tokens == [1, 1, 9]
    assert plan.num_decodes == 2
    assert plan.num_batched_tokens == 11


def test_token_budget_respected_and_long_prompt_chunked():
    scheduler = make_scheduler(max_batch_tokens=8)
    long = make_request("long", 21, max_tokens=3)
    scheduler.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        plan = run_step(scheduler)
        assert plan.num_batched_tokens <= 8
        chunks.append(plan.num_new_tokens)
    assert chunks == [[8], [8], [5]]
    assert long.num_computed_tokens == 21 and long.num_tokens == 22
    plans = run_to_completion(scheduler)
    assert all(p.num_new_tokens == [1] for p in plans)
    assert long.status == RequestStatus.FINISHED_LENGTH
    assert long.num_output_tokens == 3


def test_budget_shared_between_decodes_and_a_chunked_prefill():
    scheduler = make_scheduler(max_batch_tokens=8)
    a = make_request("a", 3, max_tokens=10)
    scheduler.add(a)
    run_step(scheduler)  # a prefilled, now decoding
    b = make_request("b", 20, max_tokens=2)
    scheduler.add(b)
    plan = run_step(scheduler)
    assert plan.requests == [a, b]
    assert plan.num_new_tokens == [1, 7]  # the prefill gets what the decode leaves
    plan = run_step(scheduler)
    assert plan.num_new_tokens == [1, 7]
    plan = run_step(scheduler)
    assert plan.num_new_tokens == [1, 6]
    assert b.num_output_tokens == 1
    for plan in run_to_completion(scheduler):
        assert plan.num_batched_tokens <= 8


def test_long_prefill_token_threshold_caps_a_prefill_per_step():
    scheduler = Scheduler(BlockPool(64, 4), 64, 8, long_prefill_token_threshold=5)
    a = make_request("a", 3, max_tokens=10)
    scheduler.add(a)
    assert run_step(scheduler).num_new_tokens == [3]  # shorter than the threshold: whole
    b = make_request("b", 12, max_tokens=2)
    scheduler.add(b)
    assert [run_step(scheduler).num_new_tokens for _ in range(3)] == [[1, 5], [1, 5], [1, 2]]
    assert b.num_output_tokens == 1  # the prefill ended, over three steps beside a's decodes


def test_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2)
    requests = [make_request(str(i), 4, max_tokens=2) for i in range(3)]
    for request in requests:
        scheduler.add(request)
    plan = run_step(scheduler)
    assert plan.requests == requests[:2]
    assert requests[2].status == RequestStatus.WAITING
    plan = run_step(scheduler)  # both finish after this step's decode
    assert plan.requests == requests[:2]
    plan = run_step(scheduler)
    assert plan.requests == [requests[2]]
    run_to_completion(scheduler)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)


def test_fcfs_admission_order_and_head_of_line():
    scheduler = make_scheduler(max_batch_tokens=10)
    requests = [make_request(str(i), n) for i, n in enumerate([6, 6, 3])]
    for request in requests:
        scheduler.add(request)
    plan = run_step(scheduler)
    # The second is chunked to the 4 tokens left; the third, though short, waits its turn.
    assert plan.requests == requests[:2]
    assert plan.num_new_tokens == [6, 4]
    assert requests[2].status == RequestStatus.WAITING
    assert list(scheduler.waiting) == [requests[2]]


def test_fcfs_waits_for_blocks_instead_of_skipping():
    scheduler = make_scheduler(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a = make_request("a", 12, max_tokens=1)  # 3 blocks
    b = make_request("b", 8, max_tokens=1, first_token=100)  # 2 blocks: does not fit next to a
    c = make_request("c", 2, max_tokens=1, first_token=200)  # would fit, but arrived after b
    for request in (a, b, c):
        scheduler.add(request)
    plan = run_step(scheduler)
    assert plan.requests == [a]
    plan = run_step(scheduler)
    assert plan.requests == [b, c]


def test_preemption_of_latest_arrived_running_request():
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_batch_tokens=64)
    a = make_request("a", 4, max_tokens=12, first_token=0)
    b = make_request("b", 4, max_tokens=12, first_token=100)
    c = make_request("c", 4, max_tokens=12, first_token=200)
    for request in (a, b, c):
        scheduler.add(request)
    plan = run_step(scheduler)
    assert plan.requests == [a, b, c]

    late = make_request("late", 2, max_tokens=1, first_token=300)
    scheduler.add(late)
    preempted_plan = None
    for _ in range(20):
        plan = run_step(scheduler)
        if plan.preempted:
            preempted_plan = plan
            break
    assert preempted_plan is not None, "the pool never ran short"
    assert preempted_plan.preempted[0] is c  # the latest arrival goes first
    assert c.status == RequestStatus.PREEMPTED
    assert c not in preempted_plan.requests and late not in preempted_plan.requests  # nothing new this step
    assert c.block_ids == [] and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and scheduler.num_preemptions >= 1
    assert scheduler.waiting[0] is c  # resumes before anything that arrived later
    assert list(scheduler.waiting).index(c) < list(scheduler.waiting).index(late)
    num_output_tokens = c.num_output_tokens
    assert num_output_tokens > 0

    run_to_completion(scheduler)
    for request in (a, b, c):
        assert request.status == RequestStatus.FINISHED_LENGTH
        assert request.num_output_tokens == 12
    assert late.status == RequestStatus.FINISHED_LENGTH
    assert scheduler.block_pool.num_free_blocks == scheduler.block_pool.num_blocks


def test_preempted_request_is_recomputed_with_its_output_tokens():
    scheduler = make_scheduler(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a = make_request("a", 4, max_tokens=8, first_token=0)
    b = make_request("b", 4, max_tokens=8, first_token=100)
    scheduler.add(a)
    scheduler.add(b)
    while not b.num_preemptions:
        run_step(scheduler)
    num_tokens = b.num_tokens
    assert num_tokens > 4
    while True:
        plan = run_step(scheduler)
        if b in plan.requests:
            break
    # On resumption b recomputes its prompt and the tokens it had generated, then samples the next one.
    assert plan.num_new_tokens[plan.requests.index(b)] == num_tokens
    assert b.num_tokens == num_tokens + 1
    run_to_completion(scheduler)
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert scheduler.block_pool.num_free_blocks == 4


def test_last_running_request_preempts_itself_when_short():
    """The latest-arrived request that cannot grow is its own victim; it retries later and finishes."""
    scheduler = make_scheduler(num_blocks=3, block_size=4, enable_prefix_caching=False)
    a = make_request("a", 4, max_tokens=8)  # needs 3 blocks at the end: fits alone
    b = make_request("b", 4, max_tokens=8, first_token=50)
    scheduler.add(a)
    scheduler.add(b)
    run_to_completion(scheduler)
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert scheduler.num_preemptions >= 1
    assert scheduler.block_pool.num_free_blocks == 3


def test_all_blocks_free_after_finish_and_abort():
    scheduler = make_scheduler(num_blocks=32, block_size=4, max_batch_tokens=16)
    requests = [make_request(str(i), 5 + 3 * i, max_tokens=6, first_token=10 * i) for i in range(5)]
    for request in requests:
        scheduler.add(request)
    run_step(scheduler)
    run_step(scheduler)
    running, waiting = scheduler.running[0], scheduler.waiting[-1]
    scheduler.finish(running, RequestStatus.FINISHED_ABORTED)
    scheduler.finish(waiting, RequestStatus.FINISHED_ABORTED)
    assert running not in scheduler.running and waiting not in scheduler.waiting
    assert running.block_ids == []
    run_to_completion(scheduler)
    assert not scheduler.has_unfinished
    pool = scheduler.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert pool.ref_counts == [0] * pool.num_blocks


def test_empty_schedule():
    scheduler = make_scheduler()
    plan = scheduler.schedule()
    assert plan.is_empty and plan.num_batched_tokens == 0 and plan.num_decodes == 0


def test_plans_consistent_under_load():
    """Many requests, a small budget and a small pool: every plan is self-consistent and all finish."""
    scheduler = make_scheduler(num_blocks=24, block_size=4, max_batch_tokens=12, max_num_seqs=4)
    requests = [make_request(str(i), 3 + (7 * i) % 17, max_tokens=2 + i % 5, first_token=(i % 3) * 50)
                for i in range(12)]
    for request in requests:
        scheduler.add(request)
    plans = run_to_completion(scheduler)
    for plan in plans:
        assert plan.num_batched_tokens <= 12
        assert len(plan.requests) <= 4
    for request in requests:
        assert request.status == RequestStatus.FINISHED_LENGTH
        assert request.num_output_tokens == request.params.max_tokens
    assert scheduler.block_pool.num_free_blocks == 24


def test_scheduler_and_block_pool_import_no_torch():
    code = ("import sys, tfserve.engine.scheduler, tfserve.engine.kv_cache, tfserve.engine.request, "
            "tfserve.sampling_params; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_scheduler_alone_moves_num_computed_tokens():
    scheduler = make_scheduler(block_size=4)
    first = make_request("first", 10, first_token=500)
    scheduler.add(first)
    run_step(scheduler)
    second = make_request("second", 10, first_token=500)  # the same 10-token prompt: two full blocks hit
    scheduler.add(second)
    plan = scheduler.schedule()
    assert second in plan.requests and second.num_computed_tokens == 8
    assert plan.num_new_tokens[plan.requests.index(second)] == 2
    scheduler.advance(plan)
    assert second.num_computed_tokens == 10
    scheduler.finish(second, RequestStatus.FINISHED_ABORTED)
    assert second.num_computed_tokens == 0 and second.block_ids == []
