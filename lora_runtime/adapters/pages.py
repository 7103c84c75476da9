"""Which adapter owns which pages of the device's adapter memory: the bookkeeping half of the device
pool, as `KVCacheManager` is for the KV cache (the tensors are `page_tensors.AdapterPageTensors`).

Every adapted module (q_proj, ..., down_proj) has a pool of `num_pages` pages of 16 rank rows spanning
every layer (kernels/lora/layouts.py). A resident adapter of rank r on a module owns ceil(r / 16) of
that module's pages, so it costs its own rank, and the pool holds as many adapters as their ranks
fit. The scheduler consults it as it consults the KV cache: a request is admitted only once its
adapter is loaded (`is_loaded`: its ranks are known) and its pages are reserved (`reserve`: the
adapter stays resident and pinned while that request runs), and releases them when the request stops
running;
an adapter nobody runs stays resident, evicted least recently used first when another needs its
pages, so a popular adapter is placed once. Nothing here touches tensors or weights.

Invariants (tests/adapters/test_pages.py): a page has at most one owner; a pinned adapter is never
evicted; a reservation that does not fit changes nothing.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

from kernels.lora.layouts import pages_for_rank


@dataclass(frozen=True, slots=True)
class ModulePages:
    """An adapter's place in one module's pool: its rank there and its pages in rank order."""

    rank: int
    pages: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AdapterPlacement:
    """Where one resident adapter lies: module name -> its pages (modules it does not adapt absent)."""

    modules: Mapping[str, ModulePages]

    @property
    def num_pages(self) -> int:
        return sum(len(run.pages) for run in self.modules.values())

    @property
    def first_page(self) -> int:
        """Its lowest page in any module (-1 where it adapts none): steps order their adapters by it,
        so that the LoRA op sweeps each pool upwards (pools fill from the start, every adapter's pages
        in a run where it can: alike in every module)."""
        return min((run.pages[0] for run in self.modules.values()), default=-1)


class AdapterPagePool:
    """`num_pages` pages per module of `modules`; `ranks_of(key)` gives a loaded adapter's rank per
    module (None while it is not loaded)."""

    def __init__(self, num_pages: int, modules: tuple[str, ...],
                 ranks_of: Callable[[Hashable], Mapping[str, int] | None]) -> None:
        assert num_pages > 0 and modules
        self.num_pages = num_pages
        self.modules = modules
        self.ranks_of = ranks_of
        # Free pages per module, ascending. An adapter takes the lowest run of consecutive free pages
        # that holds it (else the lowest free pages): the pages in use stay at the pool's start, so the
        # memory an idle pool never touched stays uncommitted on CPU, and an adapter's pages stay one
        # run of memory, which the op streams faster than scattered pages.
        self._free: dict[str, list[int]] = {module: list(range(num_pages)) for module in modules}
        self._placements: dict[Hashable, AdapterPlacement] = {}
        self._pins: dict[Hashable, int] = {}  # resident adapters -> requests running them
        self._idle: OrderedDict[Hashable, None] = OrderedDict()  # unpinned residents, least recently used first

    def placement(self, key: Hashable) -> AdapterPlacement:
        """The placement of a resident adapter."""
        return self._placements[key]

    def is_resident(self, key: Hashable) -> bool:
        return key in self._placements

    def is_loaded(self, key: Hashable) -> bool:
        return self.ranks_of(key) is not None

    def reserve(self, key: Hashable) -> bool:
        """Make the loaded adapter `key` resident (placed in pages for its ranks, if it is not
        already) and pin it for one more running request; evicts idle adapters as needed. False,
        changing nothing, when the pages it needs are held by pinned adapters."""
        if key not in self._placements:
            ranks = self.ranks_of(key)
            assert ranks is not None, f"adapter {key} is reserved before it is loaded"
            needed = {module: pages_for_rank(rank) for module, rank in ranks.items() if rank > 0}
            if not self._make_room(needed):
                return False
            self._placements[key] = AdapterPlacement({
                module: ModulePages(ranks[module], self._take(module, count)) for module, count in needed.items()
            })
        self._pins[key] = self._pins.get(key, 0) + 1
        self._idle.pop(key, None)
        return True

    def release(self, key: Hashable) -> None:
        """One request stopped running `key`; with none left it stays resident, idle."""
        pins = self._pins[key] - 1
        if pins:
            self._pins[key] = pins
        else:
            del self._pins[key]
            self._idle[key] = None

    def _make_room(self, needed: Mapping[str, int]) -> bool:
        """Evict idle adapters, least recently used first, until every module has the free pages
        `needed`; evicts nothing if that cannot be reached."""
        short = {module: count - len(self._free[module]) for module, count in needed.items()}
        if all(gap <= 0 for gap in short.values()):
            return True
        victims, freed = [], dict.fromkeys(needed, 0)
        for key in self._idle:
            placement = self._placements[key]
            if not any(module in placement.modules for module, gap in short.items() if gap > freed[module]):
                continue  # frees nothing this adapter lacks
            victims.append(key)
            for module, run in placement.modules.items():
                if module in freed:
                    freed[module] += len(run.pages)
            if all(freed[module] >= gap for module, gap in short.items()):
                for victim in victims:
                    self._evict(victim)
                return True
        return False

    def _take(self, module: str, count: int) -> tuple[int, ...]:
        """`count` free pages of `module` (there are enough): the lowest run of that many consecutive
        pages, or the lowest pages where no run is that long."""
        free = self._free[module]
        runs = (i for i in range(len(free) - count + 1) if free[i + count - 1] - free[i] == count - 1)
        start = next(runs, 0)
        taken = free[start : start + count]
        del free[start : start + count]
        return tuple(taken)

    def _evict(self, key: Hashable) -> None:
        del self._idle[key]
        for module, run in self._placements.pop(key).modules.items():
            for page in run.pages:
                bisect.insort(self._free[module], page)

    @property
    def num_free_pages(self) -> dict[str, int]:
        """Free pages per module (idle residents' pages not counted as free)."""
        return {module: len(free) for module, free in self._free.items()}

    def capacity_for_rank(self, rank: int) -> int:
        """How many adapters of `rank` on every module an empty pool holds: for the largest allowed
        rank, how many adapters are sure to fit at once whatever their ranks."""
        return self.num_pages // pages_for_rank(rank)

    @property
    def num_resident(self) -> int:
        return len(self._placements)

    @property
    def num_pinned(self) -> int:
        return len(self._pins)
