"""The one path every inference route takes (`handle`): the token and its tenant, the deployment,
the body, then admission, the engine, the client watched until the answer is complete, the `x-*`
headers and the metrics.

A route (the TGI/LoRAX ones, the OpenAI-compatible ones) turns its body into an `EngineCall`: the
engine's arguments plus an `Answer`, which renders the engine's outputs in that route's wire
format. Everything else (429/503, disconnects, keep-alives, errors before and after the first
byte, counting) is done here once.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from lora_runtime.api import (AdapterRequest, CacheScope, EngineError, EngineStream, RequestOutput,
                              SamplingParams)
from server.auth import authorize_tenant
from server.body import read_model
from server.bridge import final_output
from server.deployments import resolve_deployment
from server.errors import ApiError, from_engine_error
from server.fan_out import FanOutStream
from server.responses import Timing, generate_headers
from server.state import ServerState, server_state
from server.tenancy import Deployment
from server.streaming import CleanupStreamingResponse, first_output, sse_events

logger = logging.getLogger(__name__)


class Answer(Protocol):
    """How one request's outputs look on its route's wire. A new instance per request: a stream's
    answer remembers what it has sent."""

    def complete(self, output: RequestOutput) -> Any:
        """The JSON body of a finished request."""

    def stream_payloads(self, output: RequestOutput) -> list[dict[str, Any]]:
        """The events for what `output` adds to the previous one (outputs are cumulative)."""

    def error_payload(self, error: ApiError) -> dict[str, Any]:
        """The event of a failure after the first byte."""

    def stream_end(self) -> list[bytes]:
        """Raw bytes sent after the last event (after an error event too)."""


@dataclass(frozen=True, slots=True)
class EngineCall:
    """A request as the engine takes it, and how to answer it."""

    prompt: str | list[int]
    params: SamplingParams
    adapter: AdapterRequest | None
    cache_scope: CacheScope  # the caller's tenant and cache_salt: whose cached prompt blocks it may reuse
    is_stream: bool
    answer: Answer
    identity: dict[str, str]  # x-model-id, x-adapter-id, x-adapter-source (+ x-replica-id in a cluster)
    # Several engine requests answered as one (`server.fan_out`): (prompt, params) each, in place of
    # `prompt` and `params`, and how many choices each contributes.
    fan_out: tuple[tuple[str | list[int], SamplingParams], ...] = ()
    choices_per_request: int = 1


# A route's body to its `EngineCall`: (body, state, deployment, tenant) -> call; raises EngineError.
CallBuilder = Callable[[Any, ServerState, Deployment, str], EngineCall]
# What a route does to a refusal before it is answered (the OpenAI routes name their own fields).
Renamer = Callable[[ApiError, Any], None]


def _keep_names(error: ApiError, body: Any) -> None:
    """The TGI/LoRAX routes' fields are the engine's: their refusals keep the names they have."""


async def handle(request: Request, route: str, tenant_id: str, deployment_name: str, body_type: type,
                 build: CallBuilder, rename: Renamer = _keep_names) -> Response:
    """Serve one inference request, counted under `route` by its status: the bearer token and its
    tenant, the deployment, the body read as `body_type`, `build`'s call, then `serve`."""
    state = server_state(request)
    return await counted(state, route, _read_and_serve(request, state, tenant_id, deployment_name, body_type,
                                                       build, rename))


async def _read_and_serve(request: Request, state: ServerState, tenant_id: str, deployment_name: str,
                          body_type: type, build: CallBuilder, rename: Renamer) -> Response:
    received = time.monotonic()
    tenant = authorize_tenant(request, state.database, tenant_id)
    deployment = resolve_deployment(state.database, tenant, deployment_name)
    body = await read_model(request, body_type, state.config.max_body_bytes)
    try:
        try:
            call = build(body, state, deployment, tenant)
        except EngineError as error:
            raise from_engine_error(error, state.config.retry_after_s) from None
        return await serve(request, state, call, received)
    except ApiError as error:
        rename(error, body)
        raise


async def counted(state: ServerState, route: str, serve: Awaitable[Response]) -> Response:
    """`serve`'s response, counted by route and status (refusals included)."""
    try:
        response = await serve
    except ApiError as error:
        state.metrics.requests.labels(route, str(error.status_code)).inc()
        raise
    state.metrics.requests.labels(route, str(response.status_code)).inc()
    return response


