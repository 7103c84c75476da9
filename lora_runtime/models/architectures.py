"""The Llama family's per-architecture differences, as one small table, and the model's shape read
from a Hugging Face config."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lora_runtime.errors import ValidationError


@dataclass(frozen=True, slots=True)
class ArchitectureSpec:
    """What differs between members of the family. Everything else is the Llama block."""

    qkv_bias: bool | None  # None: read `attention_bias` from the config
    o_bias: bool | None  # None: read `attention_bias` from the config
    sliding_window_attr: str | None  # config attribute bounding attention, if any


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "llama": ArchitectureSpec(qkv_bias=None, o_bias=None, sliding_window_attr=None),
    "mistral": ArchitectureSpec(qkv_bias=False, o_bias=False, sliding_window_attr="sliding_window"),
    "qwen2": ArchitectureSpec(qkv_bias=True, o_bias=False, sliding_window_attr=None),
}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Dimensions and constants of a loaded model."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_model_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def module_dims(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every linear module an adapter may target, by HF name."""
        return {
            "q_proj": (self.hidden_size, self.q_size),
            "k_proj": (self.hidden_size, self.kv_size),
            "v_proj": (self.hidden_size, self.kv_size),
            "o_proj": (self.q_size, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }


def model_shape_from_config(config) -> ModelShape:
    """Read a transformers `PretrainedConfig` of the Llama family; refuse anything else clearly."""
    spec = ARCHITECTURES.get(config.model_type)
    if spec is None:
        raise ValidationError("model", f"unsupported architecture {config.model_type!r}; supported: {sorted(ARCHITECTURES)}")
    if getattr(config, "mlp_bias", False):
        raise ValidationError("model", "MLP biases are not supported")
    attention_bias = bool(getattr(config, "attention_bias", False))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    max_len = config.max_position_embeddings
    if spec.sliding_window_attr and getattr(config, spec.sliding_window_attr, None):
        # Attention here is over the full context, so serve only contexts the window covers whole.
        max_len = min(max_len, getattr(config, spec.sliding_window_attr))
    return ModelShape(
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps,
        max_model_len=max_len,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=attention_bias if spec.qkv_bias is None else spec.qkv_bias,
        o_bias=attention_bias if spec.o_bias is None else spec.o_bias,
    )


def rope_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[head_dim / 2]` and the attention scaling of the config's RoPE variant.

    The plain variant is computed here; scaled variants (llama3, yarn, ...) are parameterised in many
    ways, so their frequencies come from transformers' own table of initialisers.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        return 1.0 / (theta**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq, float(scaling)
