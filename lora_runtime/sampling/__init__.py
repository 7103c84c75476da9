"""Sampling: the logits chain, per-request sampling state, schema constraints, watermark, stop
criteria, incremental detokenisation and chat prompts. Engine-independent: tensors and tokenizers in,
token ids and text out.

Names are imported on first use (PEP 562), so that the torch-free modules the contract re-exports
(`tools`, `response_format`) import without the sampler and torch."""
from __future__ import annotations

from typing import TYPE_CHECKING

from lora_runtime.lazy_exports import lazy_getattr

if TYPE_CHECKING:
    from lora_runtime.sampling.chat import render_chat_prompt
    from lora_runtime.sampling.response_format import schema_from_response_format
    from lora_runtime.sampling.sampler import (SampleResult, Sampler, SamplingState, TokenizerInfo,
                                               next_token_logprobs, prompt_logprobs)
    from lora_runtime.sampling.stop import StopCriteria
    from lora_runtime.sampling.watermark import WatermarkDetection, detect_watermark

# Each public name -> the module that defines it.
_HOMES = {
    "SampleResult": "lora_runtime.sampling.sampler",
    "Sampler": "lora_runtime.sampling.sampler",
    "SamplingState": "lora_runtime.sampling.sampler",
    "StopCriteria": "lora_runtime.sampling.stop",
    "TokenizerInfo": "lora_runtime.sampling.sampler",
    "WatermarkDetection": "lora_runtime.sampling.watermark",
    "detect_watermark": "lora_runtime.sampling.watermark",
    "next_token_logprobs": "lora_runtime.sampling.sampler",
    "prompt_logprobs": "lora_runtime.sampling.sampler",
    "render_chat_prompt": "lora_runtime.sampling.chat",
    "schema_from_response_format": "lora_runtime.sampling.response_format",
}

__all__ = sorted(_HOMES)

__getattr__ = lazy_getattr(globals(), _HOMES)
