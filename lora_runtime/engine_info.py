"""What a front end reads of an engine it may not hold: names, limits, the tokenizer and the shape
uploaded adapters must fit. Picklable, so that an HTTP process can serve engines that run in other
processes (server.cluster) exactly as it serves its own."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lora_runtime.adapters.weights import AdapterLimits, BaseModelShape
from lora_runtime.config import EngineConfig


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
