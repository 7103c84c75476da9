"""A random-weight model of Llama-3.2-1B's shape, for the benchmarks that need a bigger model than
the embedded one and cannot download one: the shape decides the work of a step, the weights do not.

Written once as a Hugging Face directory (config.json, model.safetensors in bf16, ~2.5 GB) with the
embedded model's tokenizer, whose 49152 tokens are fewer than the shape's 128256 (the engine samples
over the model's vocabulary; ids past the tokenizer's decode to nothing). Rotary tables use the
plain Llama rotary (Llama-3.2's long-context scaling changes no step's work)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from lora_runtime.embedded import default_cache_dir, ensure_embedded_model

LLAMA_3_2_1B_SHAPE = {
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
}
# Llama-3.1-8B's shape, as overrides of the 1B one (its context cut to the 1B's: the step's work is the same).
LLAMA_3_1_8B_OVERRIDES = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def ensure_random_llama(directory: Path | None = None, **overrides: int) -> Path:
    """The model directory (made on first use); `overrides` change the shape (tests make a tiny one)."""
    directory = directory or default_cache_dir() / "models" / "random-llama-3.2-1b-shape"
    shape = LLAMA_3_2_1B_SHAPE | overrides
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, **shape}
    if (directory / "model.safetensors").is_file() and json.loads((directory / "config.json").read_text()) == config:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    embedded = ensure_embedded_model()
    for name in TOKENIZER_FILES:
        if (embedded / name).is_file():
            shutil.copy(embedded / name, directory / name)
    save_file(_random_weights(shape), str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=2))  # last: it marks the directory complete
    return directory


def random_llama(num_layers: int | None) -> Path:
    """The random model of Llama-3.2-1B's shape, cut to `num_layers` in a directory of its own (the
    whole model's stays as it is)."""
    if num_layers is None:
        return ensure_random_llama()
    directory = default_cache_dir() / "models" / f"random-llama-3.2-1b-shape-{num_layers}-layers"
    return ensure_random_llama(directory, num_hidden_layers=num_layers)


def _random_weights(shape: dict) -> dict[str, torch.Tensor]:
    hidden, inner, head_dim = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q_width, kv_width = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    generator = torch.Generator().manual_seed(0)

    def normal(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=generator) * 0.02).to(torch.bfloat16)

    weights = {"model.embed_tokens.weight": normal(shape["vocab_size"], hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    if not shape["tie_word_embeddings"]:
        weights["lm_head.weight"] = normal(shape["vocab_size"], hidden)
    for layer in range(shape["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        weights |= {
            prefix + "self_attn.q_proj.weight": normal(q_width, hidden),
            prefix + "self_attn.k_proj.weight": normal(kv_width, hidden),
            prefix + "self_attn.v_proj.weight": normal(kv_width, hidden),
            prefix + "self_attn.o_proj.weight": normal(hidden, q_width),
            prefix + "mlp.gate_proj.weight": normal(inner, hidden),
            prefix + "mlp.up_proj.weight": normal(inner, hidden),
            prefix + "mlp.down_proj.weight": normal(hidden, inner),
            prefix + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        }
    return weights
