"""The engine's adapters, one part per resource, in tiers:

    device pages (what the kernels read: `pages` decides who owns which, `page_tensors` holds them)
      <- host cache of loaded adapters (`cache.AdapterCache`: LRU by bytes, pinned by live requests)
      <- the download store on local disk (`sources.download.AdapterStore`)
      <- the sources (pbase, hub, s3, local: `loader.AdapterLoader`)

A request's adapter is parsed once (`parse`), then `acquire` starts its load on the loader threads
and hands back a lease on the host copy, which the request holds until it ends. The scheduler asks
the page pool for the adapter's pages when it admits the request (the pool sees the host copy's ranks
through `module_ranks`); the model runner writes the step's newly placed adapters into their pages
and applies them (`lora_step`). A load never stalls a step: a request waits only for its own adapter.
"""
from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping, Sequence

import torch

import kernels
from kernels.lora.layouts import pages_for_rank
from lora_runtime.adapters.cache import AdapterCache, AdapterLease
from lora_runtime.adapters.loader import AdapterLoader
from lora_runtime.adapters.page_tensors import AdapterPageTensors, HostAdapter, LoraStep, bytes_per_page, module_shapes
from lora_runtime.adapters.pages import AdapterPagePool, AdapterPlacement
from lora_runtime.adapters.refs import AdapterArgument, AdapterKey, AdapterRequest, AdapterSource, Caller
from lora_runtime.adapters.weights import MODULE_NAMES
from lora_runtime.engine_info import AdapterLimits, BaseModelShape
from lora_runtime.config import AdapterConfig

logger = logging.getLogger(__name__)

Lease = AdapterLease[AdapterKey, HostAdapter]


class AdapterManager:
    def __init__(
        self,
        config: AdapterConfig,
        base_shape: BaseModelShape,
        backend: kernels.Backend,
        model_dtype: torch.dtype,
        sources: Mapping[str, AdapterSource] | None = None,
    ) -> None:
        self.config = config
        self.base_shape = base_shape
        self.limits = AdapterLimits(max_rank=config.max_rank, max_bytes=config.max_adapter_bytes)
        self.loader = AdapterLoader(base_shape, self.limits, sources or {}, config.allow_local_paths)
        self.host: AdapterCache[AdapterKey, HostAdapter] = AdapterCache(
            size_of=lambda adapter: adapter.num_bytes, max_bytes=config.host_cache_bytes,
            num_workers=config.num_loader_threads,
        )
        self.backend = backend
        layout = backend.lora_layout(model_dtype, list(module_shapes(base_shape).values()))
        num_pages = config.device_pool_bytes // bytes_per_page(base_shape, layout.dtype)
        if num_pages < pages_for_rank(config.max_rank):
            raise ValueError(f"device_pool_bytes {config.device_pool_bytes} cannot hold one adapter of rank "
                             f"{config.max_rank}: it needs {pages_for_rank(config.max_rank)} pages of "
                             f"{bytes_per_page(base_shape, layout.dtype)} bytes")
        self.pages = AdapterPagePool(num_pages, MODULE_NAMES, self.module_ranks)
        self.page_tensors = AdapterPageTensors(layout, base_shape, num_pages, backend.device)

    def parse(self, adapter: AdapterArgument, caller: Caller = Caller()) -> AdapterRequest | None:
        """Accept None, an id string, an `AdapterRef`, a `MergedAdapters` or an `AdapterRequest`."""
        return self.loader.parse(adapter, caller)

    def acquire(self, request: AdapterRequest) -> Lease:
        """Start (or join) the load of the request's adapter (read, then laid out as the device's
        pages, on the loader's threads); the lease pins its host copy until released."""
        return self.host.lease(request.key, lambda: self.page_tensors.prepare(self.loader.load(request)))

    def module_ranks(self, key: Hashable) -> Mapping[str, int] | None:
        """The ranks per module of a loaded adapter (what its pages must hold); None while it is not
        in the host cache."""
        loaded = self.host.get(key)
        return loaded.module_ranks if loaded is not None else None

    def lora_step(self, entries: Sequence[tuple[AdapterKey, AdapterPlacement]], token_entries: Sequence[int]) -> LoraStep:
        """The step's LoRA applier: each entry's weights written into its pages if they are not there
        yet; token_entries [num_tokens] index `entries` (-1 = base model)."""
        for key, placement in entries:
            loaded = self.host.get(key)
            assert loaded is not None, f"adapter {key} is scheduled but not in the host cache"
            self.page_tensors.ensure(key, placement, loaded)
        return LoraStep(self.page_tensors, self.backend, [placement for _, placement in entries], token_entries)

    def close(self) -> None:
        self.host.close()
