"""Sampling: the logits chain, per-request sampling state, schema constraints, watermark, stop
criteria, incremental detokenisation and chat prompts. Engine-independent: tensors and tokenizers in,
token ids and text out."""
from lora_runtime.sampling.chat import render_chat_prompt
from lora_runtime.sampling.sampler import SampleResult, Sampler, SamplingState, TokenizerInfo, next_token_logprobs, prompt_logprobs
from lora_runtime.sampling.schema import schema_from_response_format
from lora_runtime.sampling.stop import StopCriteria
from lora_runtime.sampling.watermark import WatermarkDetection, detect_watermark

__all__ = [
    "SampleResult",
    "Sampler",
    "SamplingState",
    "StopCriteria",
    "TokenizerInfo",
    "WatermarkDetection",
    "detect_watermark",
    "next_token_logprobs",
    "prompt_logprobs",
    "render_chat_prompt",
    "schema_from_response_format",
]
