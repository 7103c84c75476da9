"""The KV cache's and the adapter pool's bytes on CUDA, from a device's free and total memory (the pair
`torch.cuda.mem_get_info` returns), and the configured sizes everywhere else."""
from __future__ import annotations

import pytest

from lora_runtime.config import AdapterConfig, EngineConfig, KVCacheConfig
from lora_runtime.device_memory import MemorySizes, sized_for_device, sizes_from_free_memory

GIB = 2**30


def test_the_kv_cache_takes_what_utilization_leaves_after_the_pool() -> None:
    # 80 GiB device, 78 free after the weights: 0.9 * 80 = 72 usable, 2 in use -> 70 for both.
    sizes = sizes_from_free_memory(78 * GIB, 80 * GIB, 0.9, pool_bytes=1 * GIB)
    assert sizes == MemorySizes(kv_cache_bytes=69 * GIB, adapter_pool_bytes=1 * GIB)
    assert sizes.kv_cache_bytes + sizes.adapter_pool_bytes + 2 * GIB == pytest.approx(0.9 * 80 * GIB, abs=1)


def test_the_pool_gets_at_most_half_of_what_is_left() -> None:
    sizes = sizes_from_free_memory(10 * GIB, 16 * GIB, 1.0, pool_bytes=8 * GIB)
    assert sizes == MemorySizes(kv_cache_bytes=5 * GIB, adapter_pool_bytes=5 * GIB)


def test_a_device_already_full_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.5 .* already in use"):
        sizes_from_free_memory(30 * GIB, 80 * GIB, 0.5, pool_bytes=GIB)


def test_off_cuda_the_configured_sizes_stand() -> None:
    config = EngineConfig(kv_cache=KVCacheConfig(memory_bytes=3 * GIB), adapters=AdapterConfig(device_pool_bytes=GIB))
    assert sized_for_device(config) is config
