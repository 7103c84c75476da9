"""Scheduler and allocator invariants, with no model: budgets never exceeded, every block freed,
preemption recomputes, FCFS order, no request starved (also across adapters), a long prefill never
holding back decodes or new arrivals."""
from __future__ import annotations

import itertools
import random

import pytest

from lora_runtime.adapters.pages import AdapterPagePool
from lora_runtime.config import SchedulerConfig
from lora_runtime.core import RequestStatus
from lora_runtime.kv_cache import BlockAllocator, KVCacheManager
from lora_runtime.scheduler import ScheduledRequest, Scheduler
from tests.engine.factories import make_request


def _simulate_step(scheduler: Scheduler) -> list:
    """What the engine does around the model: record computed tokens, append a token to every
    request that reached its end, finish those that hit max_new_tokens."""
    output = scheduler.schedule()
    scheduler.update_after_step(output)
    finished = []
    for item in output.scheduled:
        request = item.request
        if item.samples_next_token:
            request.output_token_ids.append(0)
            if len(request.output_token_ids) >= request.params.max_new_tokens:
                scheduler.finish(request)
                finished.append(request)
    return output, finished


def _adapter_pool(num_pages: int, ranks: dict[str, int]) -> AdapterPagePool:
    """A page pool over one module, adapter key -> its rank there (keys absent: still loading)."""
    return AdapterPagePool(num_pages, ("q_proj",), lambda key: {"q_proj": ranks[key]} if key in ranks else None)


def _work(item: ScheduledRequest, config: SchedulerConfig) -> int:
    """A chunk's work by its definition: one per token, plus one per `attention_pairs_per_token`
    query-key pairs, counted one new token at a time (it attends to all before it and itself)."""
    num_pairs = sum(item.num_computed_tokens + offset + 1 for offset in range(item.num_new_tokens))
    return item.num_new_tokens + num_pairs // config.attention_pairs_per_token


def test_allocator_reference_counts_return_blocks_at_zero() -> None:
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(3)
    allocator.share(blocks[:2])
    allocator.release(blocks)
    assert allocator.num_free_blocks == 2  # the two shared blocks still have one reader
    allocator.release(blocks[:2])
    assert allocator.num_free_blocks == 4
    with pytest.raises(AssertionError):
        allocator.release(blocks[:1])


def test_block_table_grows_by_whole_blocks_and_refuses_when_full() -> None:
    kv = KVCacheManager(num_blocks=3, block_size_tokens=4)
    assert kv.allocate_slots("a", 5)
    assert len(kv.block_table("a")) == 2
    assert kv.allocate_slots("a", 8) and len(kv.block_table("a")) == 2
    assert not kv.allocate_slots("a", 13)  # needs 4 blocks, only 3 exist
    assert len(kv.block_table("a")) == 2, "a refused allocation changes nothing"
    kv.free("a")
    assert kv.num_free_blocks == 3


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_respects_budgets_and_frees_every_block(seed: int) -> None:
    rng = random.Random(seed)
    # 16 pairs per token make attention count at these small contexts, so the work caps bind.
    config = SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=5, attention_pairs_per_token=16,
                             max_prefill_chunk_work=12)
    kv = KVCacheManager(num_blocks=14, block_size_tokens=4)
    # Two of the three adapters fit the pool at once: their pages bind as the KV blocks do.
    pages = _adapter_pool(7, {"a": 64, "b": 48, "c": 33})
    scheduler = Scheduler(config, kv, pages)
    requests = [
        make_request(f"r{i}", rng.randint(1, 30), rng.randint(1, 12), rng.choice([None, "a", "b", "c"]))
        for i in range(25)
    ]
    pending = list(requests)
    finished, preemptions, steps = [], 0, 0
    while (pending or scheduler.num_unfinished) and steps < 2000:
        steps += 1
        for _ in range(rng.randint(0, 2)):
            if pending:
                scheduler.add_request(pending.pop(0))
        output, done = _simulate_step(scheduler)
        finished.extend(done)
        preemptions += len(output.preempted)
        assert output.num_batched_tokens <= config.max_num_batched_tokens
        assert sum(_work(item, config) for item in output.scheduled) <= config.max_num_batched_tokens
        assert all(_work(item, config) <= config.max_prefill_chunk_work for item in output.scheduled)
        assert len(output.scheduled) <= config.max_num_seqs
        keys = [item.request.adapter_key or "" for item in output.scheduled]
        runs = [key for key, _ in itertools.groupby(keys)]
        assert len(runs) == len(set(runs)), "one adapter's tokens must be contiguous"
        firsts = [pages.placement(key).first_page for key in runs if key]
        assert "" not in runs[1:] and firsts == sorted(firsts), "base requests first, then adapters by their pages"
        assert [key for key, _ in output.adapters] == list(dict.fromkeys(key for key in keys if key))
        assert all(pages.placement(key) == placement for key, placement in output.adapters)
        running_keys = {r.adapter_key for r in scheduler.running if r.adapter_key}
        assert running_keys <= {k for k in "abc" if pages.is_resident(k)} and pages.num_pinned == len(running_keys)
        assert kv.num_free_blocks + sum(len(kv.block_table(r.request_id)) for r in scheduler.running) == kv.num_blocks
    assert len(finished) == len(requests), "every request finishes: none starved"
    assert kv.num_free_blocks == kv.num_blocks and pages.num_pinned == 0
    assert preemptions > 0, "the cache is small enough that this workload must preempt"