async def serve(request: Request, state: ServerState, call: EngineCall, received: float) -> Response:
    """Admit `call`, run it and answer: the whole body, or SSE. Engine errors raised before the
    first byte become their HTTP status; the request's adapter versions are read here, once."""
    try:
        adapter = await run_in_threadpool(state.adapters.with_current_versions, call.adapter)
        release = state.admission.acquire()
        is_owned_by_response = False
        try:
            stream = await _open_stream(state, call, adapter)
            if stream.replica_id is not None:
                call = dataclasses.replace(call, identity={**call.identity, "x-replica-id": stream.replica_id})
            timing = Timing(received, time.monotonic())
            if not call.is_stream:
                return await _complete(request, stream, call, state, timing)
            response = await _stream_response(request, stream, call, state, timing, release)
            is_owned_by_response = True
            return response
        finally:
            if not is_owned_by_response:
                release()
    except EngineError as error:
        raise from_engine_error(error, state.config.retry_after_s) from None


async def _open_stream(state: ServerState, call: EngineCall, adapter: AdapterRequest | None) -> EngineStream:
    """The call's engine request, or its fanned-out requests as one stream (all or none queued)."""
    streams: list[EngineStream] = []
    try:
        for prompt, params in call.fan_out or ((call.prompt, call.params),):
            streams.append(await state.async_engine.add_request(prompt, params, adapter=adapter,
                                                                final_only=not call.is_stream,
                                                                cache_scope=call.cache_scope))
    except BaseException:
        for stream in streams:
            await stream.abort()
        raise
    return streams[0] if len(streams) == 1 else FanOutStream(streams, call.choices_per_request)


async def _stream_response(request: Request, stream: EngineStream, call: EngineCall,
                           state: ServerState, timing: Timing, release: Callable[[], None]) -> Response:
    """SSE once the first output is in (or `keepalive_s` passed), so that early failures still
    get their own status; from then on the response owns the slot and the stream."""
    async def on_close() -> None:
        try:
            if await stream.abort():  # the stream had not ended: its client left
                _observe_disconnect(request, stream, call, state, timing)
        finally:
            release()

    try:
        first = await first_output(stream, request, state.config.keepalive_s)
    except BaseException:
        await on_close()
        raise
    if first is None:
        await on_close()
        return _client_closed()
    events = sse_events(stream, first, call.answer, state.config.keepalive_s,
                        on_final=lambda output: _observe(state, call, output, timing),
                        to_api_error=lambda error: output_error(error, state))
    return CleanupStreamingResponse(events, on_close, call.identity)


async def _complete(request: Request, stream: EngineStream, call: EngineCall, state: ServerState,
                    timing: Timing) -> Response:
    output = await final_output(stream, request)
    if output is None:
        _observe_disconnect(request, stream, call, state, timing)
        return _client_closed()
    if output.error is not None:
        raise output_error(output.error, state)
    headers = generate_headers(output, timing, call.identity)
    _observe(state, call, output, timing)
    return JSONResponse(call.answer.complete(output), headers=headers)


def output_error(error: Exception, state: ServerState) -> ApiError:
    """The HTTP form of a failure of an accepted request."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, EngineError):
        return from_engine_error(error, state.config.retry_after_s)
    return ApiError(500, "incomplete_generation", f"the engine failed the request: {error}")


def _client_closed() -> Response:
    """The answer to a client that left: nobody reads it; 499 (client closed request) keeps the logs
    and the request metrics honest."""
    return Response(status_code=499)


def _observe_disconnect(request: Request, stream: EngineStream, call: EngineCall, state: ServerState,
                        timing: Timing) -> None:
    """One account of a request aborted because its client left, streamed or not: counted, logged,
    and its tokens counted as generated (the engine did the work)."""
    num_generated = stream.num_generated_tokens
    logger.info("client disconnected; request aborted: %s %s after %.2f s and %d generated tokens",
                request.url.path, stream.request_id, time.monotonic() - timing.received, num_generated)
    state.metrics.observe_disconnect(num_generated)
    state.metrics.observe_adapter_request(call.adapter, num_generated)


def _observe(state: ServerState, call: EngineCall, output: RequestOutput, timing: Timing) -> None:
    times = output.times
    total_s = time.monotonic() - timing.received
    first_token_s = times.first_token - timing.received if times and times.first_token else None
    num_generated = len(output.token_ids) + sum(len(o.token_ids) for o in output.best_of_sequences)
    state.metrics.observe_finished(len(output.prompt_token_ids), num_generated, total_s, first_token_s)
    state.metrics.observe_adapter_request(call.adapter, num_generated)
