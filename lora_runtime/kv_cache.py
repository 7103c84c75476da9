"""Paged KV cache bookkeeping: a block allocator and per-request block tables. No tensors here:
the model runner owns the cache tensors; this module decides which block holds which tokens."""
from __future__ import annotations

from collections import deque


class BlockAllocator:
    """Fixed pool of block ids with reference counts (blocks may be shared, e.g. by best_of forks)."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks; the caller has checked `num_free_blocks` first."""
        assert count <= len(self._free), "allocate() called without enough free blocks"
        block_ids = [self._free.popleft() for _ in range(count)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def share(self, block_ids: list[int]) -> None:
        """Add one reference to each block (a second request now reads it too)."""
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, "sharing a free block"
            self._ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; a block returns to the pool at zero."""
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, "releasing a free block"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)


class KVCacheManager:
    """Per-request block tables over one `BlockAllocator`.

    Invariant: a request with `n` tokens in the cache owns exactly ceil(n / block_size) blocks
    once `allocate_slots` has been called for them.
    """

    def __init__(self, num_blocks: int, block_size_tokens: int) -> None:
        self.block_size_tokens = block_size_tokens
        self.allocator = BlockAllocator(num_blocks)
        self._block_tables: dict[str, list[int]] = {}

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

    def fork(self, parent_id: str, child_id: str, num_shared_tokens: int) -> None:
        """Give `child_id` the parent's full blocks covering `num_shared_tokens` (shared, read-only)."""
        num_full = num_shared_tokens // self.block_size_tokens
        shared = self._block_tables[parent_id][:num_full]
        self.allocator.share(shared)
        self._block_tables[child_id] = list(shared)

    def block_table(self, request_id: str) -> list[int]:
        return self._block_tables[request_id]

    def free(self, request_id: str) -> None:
        """Release every block of the request (finish, abort or preemption). Idempotent."""
        table = self._block_tables.pop(request_id, None)
        if table:
            self.allocator.release(table)