def test_preempted_request_recomputes_from_zero_and_keeps_its_place() -> None:
    kv = KVCacheManager(num_blocks=4, block_size_tokens=4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv)
    first, second = make_request("first", 8, 20), make_request("second", 7, 20)
    scheduler.add_request(first)
    scheduler.add_request(second)
    _simulate_step(scheduler)  # both prefilled: 2 + 2 blocks, cache full
    output, _ = _simulate_step(scheduler)  # first needs a third block: the newest is preempted
    assert [r.request_id for r in output.preempted] == ["second"]
    assert second.num_computed_tokens == 0 and second.status is RequestStatus.PREEMPTED
    assert scheduler.waiting[0] is second
    assert second.output_token_ids == [0], "generated tokens survive preemption and are recomputed"


def test_chunked_prefill_grants_the_rest_over_several_steps() -> None:
    kv = KVCacheManager(num_blocks=64, block_size_tokens=4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=10), kv)
    request = make_request("long", 25, 2)
    scheduler.add_request(request)
    grants = []
    for _ in range(3):
        output, _ = _simulate_step(scheduler)
        grants.append([(item.num_computed_tokens, item.num_new_tokens, item.samples_next_token) for item in output.scheduled])
    assert grants == [[(0, 10, False)], [(10, 10, False)], [(20, 5, True)]]


def test_unpopular_adapter_is_not_starved_by_popular_ones() -> None:
    """A popular adapter's new arrivals keep the pool, which holds one adapter, pinned; the request
    for another adapter still runs once it has waited long enough."""
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_wait_steps_before_priority=4)
    pages = _adapter_pool(4, {"popular": 64, "rare": 64})
    scheduler = Scheduler(config, KVCacheManager(num_blocks=256, block_size_tokens=4), pages)
    scheduler.add_request(make_request("popular-0", 4, 3, "popular"))
    scheduler.add_request(make_request("rare", 4, 3, "rare"))
    for step in range(40):
        scheduler.add_request(make_request(f"popular-{step + 1}", 4, 3, "popular"))
        output, _ = _simulate_step(scheduler)
        if any(item.request.request_id == "rare" for item in output.scheduled):
            return
    pytest.fail("the rare adapter's request never ran")


def test_waiting_request_whose_adapter_is_loading_does_not_block_others() -> None:
    loaded = {"fast": 16}
    scheduler = Scheduler(SchedulerConfig(), KVCacheManager(64, 4), _adapter_pool(8, loaded))
    scheduler.add_request(make_request("slow", 4, 2, "slow"))
    scheduler.add_request(make_request("fast", 4, 2, "fast"))
    output, _ = _simulate_step(scheduler)
    assert [item.request.request_id for item in output.scheduled] == ["fast"]
    loaded["slow"] = 16
    output, _ = _simulate_step(scheduler)
    assert "slow" in [item.request.request_id for item in output.scheduled]


