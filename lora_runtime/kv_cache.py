"""Paged KV cache bookkeeping: a block allocator and per-request block tables. No tensors here:
the model runner owns the cache tensors; this module decides which block holds which tokens.

With prefix caching, a full block is registered under its hash (`lora_runtime.prefix_cache`) once
its K/V are computed; when its last reference goes it stays cached (evictable) instead of free, and a
later request whose prefix hashes alike takes it back. Allocation takes free blocks first, then
evicts the least recently released cached ones. One reference count serves requests sharing a
cached prefix and best_of forks sharing their prompt alike.

With a sliding window on every layer (Mistral, Phi-3, ...), the blocks wholly before the window of a
request's next token are never read again and are released as the request advances
(`release_outside_window`), so what a request holds is bounded by its window. Their entries stay in
the table, as `RELEASED_BLOCK`, so positions still index it: the kernels never read them (or, where
one gathers a whole table, mask them).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

# What a released entry of a block table holds: a real block id, so that a kernel that gathers a
# whole table (masking what lies outside the window) indexes the cache in bounds.
RELEASED_BLOCK = 0


class BlockAllocator:
    """Fixed pool of block ids with reference counts (blocks may be shared: best_of forks, prefixes),
    and the cached blocks: hash <-> block for full blocks, kept after release until evicted."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced: oldest first
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out: free ones and cached ones no request holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks, free ones first, then the least recently released cached ones (their
        hashes forgotten); the caller has checked `num_free_blocks` first."""
        assert count <= self.num_free_blocks, "allocate() called without enough free blocks"
        block_ids = []
        for _ in range(count):
            block_id = self._free.popleft() if self._free else self._evict()
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def _evict(self) -> int:
        block_id, _ = self._evictable.popitem(last=False)
        del self._block_of[self._hash_of.pop(block_id)]
        self.num_evictions += 1
        return block_id

    def share(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block (a second request now reads it too)."""
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, "sharing a free block"
            self._ref_counts[block_id] += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; at zero a cached block waits for reuse or eviction,
        any other returns to the pool."""
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, "releasing a free block"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if block_id in self._hash_of:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    def cached_block(self, block_hash: bytes) -> int | None:
        return self._block_of.get(block_hash)

    def take_cached(self, block_id: int) -> None:
        """One more reference to a cached block, which stops being evictable."""
        self._evictable.pop(block_id, None)
        self._ref_counts[block_id] += 1

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Cache a held, full block under its hash; a hash already cached keeps its first block (two
        requests computed the same prefix at once), and this one is freed as usual."""
        assert self._ref_counts[block_id] > 0, "registering a free block"
        if block_hash not in self._block_of and block_id not in self._hash_of:
            self._block_of[block_hash] = block_id
            self._hash_of[block_id] = block_hash


@dataclass(slots=True)
class PrefixCacheStats:
    """Counts since the start: the requests and tokens looked up in the cache, and what was found."""

    num_queried_requests: int = 0
    num_hit_requests: int = 0
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0


class KVCacheManager:
    """Per-request block tables over one `BlockAllocator`.

    Invariant: a request with `n` tokens in the cache owns exactly ceil(n / block_size) blocks
    once `allocate_slots` has been called for them.
    """

    def __init__(self, num_blocks: int, block_size_tokens: int, enable_prefix_caching: bool = False,
                 window: int | None = None) -> None:
        self.block_size_tokens = block_size_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window  # every layer attends to the last `window` positions only; None: all
        self.num_released_outside_window = 0
        self._num_released: dict[str, int] = {}  # leading entries of each table released (window)
        self.allocator = BlockAllocator(num_blocks)
        self.prefix_stats = PrefixCacheStats()
        self._block_tables: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks of each table already cached

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def num_blocks_needed(self, request_id: str, num_total_tokens: int) -> int:
        """Blocks to add so that the request can hold `num_total_tokens` tokens."""
        owned = len(self._block_tables.get(request_id, ()))
        wanted = -(-num_total_tokens // self.block_size_tokens)
        return max(0, wanted - owned)

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> bool:
        """Grow the request's table to hold `num_total_tokens`; False (and no change) if blocks run out."""
        needed = self.num_blocks_needed(request_id, num_total_tokens)
        if needed > self.allocator.num_free_blocks:
            return False
        table = self._block_tables.setdefault(request_id, [])
        table.extend(self.allocator.allocate(needed))
        return True

    def match_prefix(self, request_id: str, block_hashes: Sequence[bytes], num_tokens: int) -> int:
        """Give a request that holds no blocks the longest run of cached blocks that starts its
        `block_hashes`; returns how many. `num_tokens` is its length, for the hit-rate counts."""
        assert request_id not in self._block_tables, "a prefix is matched before any block is allocated"
        matched = []
        for block_hash in block_hashes:
            block_id = self.allocator.cached_block(block_hash)
            if block_id is None:
                break
            self.allocator.take_cached(block_id)
            matched.append(block_id)
        if matched:
            self._block_tables[request_id] = matched
            self._num_registered[request_id] = len(matched)
        stats = self.prefix_stats
        stats.num_queried_requests += 1
        stats.num_queried_tokens += num_tokens
        stats.num_hit_requests += bool(matched)
        stats.num_hit_tokens += len(matched) * self.block_size_tokens
        return len(matched)

    def num_registered_blocks(self, request_id: str) -> int:
        return self._num_registered.get(request_id, 0)

    def register_full_blocks(self, request_id: str, block_hashes: Sequence[bytes]) -> None:
        """Cache the request's leading blocks under `block_hashes` (their K/V are computed)."""
        table = self._block_tables[request_id]
        for index in range(self.num_registered_blocks(request_id), len(block_hashes)):
            self.allocator.register(table[index], block_hashes[index])
        self._num_registered[request_id] = len(block_hashes)

    def fork(self, parent_id: str, child_id: str, num_shared_tokens: int) -> None:
        """Give `child_id` the parent's full blocks covering `num_shared_tokens` (shared, read-only)."""
        num_full = num_shared_tokens // self.block_size_tokens
        released = min(self._num_released.get(parent_id, 0), num_full)
        shared = self._block_tables[parent_id][released:num_full]
        self.allocator.share(shared)
        self._block_tables[child_id] = [RELEASED_BLOCK] * released + list(shared)
        if released:
            self._num_released[child_id] = released

    def release_outside_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Release the request's leading blocks that no later token reads: its next token sits at
        position `num_computed_tokens` and reads the `window` positions up to it, later ones less far
        back. With prefix caching, a block is kept until it is cached under its hash (then released,
        it stays cached for other requests). Returns how many blocks were released."""
        table = self._block_tables.get(request_id)
        if self.window is None or not table:
            return 0
        first_read = max(0, num_computed_tokens - self.window + 1)
        releasable = min(first_read // self.block_size_tokens, len(table))
        if self.enable_prefix_caching:
            releasable = min(releasable, self.num_registered_blocks(request_id))
        done = self._num_released.get(request_id, 0)
        if releasable <= done:
            return 0
        self.allocator.release(table[done:releasable])
        table[done:releasable] = [RELEASED_BLOCK] * (releasable - done)
        self._num_released[request_id] = releasable
        self.num_released_outside_window += releasable - done
        return releasable - done

    def block_table(self, request_id: str) -> list[int]:
        return self._block_tables[request_id]

    def free(self, request_id: str) -> None:
        """Release every block of the request (finish, abort or preemption). Idempotent."""
        self._num_registered.pop(request_id, None)
        released = self._num_released.pop(request_id, 0)
        table = self._block_tables.pop(request_id, None)
        if table:
            self.allocator.release(table[released:])
