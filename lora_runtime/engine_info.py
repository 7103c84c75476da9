"""What a front end reads of an engine it may not hold: names, limits, the tokenizer and the shape
uploaded adapters must fit. Picklable, so that an HTTP process can serve engines that run in other
processes (server.cluster) exactly as it serves its own."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lora_runtime.config import EngineConfig
from lora_runtime.memory_budget import MemoryBudget


@dataclass(frozen=True, slots=True)
class BaseModelShape:
    """What an adapter must fit: the base model's name, depth and per-module linear shapes
    `module name -> (in_features, out_features)`."""

    model_name: str
    num_layers: int
    module_shapes: Mapping[str, tuple[int, int]]

    @classmethod
    def from_hf_config(cls, model_name: str, config: Mapping[str, Any]) -> BaseModelShape:
        """Build from a Llama-family HF `config.json` dictionary."""
        hidden = config["hidden_size"]
        num_heads = config["num_attention_heads"]
        num_kv_heads = config.get("num_key_value_heads") or num_heads
        head_dim = config.get("head_dim") or hidden // num_heads
        intermediate = config["intermediate_size"]
        q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
        shapes = {
            "q_proj": (hidden, q_out),
            "k_proj": (hidden, kv_out),
            "v_proj": (hidden, kv_out),
            "o_proj": (q_out, hidden),
            "gate_proj": (hidden, intermediate),
            "up_proj": (hidden, intermediate),
            "down_proj": (intermediate, hidden),
        }
        return cls(model_name, config["num_hidden_layers"], shapes)


@dataclass(frozen=True, slots=True)
class AdapterLimits:
    """Configured ceilings: adapters above either are refused as incompatible."""

    max_rank: int = 64
    max_bytes: int = 512 * 1024 * 1024

    def __post_init__(self) -> None:
        assert self.max_rank > 0 and self.max_bytes > 0


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model_name: str
    max_model_len: int
    config: EngineConfig
    dtype_name: str
    kernel_backend: str  # the kernel backend's label, e.g. "cpu/avx2"
    tokenizer: Any  # a transformers tokenizer
    adapter_shape: BaseModelShape
    adapter_limits: AdapterLimits
    num_threads: int  # the engine's compute threads
    memory_budget: MemoryBudget | None = None  # on CPU; None on CUDA (device_memory.py sizes it)
