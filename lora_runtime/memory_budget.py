"""The host memory budget on CPU: weights + KV cache + adapter pools + overhead, within the memory available.

Decided before any weight is read, from what the checkpoint's headers say (safetensors headers, GGUF
tensor infos) and what the machine has left (MemAvailable, and the cgroup's limit less its usage,
cgroup v2 or v1). Unless the operator sizes the KV cache (`KVCacheConfig.memory_bytes` or
`num_blocks`), it takes what `host_memory_utilization` of the available memory leaves once the
weights, the adapter pools (the device pool and the host cache, both ceilings) and the overhead are
counted, and no more than the model can use (every sequence at its full context). When that is less
than `MIN_KV_CACHE_TOKENS`, the engine is refused with the numbers. Torch-free: it reads headers only.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lora_runtime.errors import EngineError
from lora_runtime.safetensors_header import read_safetensors_header

if TYPE_CHECKING:
    from lora_runtime.config import EngineConfig
    from lora_runtime.models.architectures import ModelShape

logger = logging.getLogger(__name__)

MIB = 1024 * 1024
ITEMSIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
Q8_0_BYTES_PER_WEIGHT = 34 / 32  # a block of 32 int8 weights and its float16 scale
# The interpreter, torch, the tokenizer and the HTTP service, before any model: ~300 MiB measured
# (`benchmarks.timing.rss_mib()` after importing server.app), plus allocator slack.
RUNTIME_OVERHEAD_BYTES = 512 * MIB
# The smallest cache served: one step's worth of tokens at the default step budget.
MIN_KV_CACHE_TOKENS = 2048
MEMINFO = Path("/proc/meminfo")
CGROUP_DIRS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory"))  # v2's files, then v1's
CGROUP_UNLIMITED = 1 << 62  # v1 writes "no limit" as a page-aligned 2**63 - 1


class MemoryBudgetError(EngineError):
    """The weights and the smallest KV cache do not fit in the memory available; raised before loading."""

    error_type = "validation"


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    weights_bytes: int
    kv_cache_bytes: int
    adapter_pool_bytes: int  # the device pool and the host cache of adapters
    overhead_bytes: int  # the runtime, a step's activations, the rotary tables
    available_bytes: int  # what the machine had for this process when the budget was made

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.adapter_pool_bytes + self.overhead_bytes

    def describe(self) -> str:
        parts = (("weights", self.weights_bytes), ("KV cache", self.kv_cache_bytes),
                 ("adapter pools", self.adapter_pool_bytes), ("overhead", self.overhead_bytes),
                 ("total", self.total_bytes), ("memory available", self.available_bytes))
        return "memory budget: " + ", ".join(f"{name} {size / MIB:.0f} MiB" for name, size in parts)


def memory_budget_for(config: EngineConfig, model_path: Path, dtype: str) -> MemoryBudget | None:
    """The budget of serving the checkpoint at `model_path` in `dtype` with `config`, None off CPU
    (device_memory.py sizes CUDA). Raises MemoryBudgetError when it does not fit, ValidationError
    for a model we do not serve; reads no weight."""
    if config.device != "cpu":
        return None
    weights_bytes = checkpoint_weights_bytes(model_path, dtype, config.quantization)  # a GGUF file checked first
    shape = read_model_shape(model_path)
    available = config.kv_cache.available_memory_bytes or available_memory_bytes()
    return plan_budget(config, shape, weights_bytes, ITEMSIZES[dtype], available)


def plan_budget(config: EngineConfig, shape: ModelShape, weights_bytes: int, itemsize: int,
                available_bytes: int) -> MemoryBudget:
    kv_config, adapters = config.kv_cache, config.adapters
    per_token = kv_bytes_per_token(shape, itemsize)
    pools = adapters.device_pool_bytes + adapters.host_cache_bytes
    overhead = overhead_bytes(config, shape)
    if kv_config.num_blocks is not None:
        kv_bytes = kv_config.num_blocks * kv_config.block_size_tokens * per_token
    elif kv_config.memory_bytes is not None:
        kv_bytes = kv_config.memory_bytes
    else:
        left = int(kv_config.host_memory_utilization * available_bytes) - weights_bytes - pools - overhead
        usable = config.scheduler.max_num_seqs * shape.max_model_len * per_token
        minimum = min(usable, MIN_KV_CACHE_TOKENS * per_token)
        if left < minimum:
            raise MemoryBudgetError(
                f"the model does not fit: weights {weights_bytes / MIB:.0f} MiB + adapter pools {pools / MIB:.0f} MiB "
                f"+ overhead {overhead / MIB:.0f} MiB + the smallest KV cache {minimum / MIB:.0f} MiB "
                f"({MIN_KV_CACHE_TOKENS} tokens) exceed {kv_config.host_memory_utilization:.0%} of the "
                f"{available_bytes / MIB:.0f} MiB available; lower the adapter pools or serve a smaller "
                f"or quantized model")
        kv_bytes = min(left, usable)
    return MemoryBudget(weights_bytes, kv_bytes, pools, overhead, available_bytes)


def kv_bytes_per_token(shape: ModelShape, itemsize: int) -> int:
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * itemsize


def overhead_bytes(config: EngineConfig, shape: ModelShape) -> int:
    """The runtime, plus what a full step allocates beside the weights and the cache, counted in
    float32 (the widest): its tokens' projections and MLP, every sequence's logits and their softmax,
    and the rotary tables."""
    step_width = shape.q_size + 2 * shape.kv_size + 2 * shape.intermediate_size + 4 * shape.hidden_size
    step = config.scheduler.max_num_batched_tokens * step_width * 4
    logits = config.scheduler.max_num_seqs * shape.vocab_size * 4 * 2
    rotary = shape.max_model_len * shape.head_dim * 4 * 2
    return RUNTIME_OVERHEAD_BYTES + step + logits + rotary


def read_model_shape(model_path: Path) -> ModelShape:
    """The model's shape from its config (config.json, or a GGUF file's metadata), refused by name
    when we do not serve it."""
    from lora_runtime.loader import read_hf_config
    from lora_runtime.models.architectures import model_shape_from_config

    if model_path.suffix.lower() == ".gguf":
        from lora_runtime.gguf_model import gguf_config

        return model_shape_from_config(gguf_config(model_path))
    return model_shape_from_config(read_hf_config(model_path))


def checkpoint_weights_bytes(model_path: Path, dtype: str, quantization: str | None = None) -> int:
    """The bytes the checkpoint's tensors take once loaded in `dtype`, from headers."""
    if model_path.suffix.lower() == ".gguf":
        return gguf_weights_bytes(model_path, dtype)
    itemsize = ITEMSIZES[dtype]
    numels = [(name, numel) for file in sorted(model_path.glob("*.safetensors"))
              for name, numel in safetensors_numels(file).items()]
    # Quantized at load (loader.py): the projections and the head; a tied embedding is the head.
    tied = not any(name.endswith("lm_head.weight") for name, _ in numels)
    total = 0.0
    for name, numel in numels:
        head = name.endswith("lm_head.weight") or (tied and name.endswith("embed_tokens.weight"))
        quantized = quantization == "q8_0" and (name.endswith("_proj.weight") or head)
        total += numel * (Q8_0_BYTES_PER_WEIGHT if quantized else itemsize)
    return int(total)


