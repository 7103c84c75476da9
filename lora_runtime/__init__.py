"""lora_runtime: a multi-adapter LLM engine over a paged KV cache with continuous batching."""
from lora_runtime.core import RequestOutput, SamplingParams
from lora_runtime.errors import EngineError, ValidationError

__all__ = ["EngineError", "RequestOutput", "SamplingParams", "ValidationError"]
