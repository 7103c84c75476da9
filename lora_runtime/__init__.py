"""lora_runtime: a multi-adapter LLM engine over a paged KV cache with continuous batching.

Public API: `Engine`, `EngineConfig`, `SamplingParams`, `RequestOutput`, `AsyncEngine`,
`MergedAdapters`, `CacheScope` (whose cached prompt blocks a request may reuse), and
`detect_watermark` to check text for the `watermark` green list.
"""
from lora_runtime.adapters.merge import MergedAdapters
from lora_runtime.async_engine import AsyncEngine, EngineStats, RequestStream
from lora_runtime.config import EngineConfig
from lora_runtime.core import CacheScope, RequestOutput, SamplingParams
from lora_runtime.engine import Engine
from lora_runtime.errors import EngineError, ValidationError
from lora_runtime.sampling.watermark import WatermarkDetection, detect_watermark

__all__ = [
    "AsyncEngine",
    "CacheScope",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineStats",
    "MergedAdapters",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "ValidationError",
    "WatermarkDetection",
    "detect_watermark",
]
