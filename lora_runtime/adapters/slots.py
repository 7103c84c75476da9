"""The device-side pool of adapter slots: the stacked weights the LoRA kernels read.

For every layer and fused projection (`qkv`, `o`, `gate_up`, `down`) the pool holds every slot's
factors in the layout of the engine's kernel backend (`Backend.lora_layout`, kernels/lora/layouts.py):
slice i (q, k, v or gate, up) has its own rank rows of A and its output columns
slice_offsets[i]:slice_offsets[i+1] of B. Ranks below max_rank are zero-padded and a module an adapter
does not adapt stays zero, so padded parts add exactly nothing. The adapter's scale is folded into
B, so the kernels run with `scales=None`."""
from __future__ import annotations

import torch

from kernels.lora.layouts import LoraLayout, LoraProjection
from lora_runtime.adapters.weights import BaseModelShape, LoraWeights
from lora_runtime.errors import AdapterIncompatibleError

# Fused projection -> the HF modules it concatenates, in output-column order.
PROJECTION_SLICES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def projection_shapes(base_shape: BaseModelShape) -> dict[str, LoraProjection]:
    """Each fused projection's input width and output column ranges."""
    shapes = {}
    for projection, modules in PROJECTION_SLICES.items():
        in_features = {base_shape.module_shapes[module][0] for module in modules}
        assert len(in_features) == 1, f"{projection} slices must share their input"
        offsets = [0]
        for module in modules:
            offsets.append(offsets[-1] + base_shape.module_shapes[module][1])
        shapes[projection] = LoraProjection(in_features.pop(), tuple(offsets))
    return shapes


class AdapterSlotPool:
    """`num_slots` adapter slots of rank up to `max_rank` for every layer, on one device, in `layout`.

    Slot loading and clearing are not thread-safe: the engine calls them between steps."""

    def __init__(
        self,
        base_shape: BaseModelShape,
        num_slots: int,
        max_rank: int,
        layout: LoraLayout,
        device: torch.device | str = "cpu",
    ) -> None:
        assert num_slots > 0 and max_rank > 0
        self.base_shape = base_shape
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.layout = layout
        self.projections = projection_shapes(base_shape)
        self._tensors: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [
            {name: layout.allocate(num_slots, max_rank, projection, device) for name, projection in self.projections.items()}
            for _ in range(base_shape.num_layers)
        ]
        self.slot_ranks: list[int] = [0] * num_slots  # 0: empty slot
        # Rank of each slot within each projection (0: the adapter does not touch it), so a step
        # skips the projections none of its adapters target.
        self.projection_ranks: dict[str, list[int]] = {name: [0] * num_slots for name in self.projections}
        # And within each slice of a fused projection, slot-major [num_slots * num_slices].
        self.slice_ranks: dict[str, list[int]] = {
            name: [0] * (num_slots * projection.num_slices) for name, projection in self.projections.items()
        }

    def layer(self, layer_idx: int, projection: str) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """(lora_a, lora_b, slice_offsets) of one layer's projection, in the layout, for the backend's `add_lora`."""
        lora_a, lora_b = self._tensors[layer_idx][projection]
        return lora_a, lora_b, self.projections[projection].slice_offsets

    def load(self, slot_idx: int, weights: LoraWeights) -> None:
        """Write `weights` into `slot_idx`, replacing what was there."""
        if weights.max_rank > self.max_rank:
            raise AdapterIncompatibleError(
                f"r: rank {weights.max_rank} exceeds the slot pool's maximum rank {self.max_rank}"
            )
        self.clear(slot_idx)
        for (layer_idx, module), factors in weights.modules.items():
            projection, slice_idx = _PROJECTION_OF[module]
            lora_a, lora_b = self._tensors[layer_idx][projection]
            self.layout.write(lora_a, lora_b, slot_idx, slice_idx, self.projections[projection],
                              factors.lora_a, factors.lora_b.float() * factors.scale)
            ranks = self.projection_ranks[projection]
            ranks[slot_idx] = max(ranks[slot_idx], factors.rank)
            # The max over layers: rank_pattern and layers_to_transform vary it, and zero-padded
            # rows add nothing.
            slice_ranks, index = self.slice_ranks[projection], slot_idx * self.projections[projection].num_slices + slice_idx
            slice_ranks[index] = max(slice_ranks[index], factors.rank)
        self.slot_ranks[slot_idx] = weights.max_rank

    def clear(self, slot_idx: int) -> None:
        """Zero a slot, so a token routed to it by mistake gets no update."""
        for layer in self._tensors:
            for lora_a, lora_b in layer.values():
                lora_a[slot_idx].zero_()
                lora_b[slot_idx].zero_()
        self.slot_ranks[slot_idx] = 0
        for ranks in self.projection_ranks.values():
            ranks[slot_idx] = 0
        for name, ranks in self.slice_ranks.items():
            num_slices = self.projections[name].num_slices
            ranks[slot_idx * num_slices : (slot_idx + 1) * num_slices] = [0] * num_slices

    @property
    def num_bytes(self) -> int:
        return sum(
            tensor.numel() * tensor.element_size()
            for layer in self._tensors
            for pair in layer.values()
            for tensor in pair
        )


_PROJECTION_OF: dict[str, tuple[str, int]] = {
    module: (projection, slice_idx)
    for projection, modules in PROJECTION_SLICES.items()
    for slice_idx, module in enumerate(modules)
}
