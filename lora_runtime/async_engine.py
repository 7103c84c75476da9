"""An asyncio front for the engine: one engine-loop thread, commands in through a queue, each request's
snapshots out through its own asyncio queue. Used by the HTTP server.

The engine is not thread-safe; only the loop thread touches it. Model steps release the GIL inside
torch, so the event loop keeps serving HTTP while a step runs.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from lora_runtime.adapters.cache import AdapterLease
from lora_runtime.adapters.manager import Lease
from lora_runtime.adapters.refs import AdapterArgument, AdapterKey, AdapterRequest, Caller
from lora_runtime.api import EngineStats
from lora_runtime.core import CacheScope, Request, RequestOutput, SamplingParams
from lora_runtime.engine import IDLE_WAIT_S, Engine
from lora_runtime.engine_info import EngineInfo
from lora_runtime.engine_stats import LoopActivity
from lora_runtime.errors import EngineError, RequestAbortedError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Queues:
    """The scheduler's queues, published whole by the loop thread (after its commands, after each step,
    as it queues a request): other threads read them without iterating queues that change under them."""

    num_running: int = 0
    num_waiting: int = 0
    running_adapters: tuple[AdapterKey, ...] = ()
    waiting_adapters: tuple[AdapterKey, ...] = ()


class RequestStream:
    """Async iterator over one request's `RequestOutput` snapshots; the last has `finished=True`;
    with `final_only`, that one alone (a caller that answers only the whole result).
    Leaving early (`aclose`, `abort`, garbage) cancels the request in the engine."""

    replica_id: str | None = None  # one engine in this process (server.cluster's streams name theirs)

    def __init__(self, request_id: str, engine: AsyncEngine, final_only: bool = False) -> None:
        self.request_id = request_id
        self._engine = engine
        self._final_only = final_only
        self._queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._done = False
        # The newest snapshot the engine sent, read or not: what an aborted request had generated.
        self._latest: RequestOutput | None = None

    @property
    def num_generated_tokens(self) -> int:
        """Tokens the engine has generated for this request so far, as far as this stream knows."""
        return len(self._latest.token_ids) if self._latest is not None else 0

    def _push(self, item: RequestOutput | Exception) -> None:
        if isinstance(item, RequestOutput):
            self._latest = item
            if self._final_only and not item.finished:
                return
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, Exception):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    async def abort(self) -> bool:
        """Cancel the request unless its stream has ended; True when this call cancelled it."""
        if self._done:
            return False
        self._done = True
        self._engine.abort(self.request_id)
        return True

    async def aclose(self) -> None:
        await self.abort()


class AsyncEngine:
    def __init__(self, engine: Engine, cpus: Collection[int] | None = None) -> None:
        """`cpus`: where the engine loop runs, and with it the compute threads it starts at its
        first step (a new thread inherits its creator's CPUs); None: wherever the process may."""
        self.engine = engine
        self.cpus = tuple(sorted(cpus)) if cpus is not None else None
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._num_steps = 0
        self._num_generated_tokens = 0
        self._num_finished = 0
        self._last_step_error: Exception | None = None
        self._queues = _Queues()
        # Requests inside `add_request`, by adapter (None: the base model). Replaced, never mutated,
        # so that `stats()` reads it from any thread.
        self._pending: Counter[AdapterKey | None] = Counter()

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        adapter: AdapterArgument = None,
        request_id: str | None = None,
        api_token: str | None = None,
        final_only: bool = False,
        cache_scope: CacheScope = CacheScope(),
    ) -> RequestStream:
        """Load the request's adapter, then validate and queue: validation and adapter failures
        raise EngineError subclasses here, before anything is streamed. With `final_only` the
        stream yields the finished output alone. `cache_scope`: as `Engine.add_request`'s."""
        adapter_request = self.engine.parse_adapter(adapter, Caller(api_token=api_token))
        pending = Counter([adapter_request.key if adapter_request is not None else None])
        self._pending = self._pending + pending
        try:
            lease = await self._load(adapter_request)
            return await self._add(prompt, params, lease or adapter_request, request_id, final_only, cache_scope)
        finally:
            self._pending = self._pending - pending

    async def _load(self, adapter_request: AdapterRequest | None) -> Lease | None:
        """The request's hold on its adapter, loaded: taken once here and handed to the engine with it."""
        if adapter_request is None:
            return None
        lease = self.engine.acquire_adapter(adapter_request)
        try:
            await asyncio.wrap_future(lease.load)
        except BaseException:  # its load failed, or the client left while it loaded
            lease.release()
            raise
        return lease

    async def _add(self, prompt: str | list[int], params: SamplingParams, adapter: AdapterRequest | Lease | None,
                   request_id: str | None, final_only: bool, cache_scope: CacheScope) -> RequestStream:
        """Hand the request to the loop thread, which validates and queues it. A caller cancelled
        before the loop gets to it is never queued (its adapter hold released); one cancelled while
        it is queued has its request aborted as soon as it exists."""
        future: concurrent.futures.Future[RequestStream] = concurrent.futures.Future()

        def add() -> None:
            if not future.set_running_or_notify_cancel():  # from here on, cancel() cannot succeed
                if isinstance(adapter, AdapterLease):
                    adapter.release()
                return
            try:
                new_id = self.engine.add_request(prompt, params, adapter, request_id=request_id,
                                                 cache_scope=cache_scope)
            except Exception as error:  # handed to the caller, who maps it to a status
                future.set_exception(error)
                return
            self._publish_queues()  # before it stops counting as pending
            # The stream itself is handed over: a request may finish, and leave `_streams`, before
            # the caller runs again.
            self._streams[new_id] = RequestStream(new_id, self, final_only)
            future.set_result(self._streams[new_id])

        self._submit(add)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.add_done_callback(self._abort_orphan)
            raise

    def _abort_orphan(self, future: concurrent.futures.Future[RequestStream]) -> None:
        """A request queued for a caller that has left: nobody will read it."""
        if not future.cancelled() and future.exception() is None:
            self.abort(future.result().request_id)

    def abort(self, request_id: str) -> None:
        """Cancel a request; safe from any thread, idempotent."""

        def abort() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

        self._submit(abort)

    def _submit(self, command: Callable[[], None]) -> None:
        """Queue a command for the loop thread and cut short a step waiting idle for an adapter load."""
        self._commands.put(command)
        self.engine.wake()

    def stats(self) -> EngineStats:
        """Safe from any thread: the engine's figures, with the queues the loop thread last published
        whole and the requests `add_request` holds before they reach it."""
        queues, pending = self._queues, self._pending
        pending_adapters = (key for key in pending if key is not None)
        activity = LoopActivity(
            num_running=queues.num_running,
            num_waiting=queues.num_waiting + pending.total(),
            num_steps=self._num_steps,
            num_generated_tokens=self._num_generated_tokens,
            num_finished_requests=self._num_finished,
            running_adapters=queues.running_adapters,
            waiting_adapters=tuple(dict.fromkeys((*queues.waiting_adapters, *pending_adapters))),
        )
        return self.engine.stats(activity)

    def cached_adapters(self) -> tuple[AdapterKey, ...]:
        """The adapters the engine's host cache holds now; safe from any thread."""
        return self.engine.cached_adapters()

    async def shutdown(self, deadline_s: float = 10.0) -> None:
        """Let in-flight requests finish until the deadline, then cancel the rest and stop the loop."""
        end = time.monotonic() + deadline_s
        while self._streams and time.monotonic() < end:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self._fail_stream(request_id, RequestAbortedError("the server is shutting down"))
            self.abort(request_id)
        self._stopping.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)

    def _run(self) -> None:
        if self.cpus is not None:
            os.sched_setaffinity(0, self.cpus)  # this thread only: the caller's threads keep theirs
        while not self._stopping.is_set():
            self._drain_commands(block=not self.engine.has_unfinished_requests())
            self._publish_queues()
            if self.engine.has_unfinished_requests():
                self._step()
        # Aborts queued by `shutdown` just before it set `_stopping` must still free their blocks.
        self._drain_commands(block=False)

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # a broken step fails its requests, never the loop
            logger.exception("engine step failed; failing the running requests")
            self._fail_running(error)
            return
        self._num_steps += 1
        self._publish_queues()  # before the outputs: whoever reads one finds its request counted
        deliveries = [delivery for delivery in map(self._delivery, outputs) if delivery is not None]
        if deliveries and self._loop is not None:
            # One wake-up of the event loop a step, not one a request and token.
            self._loop.call_soon_threadsafe(_deliver, deliveries)

    def _publish_queues(self) -> None:
        scheduler = self.engine.scheduler
        self._queues = _Queues(len(scheduler.running), len(scheduler.waiting),
                               _distinct_adapters(scheduler.running), _distinct_adapters(scheduler.waiting))

    def _delivery(self, output: RequestOutput) -> tuple[RequestStream, RequestOutput | Exception] | None:
        """Count the output; the stream it goes to, and what it gets, unless the stream has gone."""
        stream = self._streams.get(output.request_id)
        if output.finished:
            self._num_finished += 1
            self._num_generated_tokens += len(output.token_ids)
            self._streams.pop(output.request_id, None)
        if stream is None:
            return None
        # A request that failed inside the engine (its adapter did not load) raises in the stream.
        return stream, output.error if output.error is not None else output

    def _fail_running(self, error: Exception) -> None:
        wrapped = RequestAbortedError(f"the engine failed while generating: {error}")
        for request in list(self.engine.scheduler.running):
            self._fail_stream(request.request_id, wrapped)
            self.engine.abort(request.request_id)

    def _fail_stream(self, request_id: str, error: EngineError) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(stream._push, error)


def _deliver(deliveries: list[tuple[RequestStream, RequestOutput | Exception]]) -> None:
    for stream, item in deliveries:
        stream._push(item)


def _distinct_adapters(requests: Iterable[Request]) -> tuple[AdapterKey, ...]:
    return tuple(dict.fromkeys(request.adapter_key for request in requests if request.adapter_key is not None))
