"""The device's adapter page pool with no model: an adapter owns ceil(rank / 16) pages per module it
adapts and nothing else, pages have one owner, pinned adapters are never evicted, idle ones are
evicted least recently used first and only when their pages are needed, and a reservation that does
not fit changes nothing."""
from __future__ import annotations

import random

from lora_runtime.adapters.pages import AdapterPagePool

MODULES = ("q_proj", "v_proj", "down_proj")


def pool_of(num_pages: int, ranks: dict[str, dict[str, int]]) -> AdapterPagePool:
    return AdapterPagePool(num_pages, MODULES, ranks.get)


def owners(pool: AdapterPagePool, keys) -> dict[tuple[str, int], str]:
    """(module, page) -> its resident owner; fails on a page owned twice."""
    owned = {}
    for key in keys:
        if pool.is_resident(key):
            for module, run in pool.placement(key).modules.items():
                for page in run.pages:
                    assert (module, page) not in owned, f"page {module}/{page} has two owners"
                    owned[module, page] = key
    return owned


def test_an_adapter_costs_its_own_rank_in_the_modules_it_adapts() -> None:
    ranks = {"r8": {"q_proj": 8, "v_proj": 8}, "r33": {"q_proj": 33, "v_proj": 16, "down_proj": 64}}
    pool = pool_of(8, ranks)
    assert pool.is_loaded("r8") and not pool.is_loaded("unknown")
    assert pool.reserve("r8") and pool.reserve("r33")
    small, large = pool.placement("r8"), pool.placement("r33")
    assert {m: len(run.pages) for m, run in small.modules.items()} == {"q_proj": 1, "v_proj": 1}
    assert {m: (run.rank, len(run.pages)) for m, run in large.modules.items()} == {
        "q_proj": (33, 3), "v_proj": (16, 1), "down_proj": (64, 4)}
    assert pool.num_free_pages == {"q_proj": 4, "v_proj": 6, "down_proj": 4}
    assert len(owners(pool, ranks)) == small.num_pages + large.num_pages == 10


def test_pinned_adapters_stay_and_a_reservation_that_does_not_fit_changes_nothing() -> None:
    ranks = {"a": {"q_proj": 64}, "b": {"q_proj": 64}, "c": {"q_proj": 16}}
    pool = pool_of(8, ranks)
    assert pool.reserve("a") and pool.reserve("b")
    before = (pool.placement("a"), pool.placement("b"), pool.num_free_pages)
    assert not pool.reserve("c")  # both pinned, nothing free
    assert (pool.placement("a"), pool.placement("b"), pool.num_free_pages) == before
    assert not pool.is_resident("c")
    pool.release("a")  # idle now: its pages may go
    assert pool.reserve("c") and not pool.is_resident("a") and pool.is_resident("b")
    assert pool.num_pinned == 2 and pool.num_resident == 2


def test_idle_adapters_stay_resident_and_go_least_recently_used_first() -> None:
    ranks = {key: {"q_proj": 16} for key in "abcd"}
    pool = pool_of(3, ranks)
    for key in "abc":
        assert pool.reserve(key)
    placed_b = pool.placement("b")
    for key in "bac":  # released in this order: b is the least recently used
        pool.release(key)
    assert pool.reserve("b") and pool.placement("b") == placed_b  # still resident: not placed again
    pool.release("b")
    assert pool.reserve("d")  # evicts a, now the least recently used
    assert not pool.is_resident("a") and all(pool.is_resident(key) for key in "bcd")


def test_eviction_frees_only_what_the_newcomer_lacks() -> None:
    """An idle adapter of other modules is not evicted for a newcomer that does not need its pages."""
    ranks = {"mlp": {"down_proj": 16}, "attn": {"q_proj": 32}, "new": {"q_proj": 16}}
    pool = pool_of(2, ranks)
    assert pool.reserve("mlp") and pool.reserve("attn")
    pool.release("mlp")
    pool.release("attn")
    assert pool.reserve("new")
    assert pool.is_resident("mlp") and not pool.is_resident("attn")


def test_invariants_under_random_traffic() -> None:
    rng = random.Random(0)
    ranks = {f"k{i}": {m: rng.choice([0, 8, 16, 17, 33, 64]) for m in MODULES} for i in range(30)}
    ranks["k0"] = {m: 64 for m in MODULES}
    pool = pool_of(12, ranks)
    pins: dict[str, int] = {}
    for _ in range(3000):
        key = rng.choice(list(ranks))
        if pins.get(key) and rng.random() < 0.5:
            pool.release(key)
            pins[key] -= 1
            continue
        resident = {k: pool.placement(k) for k in ranks if pool.is_resident(k)}
        free = pool.num_free_pages
        if pool.reserve(key):
            pins[key] = pins.get(key, 0) + 1
            for module, rank in ranks[key].items():
                run = pool.placement(key).modules.get(module)
                assert (run.rank, len(run.pages)) == (rank, -(-rank // 16)) if rank else run is None
        else:  # nothing changed
            assert {k: pool.placement(k) for k in ranks if pool.is_resident(k)} == resident
            assert pool.num_free_pages == free
        assert all(pool.is_resident(k) for k, n in pins.items() if n)  # pinned never evicted
        owned = owners(pool, ranks)
        for module in MODULES:
            used = sum(1 for (m, _) in owned if m == module)
            assert used + pool.num_free_pages[module] == pool.num_pages


def test_an_adapter_takes_one_run_of_pages_where_the_pool_has_one() -> None:
    """Eviction leaves holes; a newcomer takes the lowest run of consecutive pages that holds it rather
    than the lowest pages, so the op reads its pages as one run of memory."""
    ranks = {"a": {"q_proj": 16}, "b": {"q_proj": 16}, "c": {"q_proj": 32}, "d": {"q_proj": 16},
             "e": {"q_proj": 32}, "f": {"q_proj": 32}}
    pool = pool_of(5, ranks)
    for key in "abcd":
        assert pool.reserve(key)
    assert [pool.placement(key).modules["q_proj"].pages for key in "abcd"] == [(0,), (1,), (2, 3), (4,)]
    pool.release("a")
    pool.release("c")
    assert pool.reserve("e")  # evicts a, then c: pages 0, 2 and 3 free
    assert pool.placement("e").modules["q_proj"].pages == (2, 3)
    assert pool.num_free_pages["q_proj"] == 1
    pool.release("d")
    assert pool.reserve("f")  # evicts d: pages 0 and 4 free, no run of two, so the lowest two
    assert pool.placement("f").modules["q_proj"].pages == (0, 4)
    assert len(owners(pool, ranks)) == 5
