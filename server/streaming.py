"""Server-sent events for one engine stream (docs/api.md section 4): the events the route's answer
renders, `:` comments after silence, an error event after the first byte, and cleanup (abort,
admission slot) however the response ends."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from lora_runtime.api import EngineError, EngineStream, RequestOutput
from server.bridge import wait_for_disconnect
from server.errors import ApiError
from server.responses import SSE_KEEPALIVE, sse_event

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def first_output(stream: EngineStream, request: Request, wait_s: float) -> asyncio.Future | None:
    """Start fetching the stream's first output and wait up to `wait_s` for it, so that failures
    known by then (a failed first step, say) are raised before the response starts. Returns the
    pending fetch, to be handed to `sse_events`, or None when the client left meanwhile: a long
    prompt's prefill can take all of `wait_s`, and nothing else watches the client until the
    response starts."""
    pending = asyncio.ensure_future(stream.__anext__())
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({pending, watcher}, timeout=wait_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if watcher in done:
        pending.cancel()
        return None
    if pending in done and isinstance(pending.exception(), EngineError):
        raise pending.exception()
    return pending


async def with_keepalive(stream, first: asyncio.Future,
                         interval_s: float) -> AsyncIterator[RequestOutput | None]:
    """The stream's outputs from the pending fetch `first` on, with None whenever `interval_s`
    passes without one."""
    pending: asyncio.Future | None = first
    try:
        while True:
            pending = pending or asyncio.ensure_future(stream.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            finished, pending = pending, None
            if isinstance(finished.exception(), StopAsyncIteration):
                return
            yield finished.result()
    finally:
        if pending is not None:
            pending.cancel()


async def sse_events(stream, first: asyncio.Future, answer, keepalive_s: float,
                     on_final: Callable[[RequestOutput], None],
                     to_api_error: Callable[[Exception], ApiError]) -> AsyncIterator[bytes]:
    """The response body, rendered by `answer` (a `server.serving.Answer`); `on_final` sees the
    final output as it arrives, before its events are sent, so that a client leaving during them
    does not take the request out of the counts."""
    try:
        async for output in with_keepalive(stream, first, keepalive_s):
            if output is None:
                yield SSE_KEEPALIVE
                continue
            if output.error is not None:
                yield sse_event(answer.error_payload(to_api_error(output.error)))
                break
            if output.finished:
                on_final(output)
            for payload in answer.stream_payloads(output):
                yield sse_event(payload)
            if output.finished:
                break
    except EngineError as error:
        yield sse_event(answer.error_payload(to_api_error(error)))
    for tail in answer.stream_end():
        yield tail


class CleanupStreamingResponse(StreamingResponse):
    """A streaming response that runs `on_close` however it ends: finished, failed, or the client
    gone before or during the body (Starlette then cancels the body without closing it)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str], status_code: int = 200) -> None:
        super().__init__(content, status_code, headers={**SSE_HEADERS, **headers})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Shielded: the usual reason to get here is a cancellation, and cleanup must still run.
            await asyncio.shield(self._on_close())
