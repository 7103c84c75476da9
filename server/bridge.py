"""The asyncio side of the engine: admission (a bounded number of requests in flight), draining on
shutdown, and running one request while watching its client, so that a client that goes away
cancels its request and frees its KV blocks and adapter pins at once.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from starlette.requests import Request

from lora_runtime.api import RequestOutput
from server.errors import overloaded, shutting_down


class Admission:
    """Counts requests in flight; refuses past `max_in_flight` (429) and while draining (503)."""

    def __init__(self, max_in_flight: int, retry_after_s: int) -> None:
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.num_in_flight = 0
        self.is_draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def acquire(self) -> Callable[[], None]:
        """Admit one request, or raise 503 (draining) / 429 (full) at once; returns its release,
        which is safe to call more than once."""
        if self.is_draining:
            raise shutting_down(self.retry_after_s)
        if self.num_in_flight >= self.max_in_flight:
            raise overloaded(self.retry_after_s)
        self.num_in_flight += 1
        self._idle.clear()
        is_released = False

        def release() -> None:
            nonlocal is_released
            if is_released:
                return
            is_released = True
            self.num_in_flight -= 1
            if self.num_in_flight == 0:
                self._idle.set()

        return release

    def begin_draining(self) -> None:
        self.is_draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when every request in flight finished within `timeout_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone away (the body must have been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def final_output(stream, request: Request) -> RequestOutput | None:
    """Drain `stream` to its final output, or abort it and return None when the client leaves."""
    async def last() -> RequestOutput:
        output = None
        async for output in stream:
            pass
        assert output is not None and output.finished, "engine stream ended without a final output"
        return output

    generation = asyncio.ensure_future(last())
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({generation, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not generation.done():
            generation.cancel()
            await abort_quietly(stream)
            with contextlib.suppress(asyncio.CancelledError):
                await generation
    if generation.cancelled():
        return None
    return generation.result()


async def abort_quietly(stream) -> None:
    """Abort `stream`, shielded from the cancellation that is usually the reason for aborting."""
    await asyncio.shield(stream.abort())
