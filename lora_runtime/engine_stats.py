"""`Engine.stats()`'s reading: the engine's resources (KV blocks, prefix cache, adapter tiers) beside
what its loop has counted (`LoopActivity`), as one `EngineStats`. Every read is a size or a snapshot
taken under its owner's lock, so it is safe from any thread."""
from __future__ import annotations

from dataclasses import dataclass

from lora_runtime.adapters.manager import AdapterManager
from lora_runtime.adapters.refs import AdapterKey
from lora_runtime.api import EngineStats
from lora_runtime.kv_cache import KVCacheManager


@dataclass(frozen=True, slots=True)
class LoopActivity:
    """What the thread that steps the engine has seen: its queues (waiting including requests not
    queued yet) and its counts since the start."""

    num_running: int
    num_waiting: int
    num_steps: int
    num_generated_tokens: int
    num_finished_requests: int
    running_adapters: tuple[AdapterKey, ...]
    waiting_adapters: tuple[AdapterKey, ...]


def engine_stats(activity: LoopActivity, kv_cache: KVCacheManager, num_preemptions: int,
                 adapters: AdapterManager) -> EngineStats:
    prefix = kv_cache.prefix_stats
    cached = adapters.host.snapshot()  # (key, bytes, pins) per entry
    pages = adapters.pages
    return EngineStats(
        num_running=activity.num_running,
        num_waiting=activity.num_waiting,
        num_free_blocks=kv_cache.num_free_blocks,
        num_total_blocks=kv_cache.num_blocks,
        kv_cache_usage_ratio=1 - kv_cache.num_free_blocks / kv_cache.num_blocks,
        num_steps=activity.num_steps,
        num_generated_tokens=activity.num_generated_tokens,
        num_finished_requests=activity.num_finished_requests,
        num_preemptions=num_preemptions,
        num_cached_adapters=len(cached),
        num_pinned_adapters=sum(1 for _, _, pins in cached if pins),
        adapter_cache_bytes=sum(num_bytes for _, num_bytes, _ in cached),
        num_resident_adapters=pages.num_resident,
        num_free_adapter_pages=min(pages.num_free_pages.values()),
        num_total_adapter_pages=pages.num_pages,
        max_resident_adapters=pages.capacity_for_rank(adapters.config.max_rank),
        prefix_cache_queried_requests=prefix.num_queried_requests,
        prefix_cache_hit_requests=prefix.num_hit_requests,
        prefix_cache_queried_tokens=prefix.num_queried_tokens,
        prefix_cache_hit_tokens=prefix.num_hit_tokens,
        num_cached_kv_blocks=kv_cache.allocator.num_cached_blocks,
        num_evicted_kv_blocks=kv_cache.allocator.num_evictions,
        running_adapters=activity.running_adapters,
        waiting_adapters=activity.waiting_adapters,
    )