def safetensors_numels(file: Path) -> dict[str, int]:
    """Each tensor's element count, from the file's checked header alone: its data may be absent or
    cut short (the refusal before loading is made from headers only), none of it is read here."""
    return {name: entry.numel for name, entry in read_safetensors_header(file, data_in_file=False).items()}


def gguf_weights_bytes(path: Path, dtype: str) -> int:
    """Tensors of the block types our kernels multiply stay as they are in the file (the token
    embedding too: looked up by row from its blocks); dense ones, and blocks of other types (widened),
    are held in the model dtype, as gguf_model.py loads them. The file is memory-mapped, not read."""
    from kernels.quantized import BLOCK_TYPES
    from lora_runtime.dtypes import DTYPES
    from lora_runtime.gguf_model import GGUFTensors

    file = GGUFTensors(path, DTYPES[dtype], "cpu")  # refuses, by name, a file we cannot serve
    total = 0
    for tensor in file.tensor_infos:
        in_blocks = tensor.tensor_type.name in BLOCK_TYPES
        total += int(tensor.n_bytes) if in_blocks else int(tensor.n_elements) * ITEMSIZES[dtype]
    return total


def available_memory_bytes(meminfo: Path = MEMINFO, cgroup_dirs: tuple[Path, ...] = CGROUP_DIRS) -> int:
    """MemAvailable, or less where this process's cgroup has less headroom under its limit."""
    figures = [meminfo_available_bytes(meminfo)]
    figures += [headroom for directory in cgroup_dirs if (headroom := cgroup_headroom_bytes(directory)) is not None]
    return min(figures)


def meminfo_available_bytes(meminfo: Path) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # in kB
    raise AssertionError(f"{meminfo} has no MemAvailable line")


def cgroup_headroom_bytes(directory: Path) -> int | None:
    """The cgroup's limit less its usage, from `directory`'s v2 files (memory.max, memory.current) or
    v1 files (memory.limit_in_bytes, memory.usage_in_bytes); None without a limit or the files."""
    for limit_name, usage_name in (("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes")):
        limit_file, usage_file = directory / limit_name, directory / usage_name
        if limit_file.is_file() and usage_file.is_file():
            limit = limit_file.read_text().strip()
            if limit == "max" or int(limit) >= CGROUP_UNLIMITED:
                return None
            return max(0, int(limit) - int(usage_file.read_text().strip()))
    return None

