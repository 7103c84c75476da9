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
    if model_type == "mistral-window":
        return MistralConfig(**TINY_DIMS, sliding_window=WINDOW, tie_word_embeddings=False)
    if model_type in FAMILY_CONFIGS:
        return FAMILY_CONFIGS[model_type]()
    raise ValueError(model_type)


# Each family with its own features switched on: windows (5 or 6 positions) shorter than the tests'
# prompts, soft caps and multipliers far from 1, head sizes unlike hidden / heads. Weights are drawn
# wider than the default 0.02 where that is what makes a soft cap bite.
WINDOW = 5


def _qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(**TINY_DIMS, head_dim=24, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                       tie_word_embeddings=False)


def _granite():
    from transformers import GraniteConfig

    return GraniteConfig(**TINY_DIMS, embedding_multiplier=6.0, residual_multiplier=0.4, attention_multiplier=0.3,
                         logits_scaling=4.0, tie_word_embeddings=False)


def _olmo2():
    from transformers import Olmo2Config

    return Olmo2Config(**TINY_DIMS, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _smollm3():
    from transformers import SmolLM3Config

    return SmolLM3Config(**{**TINY_DIMS, "num_hidden_layers": 3}, no_rope_layers=[1, 0, 1], tie_word_embeddings=True,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _phi3():
    from transformers import Phi3Config

    return Phi3Config(**TINY_DIMS, sliding_window=WINDOW + 1, tie_word_embeddings=False, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)


def _gemma2():
    from transformers import Gemma2Config

    return Gemma2Config(**TINY_DIMS, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                        attn_logit_softcapping=2.0, final_logit_softcapping=1.5, initializer_range=0.3,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _gemma3_text():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**{**TINY_DIMS, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=24,
                            sliding_window=WINDOW,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                            rope_scaling={"rope_type": "linear", "factor": 4.0}, rope_local_base_freq=100.0,
                            rope_theta=5000.0, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)


FAMILY_CONFIGS = {"qwen3": _qwen3, "granite": _granite, "olmo2": _olmo2, "smollm3": _smollm3, "phi3": _phi3,
                  "gemma2": _gemma2, "gemma3_text": _gemma3_text}


def save_tiny_model(model_type: str, directory: Path):
    """Create, save (safetensors) and return a random HF model in float32."""
    return save_random_model(tiny_config(model_type), directory)


def save_random_model(config, directory: Path):
    """Create, save (safetensors) and return a random HF model of `config` in float32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
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
