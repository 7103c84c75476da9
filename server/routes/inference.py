"""The inference routes under `/{tenant_id}/deployments/v2/llms/{deployment_name}` (docs/api.md section 1).

Order of checks: token, tenant, deployment, body, parameters, admission, engine validation; all of
them before the first response byte, so each failure gets its own status and JSON body.
"""
from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from lora_runtime.adapters.refs import AdapterRequest
from lora_runtime.async_engine import RequestStream
from lora_runtime.core import RequestOutput, SamplingParams
from lora_runtime.errors import EngineError, ValidationError
from server.auth import authorize_tenant
from server.body import read_model
from server.bridge import final_output
from server.deployments import resolve_deployment
from server.errors import ApiError, from_engine_error
from server.params import adapter_headers, adapter_reference, to_sampling_params
from server.protocol import CompatRequest, GenerateRequest
from server.responses import Timing, generate_headers, generate_response
from server.routes.openapi import COMPAT_DOC, GENERATE_DOC, STREAM_DOC
from server.state import ServerState, server_state
from server.streaming import CleanupStreamingResponse, first_output, sse_events

PREFIX = "/{tenant_id}/deployments/v2/llms/{deployment_name}"
logger = logging.getLogger(__name__)
router = APIRouter(tags=["inference"])


class Mode(enum.Enum):
    COMPAT = "compat"  # the base route: `stream` in the body chooses; JSON answers are arrays
    GENERATE = "generate"
    STREAM = "generate_stream"


@router.post(PREFIX, **COMPAT_DOC)
async def compat(request: Request, tenant_id: str, deployment_name: str) -> Response:
    return await _handle(request, tenant_id, deployment_name, Mode.COMPAT)


@router.post(PREFIX + "/generate", **GENERATE_DOC)
async def generate(request: Request, tenant_id: str, deployment_name: str) -> Response:
    return await _handle(request, tenant_id, deployment_name, Mode.GENERATE)


@router.post(PREFIX + "/generate_stream", **STREAM_DOC)
async def generate_stream(request: Request, tenant_id: str, deployment_name: str) -> Response:
    return await _handle(request, tenant_id, deployment_name, Mode.STREAM)


async def _handle(request: Request, tenant_id: str, deployment_name: str, mode: Mode) -> Response:
    state = server_state(request)
    try:
        response = await _serve(request, state, tenant_id, deployment_name, mode)
    except ApiError as error:
        state.metrics.requests.labels(mode.value, str(error.status_code)).inc()
        raise
    state.metrics.requests.labels(mode.value, str(response.status_code)).inc()
    return response


async def _serve(request: Request, state: ServerState, tenant_id: str, deployment_name: str,
                 mode: Mode) -> Response:
    received = time.monotonic()
    tenant = authorize_tenant(request, state.database, tenant_id)
    deployment = resolve_deployment(state.database, tenant, deployment_name)
    body = await read_model(request, CompatRequest if mode is Mode.COMPAT else GenerateRequest,
                            state.config.max_body_bytes)
    is_stream = mode is Mode.STREAM or (mode is Mode.COMPAT and bool(body.stream))
    identity = {"x-model-id": deployment.base_model, **adapter_headers(body.parameters)}
    try:
        params, adapter = _engine_arguments(body, state, tenant, is_stream)
        adapter = await run_in_threadpool(state.adapters.with_current_versions, adapter)
        release = state.admission.acquire()
        is_owned_by_response = False
        try:
            stream = await state.async_engine.add_request(body.inputs, params, adapter=adapter)
            timing = Timing(received, time.monotonic())
            if not is_stream:
                return await _complete(request, stream, body.inputs, params, state, timing,
                                       identity, as_array=mode is Mode.COMPAT)
            response = await _stream_response(request, stream, body.inputs, params, state, timing,
                                              identity, release)
            is_owned_by_response = True
            return response
        finally:
            if not is_owned_by_response:
                release()
    except EngineError as error:
        raise from_engine_error(error, state.config.retry_after_s) from None


def _engine_arguments(body: GenerateRequest, state: ServerState, tenant: str,
                      is_stream: bool) -> tuple[SamplingParams, AdapterRequest | None]:
    """The engine's parameters and adapter argument; raises EngineError (422) on refusal."""
    if not body.inputs:
        raise ValidationError("inputs", "must not be empty")
    params = to_sampling_params(body.parameters, state.config, is_stream)
    return params, adapter_reference(body.parameters, tenant)


async def _stream_response(request: Request, stream: RequestStream, inputs: str,
                           params: SamplingParams, state: ServerState, timing: Timing,
                           identity: dict[str, str], release: Callable[[], None]) -> Response:
    """SSE once the first output is in (or `keepalive_s` passed), so that early failures still
    get their own status; from then on the response owns the slot and the stream."""
    async def on_close() -> None:
        try:
            if await stream.abort():  # the stream had not ended: its client left
                _observe_disconnect(request, stream, state, timing)
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
    events = sse_events(stream, first, inputs, params, state.config.keepalive_s,
                        on_final=lambda output: _observe(state, output, timing))
    return CleanupStreamingResponse(events, on_close, identity)


async def _complete(request: Request, stream: RequestStream, inputs: str, params: SamplingParams,
                    state: ServerState, timing: Timing, identity: dict[str, str],
                    as_array: bool) -> Response:
    output = await final_output(stream, request)
    if output is None:
        _observe_disconnect(request, stream, state, timing)
        return _client_closed()
    if output.error is not None:
        raise _output_error(output.error, state)
    headers = generate_headers(output, timing, identity)
    _observe(state, output, timing)
    body = generate_response(output, inputs, params).model_dump(mode="json", by_alias=True)
    return JSONResponse([body] if as_array else body, headers=headers)


def _output_error(error: Exception, state: ServerState) -> ApiError:
    if isinstance(error, EngineError):
        return from_engine_error(error, state.config.retry_after_s)
    return ApiError(500, "incomplete_generation", f"the engine failed the request: {error}")


def _client_closed() -> Response:
    """The answer to a client that left: nobody reads it; 499 (client closed request) keeps the logs
    and the request metrics honest."""
    return Response(status_code=499)


def _observe_disconnect(request: Request, stream: RequestStream, state: ServerState,
                        timing: Timing) -> None:
    """One account of a request aborted because its client left, streamed or not: counted, logged,
    and its tokens counted as generated (the engine did the work)."""
    num_generated = stream.num_generated_tokens
    logger.info("client disconnected; request aborted: %s %s after %.2f s and %d generated tokens",
                request.url.path, stream.request_id, time.monotonic() - timing.received, num_generated)
    state.metrics.observe_disconnect(num_generated)


def _observe(state: ServerState, output: RequestOutput, timing: Timing) -> None:
    times = output.times
    total_s = time.monotonic() - timing.received
    first_token_s = times.first_token - timing.received if times and times.first_token else None
    state.metrics.observe_finished(len(output.prompt_token_ids), len(output.token_ids), total_s,
                                   first_token_s)
