"""The one seam between the HTTP layer and the engine behind it: `lora_runtime.AsyncEngine` in the
server's own process, or `server.cluster.remote.RemoteEngine` over a Ray Serve deployment's
replicas. Routes read `info` for names and limits and run requests through `add_request`."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from lora_runtime.adapters.refs import AdapterRequest
from lora_runtime.async_engine import EngineStats
from lora_runtime.core import CacheScope, RequestOutput, SamplingParams
from lora_runtime.engine_info import EngineInfo


class EngineStream(Protocol):
    """One request's cumulative outputs, the last one finished; a failure raises its EngineError."""

    request_id: str
    replica_id: str | None  # the replica running it, in a cluster

    @property
    def num_generated_tokens(self) -> int: ...

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def abort(self) -> bool:
        """Cancel the request unless it has ended; True when this call cancelled it."""


class EngineBackend(Protocol):
    info: EngineInfo

    @property
    def is_running(self) -> bool: ...

    async def start(self) -> None: ...

    async def shutdown(self, deadline_s: float = 10.0) -> None: ...

    async def add_request(self, prompt: str | list[int], params: SamplingParams,
                          adapter: AdapterRequest | None = None, final_only: bool = False,
                          cache_scope: CacheScope = CacheScope()) -> EngineStream:
        """Validate and queue; validation and adapter failures raise EngineError here. With
        `final_only` the stream yields the finished output alone (a whole answer needs no more).
        `cache_scope`: whose cached prompt blocks the request may reuse (`Engine.add_request`)."""

    def stats(self) -> EngineStats:
        """Safe from any thread; a cluster's are its replicas' summed, as last published."""
