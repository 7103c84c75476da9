"""The adapter cache with no model: byte budget, pins, one load per key under concurrency, failed
loads that fail only their waiters, and leases that give their pin back exactly once."""
from __future__ import annotations

import random
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from lora_runtime.adapters import AdapterCache
from lora_runtime.errors import AdapterNotFoundError


class CountingLoader:
    """Loads `key` as a value of `sizes[key]` bytes, counting calls; optionally waits for a gate."""

    def __init__(self, sizes: dict[str, int], gate: threading.Event | None = None) -> None:
        self.sizes = sizes
        self.gate = gate
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __call__(self, key: str) -> tuple[str, int]:
        with self._lock:
            self.calls[key] += 1
        if self.gate is not None:
            assert self.gate.wait(timeout=10)
        if key.startswith("missing"):
            raise AdapterNotFoundError(f"adapter {key!r} not found")
        return key, self.sizes[key]

    def of(self, key: str):
        """The load of `key`, as `get_or_load` takes it."""
        return lambda: self(key)


def make_cache(max_bytes: int) -> AdapterCache:
    return AdapterCache(size_of=lambda value: value[1], max_bytes=max_bytes, num_workers=2)


def test_concurrent_first_requests_load_once() -> None:
    gate = threading.Event()
    loader = CountingLoader({"a": 10, "b": 10}, gate)
    cache = make_cache(max_bytes=100)
    with ThreadPoolExecutor(8) as callers:
        futures = list(callers.map(lambda i: cache.get_or_load("ab"[i % 2], loader.of("ab"[i % 2])), range(16)))
    assert not any(future.done() for future in futures)  # loading in the background
    gate.set()
    assert {future.result(timeout=10)[0] for future in futures} == {"a", "b"}
    assert loader.calls == Counter({"a": 1, "b": 1})
    assert cache.get_or_load("a", loader.of("a")).done()  # cached now: no new load
    assert loader.calls["a"] == 1
    cache.close()


def test_failed_load_fails_only_its_waiters_and_is_not_cached() -> None:
    gate = threading.Event()
    loader = CountingLoader({"a": 10}, gate)
    cache = make_cache(max_bytes=100)
    bad = [cache.get_or_load("missing", loader.of("missing"), pin=True) for _ in range(3)]
    good = cache.get_or_load("a", loader.of("a"))
    gate.set()
    for future in bad:
        with pytest.raises(AdapterNotFoundError):
            future.result(timeout=10)
    assert good.result(timeout=10) == ("a", 10)
    assert "missing" not in cache and cache.num_bytes == 10
    with pytest.raises(AdapterNotFoundError):
        cache.get_or_load("missing", loader.of("missing")).result(timeout=10)
    assert loader.calls["missing"] == 2  # tried again, not a cached failure
    cache.close()


def test_lru_eviction_by_bytes_skips_pinned() -> None:
    loader = CountingLoader({"a": 40, "b": 40, "c": 40, "d": 90})
    cache = make_cache(max_bytes=100)
    cache.get_or_load("a", loader.of("a"), pin=True).result(timeout=10)
    cache.get_or_load("b", loader.of("b")).result(timeout=10)
    cache.get_or_load("c", loader.of("c")).result(timeout=10)  # 120 > 100: b (oldest unpinned) goes, a is pinned
    assert cache.keys() == ["a", "c"] and cache.num_bytes == 80
    cache.get_or_load("d", loader.of("d")).result(timeout=10)  # 170: c goes, then d itself; only pinned a stays
    assert cache.keys() == ["a"] and cache.num_bytes == 40
    cache.unpin("a")
    assert not cache.is_pinned("a")
    cache.close()


def test_everything_pinned_may_exceed_the_budget_until_unpinned() -> None:
    loader = CountingLoader({"a": 60, "b": 60})
    cache = make_cache(max_bytes=100)
    cache.get_or_load("a", loader.of("a"), pin=True).result(timeout=10)
    cache.get_or_load("b", loader.of("b"), pin=True).result(timeout=10)
    assert cache.num_bytes == 120 and cache.keys() == ["a", "b"]
    cache.pin("a")
    cache.unpin("a")  # one pin of two released: still pinned
    assert set(cache.keys()) == {"a", "b"}
    cache.unpin("a")
    assert cache.keys() == ["b"] and cache.num_bytes == 60
    cache.close()


def test_invariants_under_random_concurrent_traffic() -> None:
    sizes = {f"k{i}": 5 + 7 * i for i in range(12)}
    loader = CountingLoader(sizes)
    cache = make_cache(max_bytes=120)

    def check(snapshot: list[tuple[str, int, int]], held: list[str]) -> None:
        assert set(held) <= {key for key, _, _ in snapshot}  # our pinned entries are never evicted
        total = sum(num_bytes for _, num_bytes, _ in snapshot)
        assert total == sum(sizes[key] for key, _, _ in snapshot)
        assert total <= cache.max_bytes or all(num_pins > 0 for _, _, num_pins in snapshot)

    def client(seed: int) -> None:
        rng, held = random.Random(seed), []
        for _ in range(80):
            key = rng.choice(list(sizes))
            assert cache.get_or_load(key, loader.of(key), pin=True).result(timeout=10) == (key, sizes[key])
            held.append(key)
            check(cache.snapshot(), held)
            if len(held) > 2:
                cache.unpin(held.pop(rng.randrange(len(held))))
                check(cache.snapshot(), held)
        for key in held:
            cache.unpin(key)

    with ThreadPoolExecutor(4) as clients:
        list(clients.map(client, range(4)))
    assert all(num_pins == 0 for _, _, num_pins in cache.snapshot())
    assert 0 < cache.num_bytes <= cache.max_bytes
    cache.close()


def test_a_lease_gives_its_pin_back_once_whenever_its_load_settles() -> None:
    gate = threading.Event()
    loader = CountingLoader({"a": 60, "b": 60}, gate)
    cache = make_cache(max_bytes=100)
    early = cache.lease("a", loader.of("a"))
    early.release()  # before the load finished: the pin goes when it does
    early.release()  # a second release gives nothing back twice
    held = cache.lease("a", loader.of("a"))
    gate.set()
    assert held.load.result(timeout=10) == ("a", 60)
    shared = held.share()
    assert cache.snapshot() == [("a", 60, 2)]
    held.release()
    shared.release()
    shared.release()
    assert cache.snapshot() == [("a", 60, 0)]
    cache.get_or_load("b", loader.of("b")).result(timeout=10)  # over budget: unpinned a is evicted
    assert cache.keys() == ["b"]
    cache.close()


def test_a_failed_load_leaves_its_lease_nothing_to_give_back() -> None:
    loader = CountingLoader({})
    cache = make_cache(max_bytes=100)
    lease = cache.lease("missing", loader.of("missing"))
    with pytest.raises(AdapterNotFoundError):
        lease.load.result(timeout=10)
    assert isinstance(lease.failure(), AdapterNotFoundError)
    lease.release()
    assert cache.snapshot() == []
    cache.close()
