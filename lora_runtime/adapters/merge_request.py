"""`MergedAdapters`: a request for the merge of several adapters, checked on construction; torch-free,
so that the service builds it from the wire without the engine (`lora_runtime.adapters.merge`
computes the merge)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real

from lora_runtime.errors import ValidationError

MERGE_STRATEGIES = ("linear", "ties", "dare_linear", "dare_ties")
MAJORITY_SIGN_METHODS = ("total", "frequency")
DARE_SEED = 0
# What LoRAX and PEFT users merge is a handful of adapters (2-5 in their docs and issues); 32 leaves
# room for task-arithmetic experiments while bounding a merge's loads and its O(ids) factor sums.
# Raising it trades request cost (one load and one weighted sum per id) for nothing seen in practice.
MAX_MERGED_ADAPTERS = 32
# Weights enter the factors as sqrt(|w*s|) on A and on B, so the merged delta grows linearly in |w|.
# Realistic factors (|A|, |B| <~ 1, s = alpha/r <~ 64, r <= 64) merged 32 at a time at |w| = 100
# give factor values <~ 32 * sqrt(100 * 64) ~ 2.6e3 (inside even fp16's 65504) and delta entries
# <~ 64 * 2.6e3**2 ~ 4e8, far inside fp32's and bf16's 3.4e38. The delta alone would stay finite up
# to |w| ~ 1e29; what fails first is the forward pass, where every adapted layer's update is |w|
# times what the adapter was trained to add and SwiGLU squares it (the 1e10 gave garbage,
# 1e30 NaN logits). Weights people use are within [-2, 2]; 100 refuses none of them.
MAX_MERGE_WEIGHT = 100.0


@dataclass(frozen=True, slots=True)
class MergedAdapters:
    """A request for the merge of several adapters (docs/api.md section 3, `merged_adapters`).

    `weights` defaults to 1.0 per id and is stored resolved, so two equal descriptions compare and
    hash equal: the instance itself is the merge cache key. `density` is the fraction of values kept
    by `ties` / `dare_*` (1.0 keeps all)."""

    ids: tuple[str, ...]
    weights: tuple[float, ...] | None = None
    merge_strategy: str = "linear"
    density: float = 1.0
    majority_sign_method: str = "total"

    def __post_init__(self) -> None:
        if isinstance(self.ids, str) or not isinstance(self.ids, Sequence) or not self.ids:
            raise ValidationError("merged_adapters.ids", "must be a non-empty list of adapter ids")
        if not all(isinstance(adapter_id, str) and adapter_id for adapter_id in self.ids):
            raise ValidationError("merged_adapters.ids", "every id must be a non-empty string")
        if len(self.ids) > MAX_MERGED_ADAPTERS:
            # Entries, not distinct ids: a repeated id is merged once per entry (PEFT's way; folding
            # its weights into one entry would change the result), so each costs a weighted sum.
            raise ValidationError(
                "merged_adapters.ids",
                f"at most {MAX_MERGED_ADAPTERS} entries can be merged (a repeated id counts once per "
                f"entry), got {len(self.ids)}",
            )
        object.__setattr__(self, "ids", tuple(self.ids))
        object.__setattr__(self, "weights", self._resolved_weights())
        if self.merge_strategy not in MERGE_STRATEGIES:
            raise ValidationError(
                "merged_adapters.merge_strategy",
                f"must be one of {', '.join(MERGE_STRATEGIES)}, got {self.merge_strategy!r}",
            )
        if not _is_finite_number(self.density) or not 0.0 < self.density <= 1.0:
            raise ValidationError("merged_adapters.density", f"must be in (0, 1], got {self.density!r}")
        if self.majority_sign_method not in MAJORITY_SIGN_METHODS:
            raise ValidationError(
                "merged_adapters.majority_sign_method",
                f"must be one of {', '.join(MAJORITY_SIGN_METHODS)}, got {self.majority_sign_method!r}",
            )

    def _resolved_weights(self) -> tuple[float, ...]:
        if self.weights is None:
            return (1.0,) * len(self.ids)
        if isinstance(self.weights, str) or not isinstance(self.weights, Sequence):
            raise ValidationError("merged_adapters.weights", "must be a list of numbers")
        if len(self.weights) != len(self.ids):
            raise ValidationError(
                "merged_adapters.weights",
                f"has {len(self.weights)} entries but ids has {len(self.ids)}",
            )
        if not all(_is_finite_number(weight) for weight in self.weights):
            raise ValidationError("merged_adapters.weights", "every weight must be a finite number")
        if any(abs(weight) > MAX_MERGE_WEIGHT for weight in self.weights):
            bound = f"{MAX_MERGE_WEIGHT:g}"
            raise ValidationError(
                "merged_adapters.weights", f"every weight must be within [-{bound}, {bound}]"
            )
        return tuple(float(weight) for weight in self.weights)

    @property
    def distinct_ids(self) -> tuple[str, ...]:
        """`ids` in first-appearance order, each once: the adapters to load."""
        return tuple(dict.fromkeys(self.ids))


def _is_finite_number(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
