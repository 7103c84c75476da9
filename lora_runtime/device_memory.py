"""How many bytes the KV cache and the adapter pool take on the engine's device.

On CPU the adapter pool keeps its configured size and the KV cache's comes from the memory budget
(`lora_runtime/memory_budget.py`): memory is committed as pages are first touched, so a size is a ceiling.
On CUDA memory is claimed whole at start, and whatever is left unclaimed sits idle, so the sizes
come from what the device has free once the weights are loaded (`torch.cuda.mem_get_info`): of
`gpu_memory_utilization` of the device's total, whatever the weights, other processes and this
process's allocator already hold is left out; the adapter pool keeps its configured size (how many
adapters stay resident is the operator's choice) up to half of what remains, and the KV cache takes
the rest. The other `1 - gpu_memory_utilization` of the device is the headroom for a step's
activations and the allocator's caching."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from lora_runtime.config import EngineConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MemorySizes:
    kv_cache_bytes: int
    adapter_pool_bytes: int


def sizes_from_free_memory(free_bytes: int, total_bytes: int, utilization: float, pool_bytes: int) -> MemorySizes:
    """The CUDA sizes for a device with `free_bytes` of `total_bytes` free (mem_get_info's pair).
    Raises ValueError when `utilization` of the device leaves nothing once the used memory is counted."""
    used = total_bytes - free_bytes  # the weights, other processes, this process's allocator
    budget = round(utilization * total_bytes) - used
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization {utilization} of {total_bytes} bytes leaves nothing for the KV "
                         f"cache and the adapter pool: {used} bytes are already in use on the device")
    pool = min(pool_bytes, budget // 2)
    return MemorySizes(kv_cache_bytes=budget - pool, adapter_pool_bytes=pool)


def sized_for_device(config: EngineConfig) -> EngineConfig:
    """`config` with the KV cache's and the adapter pool's bytes this device gets (unchanged off CUDA)."""
    device = torch.device(config.device)
    if device.type != "cuda":
        return config
    free, total = torch.cuda.mem_get_info(device)
    sizes = sizes_from_free_memory(free, total, config.kv_cache.gpu_memory_utilization,
                                   config.adapters.device_pool_bytes)
    logger.info("%s: %.1f of %.1f GiB free; KV cache %.1f GiB, adapter pool %.1f GiB", device, free / 2**30,
                total / 2**30, sizes.kv_cache_bytes / 2**30, sizes.adapter_pool_bytes / 2**30)
    return dataclasses.replace(
        config,
        kv_cache=dataclasses.replace(config.kv_cache, memory_bytes=sizes.kv_cache_bytes),
        adapters=dataclasses.replace(config.adapters, device_pool_bytes=sizes.adapter_pool_bytes),
    )
