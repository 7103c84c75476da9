"""The device's adapter memory: every adapted module's page pool (kernels/lora/layouts.py) as tensors
in the layout of the engine's kernel backend, the writes that fill an adapter's pages, and the LoRA
applier of one step (`LoraStep`). Which pages an adapter owns is decided by `pages.AdapterPagePool`;
this module only holds what the pages contain.

An adapter enters the host tier already in the pages' layout (`prepare`, on the loader's threads):
all of its pages in every layer (zeros where a layer or a rank row is not adapted), with its scale
folded into B, so the kernels run each entry at its own rank with no scale, and placing it in the
step is a plain copy per page. What each page holds is recorded by owner, so an adapter placed where
it was before and not overwritten since is not written again, and one whose pages were given to
another is."""
from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

import kernels
from kernels.lora.layouts import PAGE_ROWS, LoraLayout, ModuleShape, pages_for_rank, write_tiles
from kernels.lora.plans import LoraSlice, PageTable
from lora_runtime.adapters.loader import LoadedAdapter
from lora_runtime.adapters.pages import AdapterPlacement
from lora_runtime.adapters.weights import MODULE_NAMES, LoraWeights
from lora_runtime.engine_info import BaseModelShape

# Fused projection -> the HF modules it concatenates, in output-column order.
PROJECTION_SLICES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def module_shapes(base_shape: BaseModelShape) -> dict[str, ModuleShape]:
    return {module: ModuleShape(*base_shape.module_shapes[module]) for module in MODULE_NAMES}


def bytes_per_page(base_shape: BaseModelShape, dtype: torch.dtype) -> int:
    """The memory of one page in every module's pool, every layer: what a 16-rank slice of an adapter
    adapting all modules costs."""
    widths = sum(shape.in_features + shape.out_features for shape in module_shapes(base_shape).values())
    return base_shape.num_layers * widths * PAGE_ROWS * dtype.itemsize


_LOAD_SERIALS = itertools.count()


@dataclass(frozen=True, slots=True)
class HostAdapter:
    """An adapter as the host tier keeps it: each adapted module's pages in the device layout
    (module -> (a [L, n, ...], b [L, n, ...]), n = pages for the module's rank), the ranks they hold,
    and the chat template the adapter ships."""

    tiles: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    module_ranks: Mapping[str, int]
    chat_template: str | None
    # New for every load: the KV prefix cache keys K/V by it, so weights read again under the same
    # key (a hub branch or an S3 prefix that moved meanwhile) never meet K/V of the old ones.
    load_serial: int = field(default_factory=lambda: next(_LOAD_SERIALS), compare=False)

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.tiles.values())


class AdapterPageTensors:
    """`num_pages` pages per module, every layer, on the backend's device. Writes are not thread-safe:
    the engine makes them between steps."""

    def __init__(self, layout: LoraLayout, base_shape: BaseModelShape, num_pages: int, device) -> None:
        self.layout = layout
        self.num_layers = base_shape.num_layers
        self.shapes = shapes = module_shapes(base_shape)
        self.tensors = {module: layout.allocate(self.num_layers, num_pages, shape, device) for module, shape in shapes.items()}
        self._slices: dict[tuple[int, str], tuple[LoraSlice, ...]] = {}
        for projection, modules in PROJECTION_SLICES.items():
            for layer in range(self.num_layers):
                start, pieces = 0, []
                for module in modules:
                    a, b = self.tensors[module]
                    end = start + shapes[module].out_features
                    pieces.append(LoraSlice(module, a[layer], b[layer], start, end))
                    start = end
                self._slices[layer, projection] = tuple(pieces)
        self._written: dict[Hashable, AdapterPlacement] = {}  # what the pages hold, by owner
        self._owner: dict[tuple[str, int], Hashable] = {}  # (module, page) -> the adapter written there

    def slices(self, layer: int, projection: str) -> tuple[LoraSlice, ...]:
        return self._slices[layer, projection]

    def prepare(self, loaded: LoadedAdapter) -> HostAdapter:
        """`loaded` in the pages' layout, ready to be placed anywhere (thread-safe: it writes no page)."""
        tiles = {}
        for module, rank in loaded.module_ranks.items():
            lora_a, lora_b = self._stacked(loaded.weights, module, rank)
            tiles[module] = self.layout.tile(lora_a, lora_b, pages_for_rank(rank))
        return HostAdapter(tiles, loaded.module_ranks, loaded.chat_template)

    def ensure(self, key: Hashable, placement: AdapterPlacement, adapter: HostAdapter) -> None:
        """Make the pages of `placement` hold `key`'s pages."""
        if self._written.get(key) == placement:
            return
        self._written.pop(key, None)
        for module, run in placement.modules.items():
            for page in run.pages:
                previous = self._owner.pop((module, page), None)
                if previous is not None and previous != key:
                    self._written.pop(previous, None)
        for module, run in placement.modules.items():
            write_tiles(*self.tensors[module], run.pages, *adapter.tiles[module])
        for module, run in placement.modules.items():
            self._owner.update(((module, page), key) for page in run.pages)
        self._written[key] = placement

    def _stacked(self, weights: LoraWeights, module: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's factors of `module` at `rank` (layers it does not adapt, and rank rows past
        a layer's own rank, zero): lora_a [L, rank, in], lora_b [L, out, rank] scaled, in float32."""
        shape = self.shapes[module]
        lora_a = torch.zeros(self.num_layers, rank, shape.in_features)
        lora_b = torch.zeros(self.num_layers, shape.out_features, rank)
        present = {layer: weights.modules[layer, module] for layer in range(self.num_layers)
                   if (layer, module) in weights.modules}
        # The layers at the module's full rank (usually all) in a few whole-tensor ops: a loader
        # thread waits for the GIL again after every torch call, so not a few calls per layer.
        full = [layer for layer, factors in present.items() if factors.rank == rank]
        if full:
            layers = torch.tensor(full)
            scales = torch.tensor([present[layer].scale for layer in full]).view(-1, 1, 1)  # float32, as `* scale`
            lora_a[layers] = torch.stack([present[layer].lora_a for layer in full]).float()
            lora_b[layers] = torch.stack([present[layer].lora_b for layer in full]).float() * scales
        for layer, factors in present.items():
            if factors.rank < rank:
                lora_a[layer, : factors.rank] = factors.lora_a
                lora_b[layer, :, : factors.rank] = factors.lora_b.float() * factors.scale
        return lora_a, lora_b


class LoraStep:
    """Implements `forward_batch.LoraBatch` for one step: adds each token's adapter delta, each
    adapter at its own rank, projections no adapter of the step adapts skipped."""

    __slots__ = ("tensors", "backend", "plan", "targeted")

    def __init__(self, tensors: AdapterPageTensors, backend: kernels.Backend,
                 entries: Sequence[AdapterPlacement], token_entries: Sequence[int]) -> None:
        tables = {module: PageTable(tuple(p.modules[module].rank if module in p.modules else 0 for p in entries),
                                    tuple(p.modules[module].pages if module in p.modules else () for p in entries))
                  for module in MODULE_NAMES}
        self.tensors = tensors
        self.backend = backend
        self.plan = backend.plan_lora(tensors.layout, token_entries, tables)
        self.targeted = {projection for projection, modules in PROJECTION_SLICES.items()
                         if any(any(tables[module].ranks) for module in modules)}

    def apply(self, layer_idx: int, projection: str, y: torch.Tensor, x: torch.Tensor) -> None:
        if projection in self.targeted:
            self.backend.add_lora(y, x, self.tensors.slices(layer_idx, projection), self.plan)
