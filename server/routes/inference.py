"""The inference routes under `/{tenant_id}/deployments/v2/llms/{deployment_name}` (docs/api.md section 1).

Order of checks: token, tenant, deployment, body, parameters, admission, engine validation; all of
them before the first response byte, so each failure gets its own status and JSON body. What
follows the parameters is `server.serving`'s, shared with the OpenAI-compatible routes.
"""
from __future__ import annotations

import enum

from fastapi import APIRouter, Request
from fastapi.responses import Response

from lora_runtime.api import CacheScope, ValidationError
from server.params import (
    AdapterScope,
    adapter_headers,
    adapter_reference,
    adapter_scope,
    to_sampling_params,
    top_counts,
)
from server.protocol import CompatRequest, GenerateRequest
from server.responses import TgiAnswer
from server.routes.openapi import COMPAT_DOC, GENERATE_DOC, STREAM_DOC
from server.serving import EngineCall, handle
from server.state import ServerState
from server.tenancy import Deployment

PREFIX = "/{tenant_id}/deployments/v2/llms/{deployment_name}"
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
    body_type = CompatRequest if mode is Mode.COMPAT else GenerateRequest

    def build(body: GenerateRequest, state: ServerState, deployment: Deployment, tenant: str) -> EngineCall:
        is_stream = mode is Mode.STREAM or (mode is Mode.COMPAT and bool(body.stream))
        return _engine_call(body, state, adapter_scope(tenant, deployment, state.config), is_stream,
                            as_array=mode is Mode.COMPAT, base_model=deployment.base_model)

    return await handle(request, mode.value, tenant_id, deployment_name, body_type, build)


def _engine_call(body: GenerateRequest, state: ServerState, scope: AdapterScope, is_stream: bool,
                 as_array: bool, base_model: str) -> EngineCall:
    """The engine's arguments and the TGI answer; raises EngineError (422) on refusal."""
    if not body.inputs:
        raise ValidationError("inputs", "must not be empty")
    params = to_sampling_params(body.parameters, state.config, is_stream)
    answer = TgiAnswer(body.inputs, params, top_counts(body.parameters), as_array)
    salt = body.parameters.cache_salt if body.parameters is not None else None
    adapter = adapter_reference(body.parameters, scope)
    return EngineCall(prompt=body.inputs, params=params, adapter=adapter,
                      cache_scope=CacheScope(scope.tenant, salt), is_stream=is_stream, answer=answer,
                      identity={"x-model-id": base_model, **adapter_headers(adapter)})
