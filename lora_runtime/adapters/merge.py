"""Merging several LoRA adapters into one, with PEFT's `add_weighted_adapter` semantics.

The merge is factor-wise, like PEFT's `linear` / `ties` / `dare_linear` / `dare_ties` types: per
module, over the union of the adapters' modules and using only the adapters that have that module,
adapter i's A is weighted by `sign(w_i*s_i) * sqrt(|w_i*s_i|)` and its B by `sqrt(|w_i*s_i|)` (s_i
its own scale), then the A's and the B's are merged separately. The result is applied with scale 1.

Equal ranks are required wherever adapters share a module. A factor-wise merge adds row j of every
A (and column j of every B): that only means something when the factors have the same rank (PEFT
raises for these types too). The exact alternatives change the cost or the maths: concatenating
factors (PEFT's `cat`) makes the rank the sum of the ranks, and PEFT's `*_svd` types need a dense
out x in SVD per module per merge (seconds per layer on CPU) and only approximate the merged delta.
So different ranks are refused with a 422 that says so.

A duplicated id is allowed and is not the same as one entry with the summed weight: its A is added
twice and so is its B, so with weights w1, w2 >= 0 its delta is (sqrt(w1) + sqrt(w2))^2 * s * B @ A,
not (w1 + w2) * s * B @ A (PEFT merges a repeated name the same way). `distinct_ids` lets the loader
read each adapter once all the same.

DARE's random masks come from a dedicated generator seeded with `seed`, drawn in module order
(layer, then q/k/v/o/gate/up/down), A before B, adapters in request order: the same merge gives the
same weights every time, and the draws match PEFT's `merge_utils` seeded the same way."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real

import torch

from lora_runtime.adapters.weights import MODULE_NAMES, LoraModuleWeights, LoraWeights, ModuleKey, unbounded_module
from lora_runtime.errors import AdapterIncompatibleError, ValidationError

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


def merge_lora_weights(
    adapters: Sequence[LoraWeights], spec: MergedAdapters, seed: int = DARE_SEED
) -> LoraWeights:
    """Merge `adapters` (loaded in the order of `spec.ids`) as `spec` says; factors in fp32.

    Raises:
        AdapterIncompatibleError: adapters that share a module with different ranks there, or
            merged factors that overflow fp32 or `weights.MAX_DELTA_NORM` (large adapters times
            large weights).
    """
    assert len(adapters) == len(spec.ids)
    # As in PEFT, a single adapter is only ever scaled: pruning needs something to merge with.
    strategy = spec.merge_strategy if len(adapters) > 1 else "linear"
    generator = torch.Generator().manual_seed(seed)
    modules: dict[ModuleKey, LoraModuleWeights] = {}
    for key in _union_of_modules(adapters):
        present = [
            (adapter.modules[key], weight)
            for adapter, weight in zip(adapters, spec.weights)
            if key in adapter.modules
        ]
        _check_equal_ranks(key, [module for module, _ in present], spec.ids)
        weights_a, weights_b = _factor_weights(present)
        merge_args = (strategy, spec.density, spec.majority_sign_method, generator)
        lora_a = _merge_factor([module.lora_a for module, _ in present], weights_a, *merge_args)
        lora_b = _merge_factor([module.lora_b for module, _ in present], weights_b, *merge_args)
        modules[key] = LoraModuleWeights(lora_a, lora_b, 1.0)
    _check_bounded(modules)
    return LoraWeights(modules, adapters[0].base_model_name)


def _union_of_modules(adapters: Sequence[LoraWeights]) -> list[ModuleKey]:
    keys = {key for adapter in adapters for key in adapter.modules}
    return sorted(keys, key=lambda key: (key[0], MODULE_NAMES.index(key[1])))


def _check_equal_ranks(
    key: ModuleKey, modules: list[LoraModuleWeights], ids: tuple[str, ...]
) -> None:
    ranks = sorted({module.rank for module in modules})
    if len(ranks) > 1:
        layer_idx, name = key
        raise AdapterIncompatibleError(
            f"merged_adapters.ids: adapters of different ranks {ranks} (layer {layer_idx} {name}) "
            f"cannot be merged factor-wise; merge adapters of equal rank ({', '.join(ids)})"
        )


def _check_bounded(modules: dict[ModuleKey, LoraModuleWeights]) -> None:
    # Loaded factors are bounded, but a weighted sum of up to MAX_MERGED_ADAPTERS of them can leave
    # the bound (or overflow fp32 when an adapter holds huge values): refuse before any page or
    # forward pass sees it, by the same rule as a loaded adapter's.
    found = unbounded_module(modules)
    if found is not None:
        (layer_idx, name), what = found
        raise AdapterIncompatibleError(
            f"merged_adapters.weights: the merged factors of layer {layer_idx} {name} overflow: they hold "
            f"{what}; these adapters cannot be merged with these weights"
        )


def _factor_weights(
    present: list[tuple[LoraModuleWeights, float]],
) -> tuple[list[float], list[float]]:
    """sqrt(|w*s|) on both factors, the sign of w*s on A only (so B @ A carries it once)."""
    weights_a, weights_b = [], []
    for module, weight in present:
        weighted_scale = weight * module.scale
        magnitude = math.sqrt(abs(weighted_scale))
        weights_a.append(magnitude if weighted_scale >= 0 else -magnitude)
        weights_b.append(magnitude)
    return weights_a, weights_b


def _merge_factor(
    factors: list[torch.Tensor],
    weights: list[float],
    strategy: str,
    density: float,
    sign_method: str,
    generator: torch.Generator,
) -> torch.Tensor:
    """Merge same-shaped factors [num_adapters x (rows, cols)] into one [rows, cols] in fp32."""
    factors = [factor.float() for factor in factors]
    if density < 1.0 and strategy == "ties":
        factors = [_keep_largest(factor, density) for factor in factors]
    elif density < 1.0 and strategy.startswith("dare"):
        factors = [_keep_random(factor, density, generator) for factor in factors]
    stacked = torch.stack(factors)  # [num_adapters, rows, cols]
    weighted = stacked * torch.tensor(weights, dtype=torch.float32).view(-1, 1, 1)
    if not strategy.endswith("ties"):
        return weighted.sum(dim=0)
    agrees = _agrees_with_majority_sign(stacked, sign_method)
    return (weighted * agrees).sum(dim=0) / agrees.sum(dim=0).clamp(min=1.0)


def _keep_largest(factor: torch.Tensor, density: float) -> torch.Tensor:
    """Zero all but the int(density * numel) values of largest magnitude."""
    keep = torch.zeros(factor.numel(), dtype=factor.dtype)
    keep[factor.abs().flatten().topk(int(density * factor.numel())).indices] = 1.0
    return factor * keep.view_as(factor)


def _keep_random(factor: torch.Tensor, density: float, generator: torch.Generator) -> torch.Tensor:
    """Keep each value with probability `density`, rescaling the kept ones by 1/density (DARE)."""
    keep = torch.bernoulli(torch.full_like(factor, density), generator=generator)
    return factor * keep / density


def _agrees_with_majority_sign(stacked: torch.Tensor, method: str) -> torch.Tensor:
    """[num_adapters, ...] bool: where each value's sign is the elected one (a tie elects +).
    `total` elects the sign of the sum, `frequency` the sign of the sum of signs; the election
    looks at the pruned, unweighted values, as PEFT's does."""
    signs = stacked.sign()
    votes = (stacked if method == "total" else signs).sum(dim=0)
    majority = torch.where(votes >= 0, 1.0, -1.0)
    return signs == majority


def _is_finite_number(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
