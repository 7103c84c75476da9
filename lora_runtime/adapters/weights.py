"""LoRA weights in memory, the base model shape they must fit, and the limits they must respect.

`LoraWeights` is what every adapter becomes once loaded (or merged): per (layer, module) the two
factors and the scale, with HF module names. Everything downstream (merge, slots) reads this."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# The order modules appear in a Llama decoder layer (and in PEFT's `named_modules` walk).
MODULE_NAMES = ATTENTION_MODULES + MLP_MODULES
# Phi-3's fused projections -> the modules they concatenate, in output order. An adapter on a fused
# module is read as one on each part, sharing A, with B's rows split: the same delta, column for column.
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# Every name an adapter may target, in layer order.
TARGETABLE_MODULES = ("qkv_proj", *ATTENTION_MODULES, "gate_up_proj", *MLP_MODULES)

ModuleKey = tuple[int, str]  # (layer_idx, module name)

# The most a module's scaled update `s * B @ A` may weigh, bounding its spectral norm (its largest gain
# on any input, hence every entry) by s * ||B||_F * ||A||_F, from the factors alone. Why 1e4: a base
# layer's own spectral norm is ~1-100 (SmolLM2, Llama-3), trained adapters stay near or below it, and
# the random test adapters (tests/adapters/peft_factory.py, randn * 0.1 up to rank 64 on 2048-wide
# layers) reach ~3e3; an update 100x the strongest base layer already destroys the model, while 1e4
# is still far from what a float16 activation (65504) or a float32/bfloat16 one (3.4e38) overflows on.
# The same bound holds for A and for s * B alone: the pages store them apart, in the serving dtype.
MAX_DELTA_NORM = 1e4


@dataclass(frozen=True, slots=True)
class LoraModuleWeights:
    """One adapted linear layer: delta_W = lora_b @ lora_a * scale."""

    lora_a: torch.Tensor  # [rank, in_features]
    lora_b: torch.Tensor  # [out_features, rank]
    scale: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]

    def delta_weight(self) -> torch.Tensor:
        """The dense update of the base weight, in fp32: [out_features, in_features]."""
        return (self.lora_b.float() @ self.lora_a.float()) * self.scale


@dataclass(frozen=True, slots=True, eq=False)
class LoraWeights:
    """A whole adapter: the adapted modules, keyed by (layer_idx, module name), in layer then
    module order. `base_model_name` is what the adapter says it was trained on (may be None)."""

    modules: Mapping[ModuleKey, LoraModuleWeights]
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        assert self.modules, "an adapter adapts at least one module"

    @property
    def max_rank(self) -> int:
        return max(module.rank for module in self.modules.values())

    @property
    def num_bytes(self) -> int:
        return sum(
            tensor.numel() * tensor.element_size()
            for module in self.modules.values()
            for tensor in (module.lora_a, module.lora_b)
        )


def unbounded_module(modules: Mapping[ModuleKey, LoraModuleWeights]) -> tuple[ModuleKey, str] | None:
    """The first module holding a value that is not finite or whose update could exceed
    `MAX_DELTA_NORM`, with what it holds (a noun phrase); None when every one is bounded.

    The Frobenius norms of every factor come from one torch call, in float64: no float32, bfloat16 or
    float16 value squared and summed overflows it (3.4e38**2 * 2**31 < 1.8e308), and a NaN or an
    infinity anywhere in a factor makes its norm non-finite, so this is the finiteness check too.
    One call, not a few per tensor: a loader thread waits for the GIL again after every torch call."""
    factors = [factor for module in modules.values() for factor in (module.lora_a, module.lora_b)]
    norms = torch.stack(torch._foreach_norm(factors, 2, dtype=torch.float64)).view(-1, 2).tolist()
    for key, module, (norm_a, norm_b) in zip(modules, modules.values(), norms):
        if not (math.isfinite(norm_a) and math.isfinite(norm_b)):
            return key, "NaN or infinite values"
        scaled_b = abs(module.scale) * norm_b
        if not all(value <= MAX_DELTA_NORM for value in (norm_a, scaled_b, scaled_b * norm_a)):  # NaN fails
            return key, (f"an update scale * lora_B @ lora_A of norm up to {scaled_b * norm_a:.3g} (factors "
                         f"{norm_a:.3g} and {scaled_b:.3g}), over the bound of {MAX_DELTA_NORM:g} that trained "
                         f"adapters stay far below")
    return None
