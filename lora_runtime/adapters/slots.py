"""The device-side pool of adapter slots: the stacked weights the LoRA kernels read.

For every layer and fused projection (`qkv`, `o`, `gate_up`, `down`) the pool holds
    lora_a [num_slots, max_rank * num_slices, in_features]
    lora_b [num_slots, total_out_features, max_rank]
laid out as the backends' `add_lora` reads them with `slice_offsets`: slice i (q, k, v or gate, up) uses
rows i*max_rank:(i+1)*max_rank of lora_a, and its output columns slice_offsets[i]:slice_offsets[i+1]
of lora_b. Ranks below max_rank are zero-padded and a module an adapter does not adapt stays zero,
so padded parts add exactly nothing. The adapter's scale is folded into lora_b, so the kernels run
with `scales=None`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lora_runtime.adapters.weights import BaseModelShape, LoraWeights
from lora_runtime.errors import AdapterIncompatibleError

# Fused projection -> the HF modules it concatenates, in output-column order.
PROJECTION_SLICES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass(frozen=True, slots=True)
class ProjectionLayout:
    """Where each module of a fused projection lives: input width and output column ranges."""

    in_features: int
    slice_offsets: tuple[int, ...]  # [num_slices + 1] output column boundaries

    @property
    def num_slices(self) -> int:
        return len(self.slice_offsets) - 1


def projection_layouts(base_shape: BaseModelShape) -> dict[str, ProjectionLayout]:
    layouts = {}
    for projection, modules in PROJECTION_SLICES.items():
        in_features = {base_shape.module_shapes[module][0] for module in modules}
        assert len(in_features) == 1, f"{projection} slices must share their input"
        offsets = [0]
        for module in modules:
            offsets.append(offsets[-1] + base_shape.module_shapes[module][1])
        layouts[projection] = ProjectionLayout(in_features.pop(), tuple(offsets))
    return layouts


class AdapterSlotPool:
    """`num_slots` adapter slots of rank up to `max_rank` for every layer, on one device.

    Slot loading and clearing are not thread-safe: the engine calls them between steps."""

    def __init__(
        self,
        base_shape: BaseModelShape,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        assert num_slots > 0 and max_rank > 0
        self.base_shape = base_shape
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.layouts = projection_layouts(base_shape)
        self._lora_a: list[dict[str, torch.Tensor]] = []
        self._lora_b: list[dict[str, torch.Tensor]] = []
        for _ in range(base_shape.num_layers):
            self._lora_a.append({
                name: torch.zeros(num_slots, max_rank * layout.num_slices, layout.in_features,
                                  dtype=dtype, device=device)
                for name, layout in self.layouts.items()
            })
            # Stored [slots, rank, out] and used through its [slots, out, rank] view: the output
            # dimension contiguous is the layout the compiled CPU LoRA op needs.
            self._lora_b.append({
                name: torch.zeros(num_slots, max_rank, layout.slice_offsets[-1],
                                  dtype=dtype, device=device).transpose(1, 2)
                for name, layout in self.layouts.items()
            })
        self.slot_ranks: list[int] = [0] * num_slots  # 0: empty slot
        # Rank of each slot within each projection (0: the adapter does not touch it), so a step
        # skips the projections none of its adapters target.
        self.projection_ranks: dict[str, list[int]] = {name: [0] * num_slots for name in self.layouts}
        # And within each slice of a fused projection, slot-major [num_slots * num_slices].
        self.slice_ranks: dict[str, list[int]] = {
            name: [0] * (num_slots * layout.num_slices) for name, layout in self.layouts.items()
        }

    def layer(self, layer_idx: int, projection: str) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """(lora_a, lora_b, slice_offsets) of one layer's projection, for the backend's `add_lora`."""
        return (
            self._lora_a[layer_idx][projection],
            self._lora_b[layer_idx][projection],
            self.layouts[projection].slice_offsets,
        )

    def load(self, slot_idx: int, weights: LoraWeights) -> None:
        """Write `weights` into `slot_idx`, replacing what was there."""
        if weights.max_rank > self.max_rank:
            raise AdapterIncompatibleError(
                f"r: rank {weights.max_rank} exceeds the slot pool's maximum rank {self.max_rank}"
            )
        self.clear(slot_idx)
        for (layer_idx, module), factors in weights.modules.items():
            projection, slice_idx = _PROJECTION_OF[module]
            col_start, col_end = self.layouts[projection].slice_offsets[slice_idx : slice_idx + 2]
            row_start = slice_idx * self.max_rank
            lora_a = self._lora_a[layer_idx][projection][slot_idx]
            lora_b = self._lora_b[layer_idx][projection][slot_idx]
            lora_a[row_start : row_start + factors.rank].copy_(factors.lora_a)
            lora_b[col_start:col_end, : factors.rank].copy_(factors.lora_b.float() * factors.scale)
            ranks = self.projection_ranks[projection]
            ranks[slot_idx] = max(ranks[slot_idx], factors.rank)
            # The max over layers: rank_pattern and layers_to_transform vary it, and zero-padded
            # rows add nothing.
            slice_ranks, index = self.slice_ranks[projection], slot_idx * self.layouts[projection].num_slices + slice_idx
            slice_ranks[index] = max(slice_ranks[index], factors.rank)
        self.slot_ranks[slot_idx] = weights.max_rank

    def clear(self, slot_idx: int) -> None:
        """Zero a slot, so a token routed to it by mistake gets no update."""
        for layer_a, layer_b in zip(self._lora_a, self._lora_b):
            for tensor in (*layer_a.values(), *layer_b.values()):
                tensor[slot_idx].zero_()
        self.slot_ranks[slot_idx] = 0
        for ranks in self.projection_ranks.values():
            ranks[slot_idx] = 0
        for name, ranks in self.slice_ranks.items():
            num_slices = self.layouts[name].num_slices
            ranks[slot_idx * num_slices : (slot_idx + 1) * num_slices] = [0] * num_slices

    @property
    def num_bytes(self) -> int:
        return sum(
            tensor.numel() * tensor.element_size()
            for layer in (*self._lora_a, *self._lora_b)
            for tensor in layer.values()
        )


_PROJECTION_OF: dict[str, tuple[str, int]] = {
    module: (projection, slice_idx)
    for projection, modules in PROJECTION_SLICES.items()
    for slice_idx, module in enumerate(modules)
}
