"""A host-memory adapter cache: least-recently-used eviction by bytes, pins, background loads.

Invariants (checked by tests/adapters/test_cache.py):
- the cached bytes stay within `max_bytes`, unless every entry left is pinned;
- a pinned entry is never evicted;
- concurrent first requests for one key run its loader once and all get the same value;
- a failed load fails only the requests waiting for it and caches nothing, so a later request
  tries again;
- nothing is kept for a key but its entry and, while it loads, its future.
Keys are whatever identifies an adapter (`refs.AdapterKey`): hashable. Holders take pins through
`lease`: an `AdapterLease` is released exactly once, whenever its load settles."""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

Key = TypeVar("Key", bound=Hashable)
Value = TypeVar("Value")


@dataclass(slots=True)
class _Entry(Generic[Value]):
    value: Value
    num_bytes: int
    num_pins: int = 0


class AdapterCache(Generic[Key, Value]):
    """Values produced by each key's `load()` on a small thread pool, sized by `size_of(value)`."""

    def __init__(self, size_of: Callable[[Value], int], max_bytes: int, num_workers: int = 2) -> None:
        assert max_bytes > 0 and num_workers > 0
        self._size_of = size_of
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[Key, _Entry[Value]] = OrderedDict()  # oldest use first
        self._loading: dict[Key, tuple[Future[Value], int]] = {}  # key -> (future, pins asked)
        self._num_bytes = 0
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="adapter-load")

    def lease(self, key: Key, load: Callable[[], Value]) -> AdapterLease[Key, Value]:
        """A pin on `key`'s value, loaded by `load()` if it is neither cached nor loading."""
        return AdapterLease(self, key, self.get_or_load(key, load, pin=True))

    def get_or_load(self, key: Key, load: Callable[[], Value], pin: bool = False) -> Future[Value]:
        """A future of the value: done at once when cached, else shared with the load in flight
        (started here with `load` if none is). With `pin`, the entry is pinned as soon as it is
        cached (before any eviction can touch it); the caller then owes one `unpin`, unless the
        future fails."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                entry.num_pins += int(pin)
                done: Future[Value] = Future()
                done.set_result(entry.value)
                return done
            if key in self._loading:
                future, num_pins = self._loading[key]
                self._loading[key] = (future, num_pins + int(pin))
                return future
            future = Future()
            self._loading[key] = (future, int(pin))
        self._executor.submit(self._load, key, load, future)
        return future

    def pin(self, key: Key) -> None:
        """Protect a cached entry from eviction (pins count: one `unpin` per `pin`)."""
        with self._lock:
            self._entries[key].num_pins += 1
            self._entries.move_to_end(key)

    def unpin(self, key: Key) -> None:
        with self._lock:
            entry = self._entries[key]
            assert entry.num_pins > 0, f"unpin of an unpinned adapter {key!r}"
            entry.num_pins -= 1
            self._evict_over_budget()

    def get(self, key: Key) -> Value | None:
        """The cached value, or None; counts as a use."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry.value

    def is_pinned(self, key: Key) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            return entry is not None and entry.num_pins > 0

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def keys(self) -> list[Key]:
        """Cached keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def snapshot(self) -> list[tuple[Key, int, int]]:
        """(key, num_bytes, num_pins) of every entry, least recently used first, read atomically."""
        with self._lock:
            return [(key, entry.num_bytes, entry.num_pins) for key, entry in self._entries.items()]

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _load(self, key: Key, load: Callable[[], Value], future: Future[Value]) -> None:
        try:
            value = load()
            num_bytes = self._size_of(value)
        except BaseException as error:  # noqa: BLE001 - handed to the waiters, never swallowed
            with self._lock:
                del self._loading[key]
            logger.info("adapter %r failed to load: %s", key, error)
            future.set_exception(error)
            return
        with self._lock:
            _, num_pins = self._loading.pop(key)
            self._entries[key] = _Entry(value, num_bytes, num_pins)
            self._num_bytes += num_bytes
            self._evict_over_budget()
        future.set_result(value)

    def _evict_over_budget(self) -> None:
        """Drop least recently used unpinned entries until within budget (lock held)."""
        if self._num_bytes <= self.max_bytes:
            return
        for key in [key for key, entry in self._entries.items() if entry.num_pins == 0]:
            entry = self._entries.pop(key)
            self._num_bytes -= entry.num_bytes
            logger.debug("evicted adapter %r (%d bytes)", key, entry.num_bytes)
            if self._num_bytes <= self.max_bytes:
                return


class AdapterLease(Generic[Key, Value]):
    """One holder's pin on a cache entry, taken when the load was asked for: the holder (a request)
    hands it on rather than taking another, and `release` gives it back exactly once, at once when
    the load has succeeded, when it does otherwise (a failed load holds no pin)."""

    __slots__ = ("_cache", "key", "load", "_released")

    def __init__(self, cache: AdapterCache[Key, Value], key: Key, load: Future[Value]) -> None:
        self._cache = cache
        self.key = key
        self.load = load
        self._released = False

    def failure(self) -> BaseException | None:
        """The load's error once it has failed, else None."""
        return self.load.exception() if self.load.done() else None

    def share(self) -> AdapterLease[Key, Value]:
        """Another pin on the same loaded entry, for another holder (a best_of candidate)."""
        assert self.load.done() and self.load.exception() is None, "only a loaded adapter is shared"
        self._cache.pin(self.key)
        return AdapterLease(self._cache, self.key, self.load)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.load.add_done_callback(lambda done: self._cache.unpin(self.key) if done.exception() is None else None)
