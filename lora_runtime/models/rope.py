"""The rotary tables a config asks for: one per kind of layer (Gemma 3's sliding layers have their
own base), read before any weight so that a variant we do not serve is refused by name first.

Every variant HF transformers (5.23) defines, and what we do with it:
- default, linear, yarn, llama3: fixed frequencies, transformers' own initialisers.
- dynamic (NTK): HF recomputes its frequencies only for sequences past `max_position_embeddings`,
  which is our `max_model_len`; within it they are its initial ones, which we use.
- longrope (Phi-3-mini-128k, Phi-3.5, Phi-4-mini): two sets of frequencies. HF's forward takes the
  long set iff max(position) + 1 > `original_max_position_embeddings` (the forward's length), and
  Phi-3's `generate` recomputes its whole cache at the step where the sequence grows past that
  length (its `prepare_inputs_for_generation`), so at every step its logits are one forward over the
  whole sequence so far: short set for every token while the request has at most `original` tokens,
  long set for every token after. We do the same: each token takes the long set iff its request's
  length (prompt and generated tokens so far) is past `original` (`RotaryEmbedding.rows`), and a
  request growing past it recomputes its cache from its first token (`recompute_length`, the
  scheduler's restart), its prefix blocks then chained apart from short requests' (`rope_variant`).
  Prompt logprobs stay those of the first prefill, as HF's. (A padded HF batch would take the set of
  its longest row for all rows; we match each request as HF runs it alone.) Served only for families
  whose HF `generate` recomputes so (`ArchitectureSpec.longrope`): elsewhere HF's cached keys would
  keep the short set, which a recompute would not reproduce.
- proportional (Gemma 4, LFM), axial (vision): refused by name.
`partial_rotary_factor` (Phi-3/4: the first fraction of each head rotated) is honoured in families
whose HF code rotates part of a head (`ArchitectureSpec.partial_rotary`), refused in the others.
"""
from __future__ import annotations

import torch

from lora_runtime.errors import ValidationError
from lora_runtime.layers.rotary import LongFactors, RotaryEmbedding

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def rope_parameters(config, layer_type: str | None) -> dict:
    """The config's RoPE parameters for `layer_type` (configs keyed by layer type, as Gemma 3's), or
    its only ones."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        return dict(params[layer_type])
    return params


def partial_rotary_factor(config, layer_type: str | None) -> float:
    params = rope_parameters(config, layer_type)
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return 1.0 if factor is None else float(factor)


def check_rope(config, layer_type: str | None, allows_partial: bool, allows_longrope: bool) -> None:
    """Refuse, by name, a RoPE variant we do not compute (LongRoPE outside the families whose HF
    `generate` recomputes at its switch), or a partial rotation in a family whose HF code rotates
    whole heads."""
    rope_type = rope_parameters(config, layer_type).get("rope_type", "default")
    supported = [t for t in SUPPORTED_ROPE_TYPES if allows_longrope or t != "longrope"]
    if rope_type not in supported:
        raise ValidationError("model", f"rope scaling type {rope_type!r} is not supported for "
                                       f"{config.model_type!r}; supported: {supported}")
    factor = partial_rotary_factor(config, layer_type)
    if factor != 1.0 and not allows_partial:
        raise ValidationError("model", f"partial_rotary_factor {factor} is not supported for "
                                       f"{config.model_type!r} (its heads are rotated whole)")


def rotary_tables(config, layer_rope: tuple[str | None, ...], head_dim: int, max_positions: int,
                  dtype: torch.dtype, device: str) -> dict[str, RotaryEmbedding]:
    """The tables of a model by the keys of `ModelFeatures.layer_rope` ("default": the config's only
    RoPE parameters; else a layer type's own)."""
    return {key: rotary_embedding(config, head_dim, None if key == "default" else key, max_positions, dtype, device)
            for key in set(layer_rope) - {None}}


def rotary_embedding(config, head_dim: int, layer_type: str | None, max_positions: int, dtype: torch.dtype,
                     device: str) -> RotaryEmbedding:
    """The cos/sin tables of the config's RoPE variant (for `layer_type` where the config sets one per
    kind of layer), over the first `head_dim * partial_rotary_factor` dimensions of each head."""
    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        rotary_dim = int(head_dim * partial_rotary_factor(config, layer_type))
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
        return RotaryEmbedding(1.0 / (theta**exponents), max_positions, 1.0, dtype, device)
    # HF's dynamic NTK keeps its initial frequencies up to max_position_embeddings only.
    assert rope_type != "dynamic" or max_positions <= config.max_position_embeddings, "dynamic NTK past its length"
    inv_freq, scaling = _initialise(config, rope_type, layer_type)
    long_factors = None
    if rope_type == "longrope":
        original = int(params["original_max_position_embeddings"])
        long_inv_freq, _ = _initialise(config, rope_type, layer_type, seq_len=original + 1)
        long_factors = LongFactors(long_inv_freq, original)
    return RotaryEmbedding(inv_freq, max_positions, scaling, dtype, device, long_factors)


def _initialise(config, rope_type: str, layer_type: str | None, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[rotary_dim / 2]` and attention scaling from transformers' own table of
    initialisers (the scaled variants are parameterised in many ways; theirs is the definition)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    by_type = getattr(config, "rope_parameters", None) or {}
    keyed = layer_type is not None and isinstance(by_type.get(layer_type), dict)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), seq_len=seq_len,
                                                       layer_type=layer_type if keyed else None)
    return inv_freq, float(scaling)


def recompute_length(rotary: dict[str, RotaryEmbedding]) -> int | None:
    """The length past which a request's cache is recomputed: LongRoPE's `original`; None without it."""
    lengths = {table.long_factors.original_max_positions for table in rotary.values() if table.long_factors}
    assert len(lengths) <= 1, "one LongRoPE switch per model"
    return lengths.pop() if lengths else None


def rope_variant(rotary: dict[str, RotaryEmbedding], num_tokens: int) -> str | None:
    """What the cached keys of a request of `num_tokens` tokens depend on beyond its tokens: "long"
    where LongRoPE rotates them all with its long set, so that its blocks and a shorter request's are
    never shared."""
    length = recompute_length(rotary)
    return "long" if length is not None and num_tokens > length else None