def test_any_number_of_adapters_run_in_one_step() -> None:
    """300 requests of 300 adapters of ranks 8-64 all run in the first step when their pages fit."""
    ranks = {f"adapter-{i:03d}": (8, 16, 32, 64)[i % 4] for i in range(300)}
    pages = _adapter_pool(sum(-(-rank // 16) for rank in ranks.values()), ranks)
    config = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=512)
    scheduler = Scheduler(config, KVCacheManager(1024, 16), pages)
    for key in ranks:
        scheduler.add_request(make_request(key, 5, 2, key))
    output, _ = _simulate_step(scheduler)
    assert len(output.scheduled) == 300 and [key for key, _ in output.adapters] == sorted(ranks)
    assert sum(placement.num_pages for _, placement in output.adapters) == pages.num_pages


def test_adapters_that_do_not_fit_wait_while_resident_ones_run() -> None:
    """The pool holds two rank-64 adapters: a third waits (its request passed over, not failed) while
    requests of the resident ones keep being admitted; when the running ones finish it gets in, and
    once it finishes too its adapter stays resident, idle. (Preemption's pins: the random workload.)"""
    pages = _adapter_pool(8, {"a": 64, "b": 64, "c": 64})
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(64, 4), pages)
    for request_id, key in [("a0", "a"), ("b0", "b"), ("c0", "c"), ("a1", "a")]:
        scheduler.add_request(make_request(request_id, 4, 2, key))
    output, _ = _simulate_step(scheduler)
    assert [item.request.request_id for item in output.scheduled] == ["a0", "a1", "b0"]
    assert [r.request_id for r in scheduler.waiting] == ["c0"] and pages.num_pinned == 2
    _simulate_step(scheduler)  # a0, a1, b0 draw their second token and finish
    output, _ = _simulate_step(scheduler)
    assert [item.request.request_id for item in output.scheduled] == ["c0"]
    _simulate_step(scheduler)
    assert scheduler.num_unfinished == 0 and pages.num_pinned == 0 and pages.is_resident("c")


def test_long_prefill_leaves_room_for_decodes_and_new_requests_every_step() -> None:
    """With the default budgets, a 7,000-token prompt is prefilled in chunks that keep each step
    within its work budget, while a short request arriving at any step gets its whole prompt in the
    very next step and, once generating, a token in every step after (decodes go first)."""
    config = SchedulerConfig()
    scheduler = Scheduler(config, KVCacheManager(num_blocks=1024, block_size_tokens=16))
    long = make_request("long", 7000, 1)
    scheduler.add_request(long)
    _simulate_step(scheduler)
    num_steps = 0
    while long.num_computed_tokens < long.num_prompt_tokens:
        num_steps += 1
        assert num_steps < 500, "the long prompt's prefill does not progress"
        short = make_request(f"short-{num_steps}", 2, 3)
        scheduler.add_request(short)
        decoding = [r for r in scheduler.running if r is not long]
        output, _ = _simulate_step(scheduler)
        grants = {item.request.request_id: item for item in output.scheduled}
        assert short.request_id in grants, f"step {num_steps}: the new request got no tokens"
        assert (grants[short.request_id].num_computed_tokens, grants[short.request_id].num_new_tokens) == (0, 2)
        assert all(grants[r.request_id].num_new_tokens == 1 for r in decoding)
        assert grants["long"].num_new_tokens > 0
        assert _work(grants["long"], config) <= config.max_prefill_chunk_work
        assert sum(_work(item, config) for item in output.scheduled) <= config.max_num_batched_tokens


def test_decode_tokens_go_before_prefill_chunks() -> None:
    """A request already generating gets its token even behind a prefill that could fill the step
    alone (a best_of candidate forked while a later prompt prefills, say)."""
    config = SchedulerConfig(max_num_batched_tokens=32, max_prefill_chunk_work=32)
    kv = KVCacheManager(num_blocks=64, block_size_tokens=4)
    scheduler = Scheduler(config, kv)
    long = make_request("long", 200, 1)
    scheduler.add_request(long)
    _simulate_step(scheduler)
    forked = make_request("forked", 4, 3)
    forked.output_token_ids.append(0)
    assert kv.allocate_slots("forked", 4)  # its prompt is in the cache, as a forked candidate's is
    forked.num_computed_tokens = 4
    scheduler.add_running(forked)
    output, _ = _simulate_step(scheduler)
    grants = {item.request.request_id: item.num_new_tokens for item in output.scheduled}
    assert grants["forked"] == 1 and grants["long"] > 0, grants


def test_newest_request_is_preempted_even_when_its_decode_was_scheduled_first() -> None:
    """Decodes are scheduled first, yet when an older prompt's chunk runs out of blocks the newest
    running request (a decode already in the step) is still the one preempted: its share goes back
    and the older prompt keeps the work it has done."""
    kv = KVCacheManager(num_blocks=6, block_size_tokens=4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_prefill_chunk_work=8), kv)
    long, short = make_request("long", 24, 1), make_request("short", 2, 10)
    scheduler.add_request(long)
    scheduler.add_request(short)
    _simulate_step(scheduler)  # long: 8 tokens in 2 blocks; short: its prompt in 1 block
    _simulate_step(scheduler)  # short decodes in its block; long: 8 more, 5 blocks of 6 in use
    output, _ = _simulate_step(scheduler)  # long's last chunk needs 2 more blocks, 1 is free
    assert [request.request_id for request in output.preempted] == ["short"]
    assert [(item.request.request_id, item.num_new_tokens) for item in output.scheduled] == [("long", 8)]
    assert long.num_computed_tokens == 24 and short.num_computed_tokens == 0
