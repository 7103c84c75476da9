"""The ingress's engine: `RemoteEngine`, the `EngineBackend` over the engine deployment's replicas.

A request goes to a replica through Ray Serve's handle with its adapter's multiplexed model id, so
Serve's router sends it where that adapter was served before (base-model requests: the less loaded
of two replicas, Serve's default). The request's `CacheScope` (tenant, cache_salt) travels with it,
so a replica reuses cached prompt blocks within that scope only; routing needs no part of it (an
adapter's model id already names its tenant, and a salt only narrows reuse). The replica answers
`Accepted` or `Failed` first, so that validation and adapter errors keep their status; outputs
follow. Ray's failures become the service's: every replica full past the router's queue -> 429; a
replica that died or cannot be reached -> 503 before the first byte, an error event after it.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator

from ray import exceptions as ray_errors
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from lora_runtime.api import (AdapterRequest, CacheScope, EngineError, EngineInfo, EngineStats,
                              RequestOutput, SamplingParams)
from server.cluster.wire import Accepted, Failed, Outputs, ReplicaReport, adapter_model_id

logger = logging.getLogger(__name__)
# How often the ingress reads the replicas' reports, and how old a report may be before its replica
# counts as gone (replicas publish every `REPORT_INTERVAL_S`).
REPORT_INTERVAL_S = 0.5
REPORT_MAX_AGE_S = 5.0


class ReplicaUnavailableError(EngineError):
    """The replica running the request died or could not be reached."""

    error_type = "replica_unavailable"


class ClusterOverloadedError(EngineError):
    """Every replica is at its admission bound and the router's queue is full."""

    error_type = "overloaded"


@contextlib.contextmanager
def _service_errors() -> Iterator[None]:
    """Ray's failures as the service's: a full router queue (raised as a request is sent) -> 429, a
    replica that died or cannot be reached -> 503."""
    try:
        yield
    except BackPressureError:
        raise ClusterOverloadedError("every replica is at its bound of requests in flight; retry later") from None
    except (ray_errors.RayActorError, ray_errors.ActorUnavailableError, DeploymentUnavailableError) as error:
        logger.warning("engine replica lost: %s", error)
        raise ReplicaUnavailableError("the engine replica serving this request is gone; retry") from None


async def _next_item(response: DeploymentResponseGenerator) -> object:
    with _service_errors():
        return await response.__anext__()


class RemoteStream:
    """One request's outputs as its replica yields them (`EngineStream`), one at a time from the
    messages that carry several."""

    def __init__(self, response: DeploymentResponseGenerator, accepted: Accepted) -> None:
        self.request_id = accepted.request_id
        self.replica_id: str | None = accepted.replica_id
        self._response = response
        self._done = False  # the replica has nothing more to send (or the request was cancelled)
        self._ready: collections.deque[RequestOutput] = collections.deque()  # received, not yet read
        self._latest: RequestOutput | None = None

    @property
    def num_generated_tokens(self) -> int:
        return len(self._latest.token_ids) if self._latest is not None else 0

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._ready:
            await self._receive()
        return self._ready.popleft()

    async def _receive(self) -> None:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await _next_item(self._response)
        except StopAsyncIteration:
            item = Failed(ReplicaUnavailableError("the engine replica ended the request without an answer"))
        except EngineError:  # the replica is gone: nothing left to abort
            self._done = True
            raise
        # Anything else (the caller cancelled: its client left) leaves the request running on the
        # replica until `abort` cancels it there.
        if isinstance(item, Failed):
            self._done = True
            raise item.error
        assert isinstance(item, Outputs), f"unexpected item from a replica: {type(item).__name__}"
        self._ready.extend(item.outputs)
        self._latest = item.outputs[-1]
        self._done = self._latest.finished

    async def abort(self) -> bool:
        """Cancel the request on its replica (Serve cancels the replica's generator) unless it ended."""
        if self._done:
            return False
        self._done = True
        self._response.cancel()
        return True


class RemoteEngine:
    """`EngineBackend` over the engine deployment; `stats()` sums the replicas' latest reports."""

    def __init__(self, engine: DeploymentHandle, directory: DeploymentHandle, info: EngineInfo) -> None:
        self.info = info
        self._engine = engine
        self._directory = directory
        self._reports: tuple[ReplicaReport, ...] = ()
        self._fetched_at = 0.0  # time.monotonic() of the last read of the directory
        self._poller: asyncio.Task | None = None

    @property
    def is_running(self) -> bool:
        """Serving: started, and at least one replica reported lately."""
        return self._poller is not None and not self._poller.done() and bool(self.reports())

    async def start(self) -> None:
        await self._fetch_reports()
        self._poller = asyncio.create_task(self._poll())

    async def shutdown(self, deadline_s: float = 10.0) -> None:
        """Stop reading reports; the replicas and their requests are Serve's to stop."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller

    async def add_request(self, prompt: str | list[int], params: SamplingParams,
                          adapter: AdapterRequest | None = None, final_only: bool = False,
                          cache_scope: CacheScope = CacheScope()) -> RemoteStream:
        """With `final_only`, the replica sends the finished output alone: one Ray item, not one a
        token (the ingress then cannot count the tokens of a request its client left)."""
        model_id = adapter_model_id(adapter.key) if adapter is not None else ""
        handle = self._engine.options(stream=True, multiplexed_model_id=model_id)
        with _service_errors():
            response = handle.generate.remote(prompt, params, adapter, cache_scope, final_only)
        try:
            first = await _next_item(response)
        except StopAsyncIteration:
            raise ReplicaUnavailableError("the engine replica ended the request without an answer") from None
        except BaseException:
            response.cancel()
            raise
        if isinstance(first, Failed):
            raise first.error
        assert isinstance(first, Accepted), f"unexpected first item from a replica: {type(first).__name__}"
        return RemoteStream(response, first)

    def reports(self) -> tuple[ReplicaReport, ...]:
        """The replicas that reported within `REPORT_MAX_AGE_S`, as they last did; none once the
        directory itself has not answered for that long."""
        return self._reports if time.monotonic() - self._fetched_at <= REPORT_MAX_AGE_S else ()

    def stats(self) -> EngineStats:
        return sum_stats(report.stats for report in self.reports())

    async def _fetch_reports(self) -> None:
        self._reports = tuple(await self._directory.reports.remote(REPORT_MAX_AGE_S))
        self._fetched_at = time.monotonic()

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(REPORT_INTERVAL_S)
            try:
                await self._fetch_reports()
            except Exception as error:  # the directory restarting: keep the last reports until they age
                logger.warning("replica reports unavailable: %s", error)


def sum_stats(stats: Iterable[EngineStats]) -> EngineStats:
    """The cluster's stats: counts summed, the KV usage of all blocks, the adapters of every replica."""
    stats = list(stats)
    if not stats:
        return EngineStats(*(0 if field.type in ("int", "float") else () for field in dataclasses.fields(EngineStats)))
    totals = {}
    for field in dataclasses.fields(EngineStats):
        values = [getattr(item, field.name) for item in stats]
        if isinstance(values[0], tuple):
            totals[field.name] = tuple(dict.fromkeys(key for value in values for key in value))
        else:
            totals[field.name] = sum(values)
    used = totals["num_total_blocks"] - totals["num_free_blocks"]
    totals["kv_cache_usage_ratio"] = used / totals["num_total_blocks"] if totals["num_total_blocks"] else 0.0
    return EngineStats(**totals)
