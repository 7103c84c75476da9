"""What differs between the families the one decoder serves (Llama, Mistral, Qwen 2/3, Granite,
OLMo 2, SmolLM3, Phi-3, Gemma 2/3), as one small table, and the model's shape and features read from
a Hugging Face config. Everything a config asks for that we do not compute is refused here, by name,
before any weight is read."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from lora_runtime.errors import ValidationError
from lora_runtime.models.rope import check_rope


@dataclass(frozen=True, slots=True)
class NormNames:
    """The HF names (under `model.layers.N.`) of a layer's norms by what they normalise; None: absent."""

    attention_in: str | None = "input_layernorm"
    attention_out: str | None = None
    mlp_in: str | None = "post_attention_layernorm"
    mlp_out: str | None = None


PRE_NORMS = NormNames()
# Gemma 2/3: norms before and after both sublayers.
SANDWICH_NORMS = NormNames("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                           "post_feedforward_layernorm")
# OLMo 2: norms on the sublayers' outputs only.
POST_NORMS = NormNames(None, "post_attention_layernorm", None, "post_feedforward_layernorm")


@dataclass(frozen=True, slots=True)
class ArchitectureSpec:
    """What differs between members of the family. Everything else is the Llama block."""

    qkv_bias: bool | None = None  # None: read `attention_bias` from the config
    o_bias: bool | None = None  # None: read `attention_bias` from the config
    norms: NormNames = PRE_NORMS
    qk_norm: Literal["head", "projection"] | None = None  # RMS norm of q and k per head or over the projection
    norm_plus_one: bool = False  # Gemma's norms scale by (1 + w)
    fused_checkpoint: bool = False  # Phi-3 stores qkv_proj and gate_up_proj fused
    scaled_embedding: bool = False  # Gemma scales the embeddings by sqrt(hidden)
    partial_rotary: bool = False  # HF rotates the first `partial_rotary_factor` of each head (Phi-3/4)
    longrope: bool = False  # HF's generate recomputes its cache at LongRoPE's switch (Phi-3/4; models.rope)


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "llama": ArchitectureSpec(),
    "mistral": ArchitectureSpec(qkv_bias=False, o_bias=False),
    "qwen2": ArchitectureSpec(qkv_bias=True, o_bias=False),
    "qwen3": ArchitectureSpec(qk_norm="head"),
    "granite": ArchitectureSpec(),
    "olmo2": ArchitectureSpec(norms=POST_NORMS, qk_norm="projection"),
    "smollm3": ArchitectureSpec(),
    "phi3": ArchitectureSpec(qkv_bias=False, o_bias=False, fused_checkpoint=True, partial_rotary=True,
                             longrope=True),
    "gemma2": ArchitectureSpec(norms=SANDWICH_NORMS, norm_plus_one=True, scaled_embedding=True),
    "gemma3_text": ArchitectureSpec(norms=SANDWICH_NORMS, qk_norm="head", norm_plus_one=True, scaled_embedding=True),
}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")


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
    fused_modules: bool = False  # the checkpoint's projections are Phi-3's qkv_proj and gate_up_proj

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def module_dims(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every linear module an adapter may target, by HF name (and
        Phi-3's fused modules, which its adapters target)."""
        fused = {"qkv_proj": (self.hidden_size, self.q_size + 2 * self.kv_size),
                 "gate_up_proj": (self.hidden_size, 2 * self.intermediate_size)} if self.fused_modules else {}
        return fused | {
            "q_proj": (self.hidden_size, self.q_size),
            "k_proj": (self.hidden_size, self.kv_size),
            "v_proj": (self.hidden_size, self.kv_size),
            "o_proj": (self.q_size, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }


@dataclass(frozen=True, slots=True)
class ModelFeatures:
    """The numbers of a config beyond its dimensions (1.0 / None where a family has no such step)."""

    spec: ArchitectureSpec
    activation: str  # of the gated MLP: "silu" or "gelu_pytorch_tanh"
    embedding_scale: float  # embeddings times this, rounded to the model's dtype (Gemma, Granite)
    residual_multiplier: float  # sublayer outputs times this before the residual add (Granite)
    attention_scale: float  # of q.k
    attention_softcap: float | None  # scores become c * tanh(s / c) (Gemma 2)
    final_softcap: float | None  # the same on the logits (Gemma 2)
    logits_divisor: float  # logits divided by this (Granite)
    layer_windows: tuple[int | None, ...]  # per layer: attend to the last W positions; None: all
    layer_rope: tuple[str | None, ...]  # per layer: its rotary table's key; None: no rotary (NoPE)

    @property
    def max_window(self) -> int | None:
        """The widest window when every layer has one (KV older than it is never read again), else None."""
        windows = self.layer_windows
        return None if not windows or None in windows else max(windows)


def architecture_spec(config) -> ArchitectureSpec:
    spec = ARCHITECTURES.get(config.model_type)
    if spec is None:
        raise ValidationError("model", f"unsupported architecture {config.model_type!r}; supported: {sorted(ARCHITECTURES)}")
    return spec


def model_shape_from_config(config) -> ModelShape:
    """Read a transformers `PretrainedConfig` of a family we serve; refuse anything else clearly."""
    spec = architecture_spec(config)
    if getattr(config, "mlp_bias", False):
        raise ValidationError("model", "MLP biases are not supported")
    attention_bias = bool(getattr(config, "attention_bias", False))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
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
        max_model_len=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=attention_bias if spec.qkv_bias is None else spec.qkv_bias,
        o_bias=attention_bias if spec.o_bias is None else spec.o_bias,
        fused_modules=spec.fused_checkpoint,
    )


def model_features_from_config(config, shape: ModelShape) -> ModelFeatures:
    """The per-family steps the config switches on; refuses, by name, the ones we do not compute."""
    spec = architecture_spec(config)
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if activation not in ACTIVATIONS:
        raise ValidationError("model", f"activation {activation!r} is not supported; supported: {list(ACTIVATIONS)}")
    layer_rope = _layer_rope(config, shape.num_layers)
    for key in set(layer_rope) - {None}:
        check_rope(config, key if key != "default" else None, spec.partial_rotary, spec.longrope)
    query_scalar = getattr(config, "query_pre_attn_scalar", None)
    return ModelFeatures(
        spec=spec,
        activation=activation,
        embedding_scale=math.sqrt(shape.hidden_size) if spec.scaled_embedding
        else float(getattr(config, "embedding_multiplier", 1.0)),
        residual_multiplier=float(getattr(config, "residual_multiplier", 1.0)),
        attention_scale=float(getattr(config, "attention_multiplier", None)
                              or (query_scalar if query_scalar is not None else shape.head_dim) ** -0.5),
        attention_softcap=getattr(config, "attn_logit_softcapping", None) or None,
        final_softcap=getattr(config, "final_logit_softcapping", None) or None,
        logits_divisor=float(getattr(config, "logits_scaling", 1.0)),
        layer_windows=_layer_windows(config, shape.num_layers),
        layer_rope=layer_rope,
    )


def _layer_windows(config, num_layers: int) -> tuple[int | None, ...]:
    """HF's masks: a config's `sliding_window` bounds the layers its `layer_types` call sliding (every
    layer where it has none: Mistral, Phi-3), unless `use_sliding_window` turns it off."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return (None,) * num_layers
    types = getattr(config, "layer_types", None)
    if types is None:
        return (int(window),) * num_layers
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValidationError("model", f"layer types {unknown} are not supported; supported: {list(LAYER_TYPES)}")
    return tuple(int(window) if kind == "sliding_attention" else None for kind in types)


def _layer_rope(config, num_layers: int) -> tuple[str | None, ...]:
    """Each layer's rotary table: keyed by its layer type where the config sets RoPE per type
    (Gemma 3), "default" otherwise, None in SmolLM3's layers without rotary."""
    params = getattr(config, "rope_parameters", None) or {}
    types = getattr(config, "layer_types", None) or ("full_attention",) * num_layers
    uses_rope = getattr(config, "no_rope_layers", None) or (1,) * num_layers
    return tuple((kind if isinstance(params.get(kind), dict) else "default") if rotary else None
                 for kind, rotary in zip(types, uses_rope))
