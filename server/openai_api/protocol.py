"""Request bodies of the OpenAI-compatible routes (docs/api.md section 8).

Every field OpenAI's API defines is declared, so that none is silently dropped: the sampling ones
map onto the engine (`server.openai_api.params`), the few that are ignored by design say so here,
and the ones this server cannot honour are refused by name unless sent with their neutral value.
Unknown fields are ignored, as on the TGI routes. Extra fields our peers accept too: `top_k`,
`repetition_penalty`, `cache_salt` (vLLM's: the request's prefix-cache blocks are reused only by
requests with the same salt), and our adapter fields `adapter_source` and `api_token` (the hub token).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI pads its chunks; ours are not padded


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # ignored: chat templates do not render it
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None


class _Sampling(_Body):
    """What both routes share."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None  # ignored by design: an end-user id for OpenAI's abuse monitoring
    # Extensions.
    top_k: int | None = None
    repetition_penalty: float | None = None
    cache_salt: str | None = None
    adapter_source: str | None = None
    api_token: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    # Tool calling (`server.openai_api.tools`).
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    tool_prompt: str | None = None  # TGI's: the text that introduces the tools in the prompt
    parallel_tool_calls: bool | None = None
    # Refused unless neutral (`server.openai_api.params`, `server.openai_api.tools` for functions).
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: Any = None
    store: bool | None = None
    # Ignored by design: hints to OpenAI's own infrastructure (tiers, caching, storage metadata).
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: Any = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class OpenAIErrorResponse(BaseModel):
    error: ErrorDetail
