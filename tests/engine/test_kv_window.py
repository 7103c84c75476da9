"""The KV cache with a window on every layer, with no model: the blocks before a request's window
are released as it advances (and counted), forks share only what is held, prefix-cached blocks are
released only once cached, and every block comes back when requests end."""
from __future__ import annotations

from lora_runtime.kv_cache import RELEASED_BLOCK, KVCacheManager


def test_blocks_before_the_window_are_released_and_positions_still_index_the_table() -> None:
    kv = KVCacheManager(num_blocks=12, block_size_tokens=4, window=5)
    assert kv.allocate_slots("a", 20)
    original = list(kv.block_table("a"))
    # The next token, at position 20, reads 16..20: blocks 0-3 (positions 0..15) are never read again.
    assert kv.release_outside_window("a", 20) == 4
    assert kv.block_table("a") == [RELEASED_BLOCK] * 4 + original[4:]
    assert kv.num_free_blocks == 12 - 1 and kv.num_released_outside_window == 4
    assert kv.release_outside_window("a", 21) == 0  # nothing new falls out until position 24's window
    assert kv.allocate_slots("a", 24) and kv.release_outside_window("a", 24) == 1
    kv.free("a")
    assert kv.num_free_blocks == 12


def test_a_fork_shares_only_the_blocks_its_parent_holds() -> None:
    kv = KVCacheManager(num_blocks=12, block_size_tokens=4, window=5)
    assert kv.allocate_slots("parent", 18)
    kv.release_outside_window("parent", 18)  # reads 14..: blocks 0-2 released
    kv.fork("parent", "child", 18)
    assert kv.block_table("child")[:3] == [RELEASED_BLOCK] * 3
    assert kv.block_table("child")[3] == kv.block_table("parent")[3]
    kv.free("parent")
    kv.free("child")
    assert kv.num_free_blocks == 12


def test_with_prefix_caching_a_block_is_released_once_cached() -> None:
    kv = KVCacheManager(num_blocks=12, block_size_tokens=4, enable_prefix_caching=True, window=5)
    assert kv.allocate_slots("a", 20)
    assert kv.release_outside_window("a", 20) == 0  # none is cached under its hash yet
    kv.register_full_blocks("a", [bytes([i]) for i in range(3)])
    assert kv.release_outside_window("a", 20) == 3
    assert kv.allocator.num_cached_blocks == 3  # released, still cached for another request's prefix
    kv.free("a")
    assert kv.num_free_blocks == 12


def test_without_a_window_nothing_is_released() -> None:
    kv = KVCacheManager(num_blocks=12, block_size_tokens=4)
    assert kv.allocate_slots("a", 40) and kv.release_outside_window("a", 40) == 0
