"""The runtime's contract with the service: the one module of `lora_runtime` the server imports
(process entry points aside, which build the engine), and torch-free, so that a front end, a client
or a process of the cluster that holds no engine imports it without torch.

It names what crosses between them: the request's parameters (`SamplingParams`) and its cache scope,
the adapter it names (`AdapterRef` parsed from the wire by `parse_adapter_ref`, `AdapterRequest`,
`AdapterKey`, `Caller`, `MergedAdapters`, the `AdapterSource` protocol), what comes back
(`RequestOutput` and its token records), what a front end reads of an engine (`EngineInfo`,
`EngineStats`), the failures (`EngineError` and its subclasses, each naming its wire `error_type`;
HTTP statuses are the server's, `server/errors.py`), the engine backend the service runs
requests on (`EngineBackend`, `EngineStream`), and structured output's wire vocabulary
(`schema_from_response_format`, `JSON_COMPILE_OPTIONS`, the tool-call formats `TOOL_CALL_FORMATS`).

Definitions live in torch-free modules named for what they hold (`core`, `errors`, `engine_info`,
`adapters/refs`, `adapters/merge_request`, `sampling/response_format`, `sampling/tools`); the two that had no such home are defined here."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from lora_runtime.adapters.merge_request import MAX_MERGED_ADAPTERS, MergedAdapters
from lora_runtime.adapters.refs import (SOURCES, AdapterArgument, AdapterKey, AdapterRef, AdapterRequest,
                                        AdapterSource, Caller, LocalSource, merged_id_ref,
                                        parse_adapter_ref, parse_merged_ids)
from lora_runtime.adapters.sources.ids import check_remote, infer_source
from lora_runtime.core import (MAX_TOP_LOGPROBS, CacheScope, FinishReason, PrefillToken, RequestOutput,
                               SamplingParams, TokenInfo, ToolCalling, TopToken)
from lora_runtime.engine_info import AdapterLimits, BaseModelShape, EngineInfo
from lora_runtime.errors import (AdapterAccessError, AdapterIncompatibleError, AdapterInvalidError,
                                 AdapterNotFoundError, AdapterUnavailableError, EngineError, NonFiniteLogitsError,
                                 RequestAbortedError, ValidationError)
from lora_runtime.sampling.response_format import JSON_COMPILE_OPTIONS, schema_from_response_format
from lora_runtime.sampling.tools import TOOL_CALL_FORMATS, ToolCallFormat

__all__ = [
    "JSON_COMPILE_OPTIONS", "MAX_MERGED_ADAPTERS", "MAX_TOP_LOGPROBS", "SOURCES", "TOOL_CALL_FORMATS", "AdapterAccessError", "AdapterArgument", "AdapterIncompatibleError",
    "AdapterInvalidError", "AdapterKey", "AdapterLimits", "AdapterNotFoundError", "AdapterRef", "AdapterRequest",
    "AdapterSource", "AdapterUnavailableError", "BaseModelShape", "CacheScope", "Caller", "EngineBackend",
    "EngineError", "EngineInfo", "EngineStats", "EngineStream", "FinishReason", "LocalSource", "MergedAdapters",
    "NonFiniteLogitsError", "PrefillToken", "RequestAbortedError", "RequestOutput", "SamplingParams", "TokenInfo",
    "ToolCallFormat", "ToolCalling", "TopToken", "ValidationError", "check_remote", "infer_source", "merged_id_ref",
    "parse_adapter_ref", "parse_merged_ids", "schema_from_response_format",
]


@dataclass(frozen=True, slots=True)
class EngineStats:
    # The queues as of the loop thread's last step or commands. Waiting requests also count those not
    # queued yet (their adapter loading, or the loop not there yet); the moment between the loop
    # queuing a request and `add_request` returning counts it twice.
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage_ratio: float  # blocks in use / all blocks, 0..1
    num_steps: int
    num_generated_tokens: int
    num_finished_requests: int
    num_preemptions: int
    num_cached_adapters: int  # loaded in the host cache
    num_pinned_adapters: int  # of those, used by a request in flight
    adapter_cache_bytes: int
    num_resident_adapters: int  # placed in the device pool's pages
    num_free_adapter_pages: int  # in the fullest module's pool: what the next adapter can take
    num_total_adapter_pages: int
    max_resident_adapters: int  # the pool's capacity at the largest allowed rank: sure to fit at once
    # Prefix caching, counted since the start: requests and prompt tokens looked up, and found cached
    # (hit rates: hit / queried); full blocks cached now; cached blocks evicted to make room.
    prefix_cache_queried_requests: int
    prefix_cache_hit_requests: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_cached_kv_blocks: int
    num_evicted_kv_blocks: int
    # The distinct adapters of the running and of the waiting requests, as the counts above.
    running_adapters: tuple[AdapterKey, ...]
    waiting_adapters: tuple[AdapterKey, ...]


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
    """What the service runs requests on: `lora_runtime.AsyncEngine` in the server's own process, or
    `server.cluster.remote.RemoteEngine` over a Ray Serve deployment's replicas. Routes read `info`
    for names and limits and run requests through `add_request`."""

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
