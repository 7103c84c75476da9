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

import torch

from lora_runtime.adapters.merge_request import DARE_SEED, MergedAdapters
from lora_runtime.adapters.weights import MODULE_NAMES, LoraModuleWeights, LoraWeights, ModuleKey, unbounded_module
from lora_runtime.errors import AdapterIncompatibleError

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
