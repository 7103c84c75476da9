"""The OpenAI-compatible routes, Predibase's shape: the unmodified `openai` client works with
`base_url = {server}/{tenant_id}/deployments/v2/llms/{deployment_name}/v1` and a bearer token as its
API key, and `model` names the adapter (docs/api.md section 8).

Token, tenant and deployment are checked as on the TGI routes; the body becomes an `EngineCall`
and takes `server.serving`'s one path (admission, disconnects, headers, metrics). Errors have
OpenAI's shape (`server.errors`), with the request's own parameter names.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from lora_runtime.api import CacheScope, ValidationError
from server.auth import authorize_tenant
from server.deployments import resolve_deployment
from server.errors import ApiError
from server.openai_api.answers import ChatAnswer, CompletionAnswer
from server.openai_api.params import (
    adapter_for,
    chat_inputs,
    chat_sampling_params,
    completion_prompts,
    completion_sampling_params,
    is_tgi_client,
    wire_name,
)
from server.openai_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from server.openai_api.tgi_chat import TgiChatAnswer
from server.openai_api.tools import tool_plan
from server.fan_out import fan_out_requests
from server.params import adapter_scope
from server.routes.inference import PREFIX
from server.routes.openapi import OPENAI_ERROR_RESPONSES, openai_generation_doc
from server.serving import CallBuilder, EngineCall, handle
from server.state import ServerState, server_state
from server.tenancy import Deployment

OPENAI_PREFIX = PREFIX + "/v1"
router = APIRouter(tags=["openai"])
# Far more than a tenant keeps; the list is one page, as OpenAI's.
_MAX_LISTED_REPOS = 10_000
# When this server started (its routes were loaded): the base model's `created` when its files'
# time is unknown.
_STARTED = int(time.time())

Body = ChatCompletionRequest | CompletionRequest


@router.get(OPENAI_PREFIX + "/models", response_model=ModelList,
            responses={status: OPENAI_ERROR_RESPONSES[status] for status in (401, 403, 404)})
async def list_models(request: Request, tenant_id: str, deployment_name: str) -> ModelList:
    """The deployment's base model and every registry adapter version the tenant can use on it: all
    its unarchived versions, since uploads are validated against this server's model (a version's
    `baseModel` is what its PEFT config names, often a hub id rather than the deployment's name)."""
    state = server_state(request)
    tenant = authorize_tenant(request, state.database, tenant_id)
    deployment = resolve_deployment(state.database, tenant, deployment_name)
    repos = await run_in_threadpool(state.adapters.registry.list_repos, tenant, _MAX_LISTED_REPOS)
    context = state.engine_info.max_model_len
    cards = [ModelCard(id=deployment.base_model, created=_base_model_created(state.engine_info.tokenizer),
                       owned_by="lora-serve",
                       root=deployment.base_model, max_model_len=context)]
    for repo in repos:
        for version in repo.versions:
            if version.archived:
                continue
            adapter_id = f"{version.repo}/{version.tag}"
            cards.append(ModelCard(id=adapter_id, created=int(version.created_at.timestamp()),
                                   owned_by=tenant, root=adapter_id, parent=deployment.base_model,
                                   max_model_len=context))
    return ModelList(data=cards)


def _base_model_created(tokenizer: Any) -> int:
    """When the base model's files were written: its local directory's config.json (the embedded
    model's conversion, or the operator's copy); else, for a model named by hub id, when this
    server started."""
    config = Path(tokenizer.name_or_path) / "config.json"
    return int(config.stat().st_mtime) if config.is_file() else _STARTED


@router.post(OPENAI_PREFIX + "/chat/completions",
             **openai_generation_doc("ChatCompletionRequest", "OpenAI chat completion; `model` names the adapter"))
async def chat_completions(request: Request, tenant_id: str, deployment_name: str) -> Response:
    return await _handle(request, tenant_id, deployment_name, ChatCompletionRequest, _chat_call)


@router.post(OPENAI_PREFIX + "/completions",
             **openai_generation_doc("CompletionRequest", "OpenAI (legacy) completion; `model` names the adapter"))
async def completions(request: Request, tenant_id: str, deployment_name: str) -> Response:
    return await _handle(request, tenant_id, deployment_name, CompletionRequest, _completion_call)


async def _handle(request: Request, tenant_id: str, deployment_name: str, body_type: type[Body],
                  build: CallBuilder) -> Response:
    route = "chat_completions" if body_type is ChatCompletionRequest else "completions"
    return await handle(request, route, tenant_id, deployment_name, body_type, build, _name_for)


def _name_for(error: ApiError, body: Body) -> None:
    """The refusal naming the request's parameters rather than the engine's fields."""
    if error.param is not None:
        name = wire_name(error.param, body)
        if error.message.startswith(error.param + ":"):
            error.message = name + error.message[len(error.param):]
        error.param = name


def _chat_call(body: ChatCompletionRequest, state: ServerState, deployment: Deployment,
               tenant: str) -> EngineCall:
    tools = tool_plan(body, state.config.tool_call_format)
    params = chat_sampling_params(body, state.config, tools)
    adapter, adapter_headers = adapter_for(body, adapter_scope(tenant, deployment, state.config))
    answer_type = TgiChatAnswer if is_tgi_client(body) else ChatAnswer
    answer = answer_type(_model_name(body, deployment), params, params.best_of, _include_usage(body),
                         logprobs=bool(body.logprobs))
    prompt = chat_inputs(body.messages, tools)
    requests, choices_per_request = fan_out_requests([prompt], params, params.best_of, bool(body.stream))
    return EngineCall(prompt=prompt, params=params, adapter=adapter,
                      cache_scope=CacheScope(tenant, body.cache_salt), is_stream=bool(body.stream), answer=answer,
                      identity={"x-model-id": deployment.base_model, **adapter_headers},
                      fan_out=requests, choices_per_request=choices_per_request)


def _completion_call(body: CompletionRequest, state: ServerState, deployment: Deployment,
                     tenant: str) -> EngineCall:
    params = completion_sampling_params(body, state.config)
    prompts = completion_prompts(body.prompt)
    adapter, adapter_headers = adapter_for(body, adapter_scope(tenant, deployment, state.config))
    echo_texts = None
    if body.echo:
        echo_texts = [p if isinstance(p, str) else state.engine_info.tokenizer.decode(p) for p in prompts]
    n = body.n or 1
    requests, choices_per_request = fan_out_requests(prompts, params, n, bool(body.stream))
    answer = CompletionAnswer(_model_name(body, deployment), params, len(prompts) * n, _include_usage(body),
                              logprobs=body.logprobs, echo_texts=echo_texts, choices_per_prompt=n)
    return EngineCall(prompt=prompts[0], params=params, adapter=adapter,
                      cache_scope=CacheScope(tenant, body.cache_salt), is_stream=bool(body.stream), answer=answer,
                      identity={"x-model-id": deployment.base_model, **adapter_headers},
                      fan_out=requests, choices_per_request=choices_per_request)


def _model_name(body: Body, deployment: Deployment) -> str:
    """The `model` of the answer: the request's, or the base model's when it named none."""
    return body.model or deployment.base_model


def _include_usage(body: Body) -> bool:
    if body.stream_options is not None and not body.stream:
        raise ValidationError("stream_options", "only allowed with stream: true")
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)
