"""The rotary tables a config asks for: one per kind of layer (Gemma 3's sliding layers have their
own base), read before any weight so that a variant we do not serve is refused by name first."""
from __future__ import annotations

import torch

from lora_runtime.errors import ValidationError

# Variants whose frequencies are fixed at load. "dynamic" and "longrope" change the frequencies with
# the sequence's length while it runs, which keys already in the cache would not follow.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config, layer_type: str | None) -> dict:
    """The config's RoPE parameters for `layer_type` (configs keyed by layer type, as Gemma 3's), or
    its only ones."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        return dict(params[layer_type])
    return params


def check_rope(config, layer_type: str | None) -> None:
    """Refuse, by name, a RoPE variant or a partial rotation our rotary kernels do not compute."""
    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValidationError("model", f"rope scaling type {rope_type!r} is not supported; supported: "
                                       f"{list(STATIC_ROPE_TYPES)}")
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if factor not in (None, 1.0):
        raise ValidationError("model", f"partial_rotary_factor {factor} is not supported "
                                       "(rotary over the whole head only)")


def rope_frequencies(config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[head_dim / 2]` and the attention scaling of the config's RoPE variant
    (for `layer_type` where the config has one set per kind of layer).

    The plain variant is computed here; scaled variants (llama3, yarn, ...) are parameterised in many
    ways, so their frequencies come from transformers' own table of initialisers.
    """
    check_rope(config, layer_type)
    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        return 1.0 / (theta**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    by_type = getattr(config, "rope_parameters", None) or {}
    keyed = layer_type is not None and isinstance(by_type.get(layer_type), dict)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"),
                                                       layer_type=layer_type if keyed else None)
    return inv_freq, float(scaling)
