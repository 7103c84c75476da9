"""The slot pool's stacked tensors, read by the LoRA kernels, reproduce each adapter's own update:
for every token, each CPU backend's `add_lora` over the pool in its layout (and the twin over the same
values read back densely) equals x @ (b @ a * scale).T per module."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_ops, reference
from kernels.lora.layouts import DenseLoraLayout
from lora_runtime.adapters import PROJECTION_SLICES, AdapterSlotPool, LoraModuleWeights, LoraWeights
from lora_runtime.adapters.slots import projection_shapes
from lora_runtime.adapters.weights import BaseModelShape
from lora_runtime.errors import AdapterIncompatibleError
from tests.adapters.peft_factory import tiny_shape

MAX_RANK = 8


def random_adapter(shape: BaseModelShape, modules: tuple[str, ...], rank: int, seed: int) -> LoraWeights:
    generator = torch.Generator().manual_seed(seed)
    factors = {}
    for layer_idx in range(shape.num_layers):
        for module in modules:
            in_features, out_features = shape.module_shapes[module]
            factors[(layer_idx, module)] = LoraModuleWeights(
                torch.randn(rank, in_features, generator=generator),
                torch.randn(out_features, rank, generator=generator),
                scale=0.5 + seed,
            )
    return LoraWeights(factors)


def expected_delta(weights: LoraWeights | None, layer_idx: int, projection: str,
                   x: torch.Tensor, shape: BaseModelShape) -> torch.Tensor:
    """x [in] -> the projection's LoRA output [total_out], straight from the adapter's factors."""
    parts = []
    for module in PROJECTION_SLICES[projection]:
        out_features = shape.module_shapes[module][1]
        factors = None if weights is None else weights.modules.get((layer_idx, module))
        parts.append(torch.zeros(out_features) if factors is None else factors.delta_weight() @ x)
    return torch.cat(parts)


# (backend, model dtype): the layouts the engine's pool takes on CPU (PyTorch: dense float32 rows;
# compiled CPU ops: tiles, bf16 for a bf16 model).
CASES = [("torch", torch.float32)] + (
    [("cpu", torch.float32), ("cpu", torch.bfloat16)] if cpu_ops.ops() is not None else [])
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-1)}


@pytest.mark.parametrize(("backend_name", "dtype"), CASES, ids=[f"{name}-{str(dtype)[6:]}" for name, dtype in CASES])
def test_pool_reproduces_each_adapters_delta(backend_name: str, dtype: torch.dtype) -> None:
    """Through the backend's add_lora, and through the twin over the pool read back densely."""
    shape = tiny_shape()
    backend = kernels.backend_for("cpu", backend_name)
    adapters = [
        random_adapter(shape, ("q_proj", "v_proj"), rank=8, seed=0),
        random_adapter(shape, ("k_proj", "o_proj", "down_proj"), rank=3, seed=1),
        random_adapter(shape, ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), rank=5, seed=2),
    ]
    layout = backend.lora_layout(dtype, list(projection_shapes(shape).values()))
    pool = AdapterSlotPool(shape, num_slots=4, max_rank=MAX_RANK, layout=layout)
    pool.load(3, random_adapter(shape, ("q_proj",), rank=8, seed=9))
    pool.clear(3)  # an emptied slot adds nothing
    for slot_idx, weights in enumerate(adapters):
        pool.load(slot_idx, weights)
    assert pool.slot_ranks == [8, 3, 5, 0]
    token_slots = [2, 2, -1, 0, 1, 1, 1, 3, 0]
    slot_weights = [*adapters, None]
    for layer_idx in range(shape.num_layers):
        for projection, sizes in pool.projections.items():
            lora_a, lora_b, slice_offsets = pool.layer(layer_idx, projection)
            x = torch.randn(len(token_slots), sizes.in_features).to(dtype)
            y, y_twin = (torch.zeros(len(token_slots), sizes.total_out, dtype=dtype) for _ in range(2))
            backend.add_lora(y, x, lora_a, lora_b, backend.plan_lora(token_slots), slice_offsets=slice_offsets,
                             slice_ranks=pool.slice_ranks[projection])
            reference.add_lora(y_twin, x, *layout.dense(lora_a, lora_b, sizes), token_slots, slice_offsets=slice_offsets)
            for t, slot in enumerate(token_slots):
                weights = slot_weights[slot] if slot >= 0 else None
                want = expected_delta(weights, layer_idx, projection, x[t].float(), shape)
                torch.testing.assert_close(y[t].float(), want, **TOLERANCE[dtype])
                torch.testing.assert_close(y_twin[t].float(), want, **TOLERANCE[dtype])


def test_reloading_a_slot_leaves_nothing_of_the_previous_adapter() -> None:
    shape = tiny_shape()
    pool = AdapterSlotPool(shape, num_slots=1, max_rank=MAX_RANK, layout=DenseLoraLayout(torch.float32))
    pool.load(0, random_adapter(shape, ("q_proj", "down_proj"), rank=8, seed=0))
    small = random_adapter(shape, ("v_proj",), rank=2, seed=1)
    pool.load(0, small)
    lora_a, lora_b, offsets = pool.layer(1, "qkv")
    assert pool.slot_ranks == [2]
    q_end, k_end = int(offsets[1]), int(offsets[2])
    assert not lora_a[0, :MAX_RANK].any() and not lora_b[0, :q_end].any()
    assert not lora_a[0, 2 * MAX_RANK + 2 :].any() and not lora_b[0, k_end:, 2:].any()
    assert not pool.layer(0, "down")[0].any()


def test_bf16_pool_and_rank_limit() -> None:
    shape = tiny_shape()
    pool = AdapterSlotPool(shape, num_slots=2, max_rank=4, layout=DenseLoraLayout(torch.bfloat16))
    with pytest.raises(AdapterIncompatibleError, match="maximum rank 4"):
        pool.load(0, random_adapter(shape, ("q_proj",), rank=8, seed=0))
    weights = random_adapter(shape, ("up_proj",), rank=4, seed=0)
    pool.load(1, weights)
    lora_a, lora_b, offsets = pool.layer(0, "gate_up")
    up = weights.modules[(0, "up_proj")]
    dense = lora_b[1, int(offsets[1]):].float() @ lora_a[1, 4:].float()
    torch.testing.assert_close(dense, up.delta_weight(), rtol=3e-2, atol=3e-2)
    bf16_bytes, num_slots, max_rank = 2, 2, 4
    assert pool.num_bytes == sum(
        bf16_bytes * shape.num_layers * num_slots * max_rank
        * (layout.in_features * layout.num_slices + layout.slice_offsets[-1])  # lora_a + lora_b
        for layout in pool.projections.values()
    )
