"""lora_runtime: a multi-adapter LLM engine over a paged KV cache with continuous batching.

Public API: `Engine`, `EngineConfig`, `SamplingParams`, `RequestOutput`, `AsyncEngine`,
`MergedAdapters`, `CacheScope` (whose cached prompt blocks a request may reuse), and
`detect_watermark` to check text for the `watermark` green list.

Names are imported on first use (PEP 562), so that importing the torch-free contract,
`lora_runtime.api`, does not load the engine and torch with it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from lora_runtime.lazy_exports import lazy_getattr

if TYPE_CHECKING:
    from lora_runtime.api import (CacheScope, EngineError, EngineStats, MergedAdapters, RequestOutput,
                                  SamplingParams, ValidationError)
    from lora_runtime.async_engine import AsyncEngine, RequestStream
    from lora_runtime.config import EngineConfig
    from lora_runtime.engine import Engine
    from lora_runtime.sampling.watermark import WatermarkDetection, detect_watermark

# Each public name -> the module that defines it.
_HOMES = {
    "AsyncEngine": "lora_runtime.async_engine",
    "CacheScope": "lora_runtime.api",
    "Engine": "lora_runtime.engine",
    "EngineConfig": "lora_runtime.config",
    "EngineError": "lora_runtime.api",
    "EngineStats": "lora_runtime.api",
    "MergedAdapters": "lora_runtime.api",
    "RequestOutput": "lora_runtime.api",
    "RequestStream": "lora_runtime.async_engine",
    "SamplingParams": "lora_runtime.api",
    "ValidationError": "lora_runtime.api",
    "WatermarkDetection": "lora_runtime.sampling.watermark",
    "detect_watermark": "lora_runtime.sampling.watermark",
}

__all__ = sorted(_HOMES)

__getattr__ = lazy_getattr(globals(), _HOMES)
