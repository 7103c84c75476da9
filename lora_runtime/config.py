"""Engine configuration: one frozen `EngineConfig` made of small frozen sub-configs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["q8_0"]
QUANTIZATIONS: tuple[str, ...] = ("q8_0",)


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """Paged KV cache capacity: `num_blocks` wins when given, else `memory_bytes` is divided into blocks.
    On CPU `memory_bytes=None` sizes the cache from the memory left (`lora_runtime/memory_budget.py`):
    `host_memory_utilization` of the memory available (`available_memory_bytes`, None: MemAvailable
    and the cgroup's headroom, read at start) less the weights, the adapter pools and the overhead,
    and no more than every sequence at full context uses. On CUDA `memory_bytes` is not read: the
    cache takes what `gpu_memory_utilization` of the device leaves once the weights and the adapter
    pool are placed (`lora_runtime/device_memory.py`).

    `enable_prefix_caching`: full blocks stay reusable after their request ends, found by a hash chain
    of their tokens and the adapter identity, so a request sharing a prefix with an earlier one (same
    adapter, same weights) computes only the rest (`lora_runtime/prefix_cache.py`). Blocks are
    reused only within a request's `CacheScope`: its tenant, and its `cache_salt` when it sends one.

    `share_base_prefix_cache`: the base model's blocks are shared by all tenants (those of adapters
    and of salted requests never are), for tenants that trust each other: a prompt sent by one is
    then cheaper for the others, and any tenant can tell, from `cached_tokens` or the time to the
    first token, whether another has sent a given prefix (a system prompt, a document, a secret
    guessed block by block)."""

    block_size_tokens: int = 16
    num_blocks: int | None = None
    memory_bytes: int | None = None
    host_memory_utilization: float = 0.9
    available_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    share_base_prefix_cache: bool = False

    def __post_init__(self) -> None:
        assert self.block_size_tokens > 0, "block_size_tokens must be positive"
        assert self.num_blocks is None or self.num_blocks > 0, "num_blocks must be positive"
        assert 0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]"
        assert 0.0 < self.host_memory_utilization <= 1.0, "host_memory_utilization must be in (0, 1]"
        assert self.memory_bytes is None or self.memory_bytes > 0, "memory_bytes must be positive"


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Per-step budgets. Work and sequences are each capped per step; distinct adapters are not:
    any number run in one step, as many as the device's adapter pages hold (`AdapterConfig`).

    Work is counted in token-equivalents, so that a budget bounds a step's time and not only its
    tokens: a chunk of `n` tokens after `c` computed ones costs `n` (projections and MLP, the same
    per token) plus its `n*c + n*(n+1)/2` query-key pairs of attention divided by
    `attention_pairs_per_token`. On a CPU the attention dominates long prompts: a 2048-token chunk
    of a 7,000-token prompt took ~3 s after no context and 8-11 s after 4096 tokens (one thread).
    """

    # A step's work budget; a step never holds more tokens than this either. 2048 lets a burst of
    # prompts prefill in few large steps, where the CPU's matrix units are efficient (64 prompts of
    # 20-60 tokens: +15% end-to-end throughput against 512, measured).
    max_num_batched_tokens: int = 2048
    # Query-key pairs of attention that cost as much as one token's projections and MLP: for the
    # embedded model on one CPU thread in bf16, a token costs ~0.6-1 ms and a pair ~0.6-1 us.
    # Re-measure by timing `Engine.step` on one chunk of n tokens after c computed ones, for n and c
    # from 16 to 4096: the ratio of the per-token to the per-pair cost.
    attention_pairs_per_token: int = 1024
    # One request's chunk gets at most this much work: a long prompt's prefill then leaves room in
    # every step for requests arriving meanwhile, and a step carrying it stays short, which also
    # bounds how long an abort waits for the step in flight. It trades step length against the
    # fixed cost of a step (~15 ms here): at 256 a 7,000-token prompt prefilled in 122 steps of
    # 0.13-0.39 s (one CPU thread, bf16), in the same total time as in 2048-token chunks.
    max_prefill_chunk_work: int = 256
    max_num_seqs: int = 64
    # Requests waiting longer than this many steps are admitted before newer ones of popular
    # adapters, so an unpopular adapter is never starved.
    max_wait_steps_before_priority: int = 32

    def __post_init__(self) -> None:
        assert self.max_num_batched_tokens > 0 and self.max_num_seqs > 0
        assert self.attention_pairs_per_token > 0 and self.max_prefill_chunk_work > 0


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """Adapter limits and the memory of each tier (lora_runtime/adapters/manager.py).

    `max_rank` and `max_adapter_bytes` refuse adapters above them. `device_pool_bytes` is the memory
    the kernels read adapters from, in pages of 16 rank rows per module: an adapter occupies its own
    rank (rounded up to 16), so it holds ~25 adapters of rank 64 on every module of the embedded model
    in bf16, ~100 of rank 16 (float32: half). On CPU the pool's memory is committed only as pages are
    first written, and that first write pays the OS's first touch (on the VMs this was measured on,
    ~40x the copy: ~50 ms for a rank-32 adapter on every module), once per page per process.
    `host_cache_bytes` bounds the loaded adapters kept in host memory beyond those in use."""

    max_rank: int = 64
    device_pool_bytes: int = 1024 * 1024 * 1024
    host_cache_bytes: int = 1024 * 1024 * 1024
    max_adapter_bytes: int = 512 * 1024 * 1024
    allow_local_paths: bool = True
    num_loader_threads: int = 2


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """Request limits of docs/api.md section 2."""

    max_stop_sequences: int = 4
    max_best_of: int = 4
    max_input_length: int | None = None  # None: the model's context minus one token


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs. `model=None` is the embedded SmolLM2-135M-Instruct, its GGUF file
    (Q4_1 projections, a Q8_0 embedding) served as it is; `model` names a Hugging Face directory or a
    .gguf file.

    `dtype="auto"`: bf16 where the device multiplies it at least as fast as float32 (CUDA; CPUs with
    AVX-512), float32 elsewhere (`lora_runtime.dtypes`); tests that compare with HF logits use float32.
    `kernel_backend`: None picks by device (`kernels.backend_for`); "cpu", "torch" or "triton" force one.
    `quantization`: "q8_0" quantizes a Hugging Face checkpoint's projections to Q8_0 blocks while loading
    it (kernels/quantized.py; None: kept in `dtype`); a GGUF file keeps its own types.
    `num_threads`: the compute threads (PyTorch's pool, which the compiled CPU ops share); None:
    OMP_NUM_THREADS where set, else one per physical core of the process's affinity mask
    (`lora_runtime.threads`).
    """

    model: str | None = None
    dtype: Dtype = "auto"
    device: str = "cpu"
    kernel_backend: str | None = None
    num_threads: int | None = None
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    adapters: AdapterConfig = field(default_factory=AdapterConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    quantization: Quantization | None = None

    def __post_init__(self) -> None:
        assert self.num_threads is None or self.num_threads >= 1
