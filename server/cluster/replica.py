"""The engine deployment's replica: one `AsyncEngine` on its own copy of the model, serving requests
that the ingress has authenticated, validated and admitted; and the replica directory, where every
replica publishes its state for the ingress's metrics, health and cluster view.

A replica reads adapters as the single server does: pbase from the shared database and blob store,
hub and S3 from the operator's endpoints, each into its own host cache and device pool. Serve's
multiplexing learns which adapters a replica holds from `_note_adapter`, called with each request's
multiplexed model id; Serve's table is bounded by what the replica's pool holds at once, its real
caches by the engine's own LRU.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from lora_runtime import AsyncEngine, Engine, EngineConfig
from lora_runtime.api import (AdapterRequest, CacheScope, EngineError, EngineInfo, RequestAbortedError,
                              RequestOutput, SamplingParams)
from server.adapter_sources import engine_adapter_sources
from server.cluster.remote import REPORT_INTERVAL_S
from server.cluster.wire import Accepted, Failed, Outputs, ReplicaReport
from server.config import ServerConfig
from server.cpu_placement import pin_this_process
from server.db import open_database
from server.registry.models import RegistryBase

logger = logging.getLogger(__name__)


class EngineReplica:
    """Deployed by `server.cluster.app` with `max_ongoing_requests` = the engine's admission bound."""

    async def __init__(self, config: ServerConfig, engine_config: EngineConfig, directory: DeploymentHandle,
                       core_sets: tuple[tuple[int, ...], ...] | None = None, stream_interval: int = 1) -> None:
        self._publisher: asyncio.Task | None = None  # what `__del__` stops, also after a failed start
        self._engine: AsyncEngine | None = None
        self._stream_interval = stream_interval  # outputs a message carries (but the first and the last)
        engine_config = _on_own_cores(engine_config, core_sets)
        database = open_database(config.resolved_database_url, other_metadata=[RegistryBase.metadata])
        engine = Engine.from_config(engine_config, adapter_sources=engine_adapter_sources(config, database))
        self._engine = AsyncEngine(engine)
        await self._engine.start()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        capacity = max(1, self._engine.stats().max_resident_adapters)
        self._note_adapter = serve.multiplexed(max_num_models_per_replica=capacity)(_note_adapter)
        self._directory = directory
        self._publisher = asyncio.create_task(self._publish_forever())
        logger.info("engine replica %s ready: %s, %d adapters resident at most", self.replica_id,
                    engine.model_name, capacity)

    def info(self) -> EngineInfo:
        return self._engine.info

    async def generate(self, prompt: str | list[int], params: SamplingParams, adapter: AdapterRequest | None,
                       cache_scope: CacheScope, final_only: bool) -> AsyncIterator[Accepted | Failed | Outputs]:
        """`Accepted` or `Failed`, then the request's outputs (the finished one alone with
        `final_only`): the first in a message of its own (the client's first token waits for no
        other), then `stream_interval` a message, the last with what is left; a `Failed` ends it,
        after the outputs held back. Cancelled by the ingress (its client left), the request is
        aborted in the engine."""
        model_id = serve.get_multiplexed_model_id()
        if model_id:
            await self._note_adapter(model_id)
        try:
            stream = await self._engine.add_request(prompt, params, adapter=adapter, final_only=final_only,
                                                    cache_scope=cache_scope)
        except EngineError as error:
            yield Failed(error)
            return
        held: list[RequestOutput] = []
        try:
            yield Accepted(self.replica_id, stream.request_id)
            is_first = True
            async for output in stream:
                held.append(output)
                if is_first or output.finished or len(held) == self._stream_interval:
                    yield Outputs(tuple(held))
                    held.clear()
                    is_first = False
        except Exception as error:
            if held:
                yield Outputs(tuple(held))
            yield Failed(error if isinstance(error, EngineError)  # else its message, as the single server's
                         else RequestAbortedError(f"the engine failed the request: {error}"))
        finally:
            await stream.abort()  # a no-op once it ended; the ingress's cancel arrives here too

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine loop stopped is replaced."""
        if not self._engine.is_running:
            raise RuntimeError("the engine loop has stopped")

    async def __del__(self) -> None:
        # Serve waits for requests in flight (graceful_shutdown_timeout_s) before this.
        if self._publisher is not None:
            self._publisher.cancel()
        if self._engine is not None:
            await self._engine.shutdown(0.0)

    def _report(self) -> ReplicaReport:
        return ReplicaReport(self.replica_id, self._engine.stats(), self._engine.cached_adapters())

    async def _publish_forever(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # the directory restarting: publish again next time
                await self._directory.publish.remote(self._report())
            await asyncio.sleep(REPORT_INTERVAL_S)


def _on_own_cores(config: EngineConfig, core_sets: tuple[tuple[int, ...], ...] | None) -> EngineConfig:
    """Pin this replica's process to its set of cores (the set of its rank among the replicas on
    this machine; a set shared, with a warning, where Serve runs more replicas than sets for a while),
    before its engine loads: one compute thread per core unless configured."""
    if core_sets is None:
        return config
    rank = serve.get_replica_context().rank.local_rank
    cores = core_sets[rank % len(core_sets)]
    if rank >= len(core_sets):
        logger.warning("replica of rank %d beyond the %d core sets: sharing cores %s", rank, len(core_sets), cores)
    pin_this_process(cores)
    num_threads = config.num_threads or len(cores)
    logger.info("engine replica of rank %d on cores %s, %d compute threads", rank, ",".join(map(str, cores)), num_threads)
    return dataclasses.replace(config, num_threads=num_threads)


async def _note_adapter(model_id: str) -> str:
    """Serve's multiplexed "model": only the id, so that Serve reports this replica as holding the
    adapter. The weights are the engine's to load (when the request is added) and to evict."""
    return model_id


class ReplicaDirectory:
    """The replicas' latest reports, one deployment replica: what the ingress reads for its metrics,
    its health and `GET /cluster`."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[ReplicaReport, float]] = {}  # replica id -> (report, received at)

    def publish(self, report: ReplicaReport) -> None:
        self._reports[report.replica_id] = (report, time.monotonic())

    def reports(self, max_age_s: float) -> list[ReplicaReport]:
        """The reports received within `max_age_s`, with their age; older ones (replicas gone) are forgotten."""
        now = time.monotonic()
        self._reports = {rid: entry for rid, entry in self._reports.items() if now - entry[1] <= max_age_s}
        return [dataclasses.replace(report, age_s=now - received)
                for report, received in sorted(self._reports.values(), key=lambda entry: entry[0].replica_id)]
