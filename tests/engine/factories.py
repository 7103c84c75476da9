"""Small builders for engine tests: tiny random HF checkpoints of each architecture, and requests."""
from __future__ import annotations

from pathlib import Path

import torch

from lora_runtime.core import Request, SamplingParams

TINY_DIMS = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def tiny_config(model_type: str):
    """A 2-layer random config of the given architecture, with the member's own quirks."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if model_type == "llama":
        return LlamaConfig(**TINY_DIMS, rope_theta=10000.0, tie_word_embeddings=False)
    if model_type == "llama-tied":
        return LlamaConfig(**TINY_DIMS, tie_word_embeddings=True)
    if model_type == "qwen2":
        return Qwen2Config(**TINY_DIMS, tie_word_embeddings=False, use_sliding_window=False)
    if model_type == "mistral":
        return MistralConfig(**TINY_DIMS, sliding_window=None, tie_word_embeddings=False)
    raise ValueError(model_type)


def save_tiny_model(model_type: str, directory: Path):
    """Create, save (safetensors) and return a random HF model in float32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32)
    with torch.no_grad():  # qwen2 biases start at zero; make them matter
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    model.eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def make_request(request_id: str, num_prompt_tokens: int, max_new_tokens: int = 8, adapter_key: str | None = None) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, num_prompt_tokens + 1)),
        params=SamplingParams(max_new_tokens=max_new_tokens),
        adapter_key=adapter_key,
    )


def chat(engine, question: str) -> str:
    """`question` as one user message in the model's chat template, with the generation prompt."""
    messages = [{"role": "user", "content": question}]
    return engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
