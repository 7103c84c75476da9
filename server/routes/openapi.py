"""OpenAPI declarations of the inference routes. Bodies are read and validated by hand (so that
malformed JSON and wrong types get the service's error shape), hence declared here explicitly."""
from __future__ import annotations

from typing import Any

from server.streaming import CleanupStreamingResponse

_ERRORS = {
    400: "body is not a JSON object", 401: "missing or unknown token",
    403: "another tenant's path or deployment", 404: "unknown deployment, model, adapter, repo or version",
    409: "the repo already exists",
    413: "body too large", 422: "invalid parameters", 424: "generation failed",
    429: "too many requests in flight", 500: "the engine failed an accepted request",
    503: "shutting down, or the engine is not ready",
}
# Content given explicitly (not `model`): FastAPI would give errors the stream route's media type.
_ERROR_CONTENT = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"description": text, "content": _ERROR_CONTENT} for status, text in _ERRORS.items()
}



def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The documented error responses for `statuses`."""
    return {status: ERROR_RESPONSES[status] for status in statuses}


_INT_HEADER = {"schema": {"type": "string", "pattern": "^[0-9]+$"}}
_MS_HEADER = {"schema": {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?$"}}
_TEXT_HEADER = {"schema": {"type": "string"}}
GENERATE_HEADERS = {
    **{name: _INT_HEADER for name in ("x-prompt-tokens", "x-prompt-cached-tokens", "x-generated-tokens",
                                      "x-total-tokens")},
    **{name: _MS_HEADER for name in ("x-total-time", "x-time-per-token", "x-queue-time",
                                     "x-time-to-first-token", "x-validation-time",
                                     "x-inference-time")},
    **{name: _TEXT_HEADER for name in ("x-model-id", "x-adapter-id", "x-adapter-source")},
}
# OpenAPI 3.1: the schema of an event-stream describes one event; `data` holds a JSON chunk, or
# the error event that ends a stream failing after its first byte.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "contentMediaType": "application/json",
             "contentSchema": {"anyOf": [{"$ref": "#/components/schemas/StreamResponse"},
                                         {"$ref": "#/components/schemas/ErrorResponse"}]}},
    "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}
_SSE = {"text/event-stream": {"schema": _SSE_EVENT}}


def _request_body(schema_name: str) -> dict[str, Any]:
    schema = {"$ref": f"#/components/schemas/{schema_name}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


COMPAT_DOC: dict[str, Any] = {
    "summary": "Generate (the official clients' route); `stream: true` answers with SSE",
    "openapi_extra": _request_body("CompatRequest"),
    "responses": {200: {"description": "a one-element array, or SSE when streaming",
                        "headers": GENERATE_HEADERS,
                        "content": {"application/json": {"schema": {"type": "array",
                                                                    "items": _ref("GenerateResponse")}},
                                    **_SSE}},
                  **ERROR_RESPONSES},
}
GENERATE_DOC: dict[str, Any] = {
    "summary": "Generate text in one response",
    "openapi_extra": _request_body("GenerateRequest"),
    "responses": {200: {"description": "the generated text", "headers": GENERATE_HEADERS,
                        "content": {"application/json": {"schema": _ref("GenerateResponse")}}},
                  **ERROR_RESPONSES},
}
STREAM_DOC: dict[str, Any] = {
    "response_class": CleanupStreamingResponse,
    "summary": "Generate text as server-sent events, one per token",
    "openapi_extra": _request_body("GenerateRequest"),
    "responses": {200: {"description": "one event per token; the last carries the text",
                        "content": _SSE}, **ERROR_RESPONSES},
}


# The OpenAI-compatible routes: OpenAI's error shape, its own body schemas, JSON or SSE answers.
_OPENAI_ERROR_CONTENT = {"application/json": {"schema": _ref("OpenAIErrorResponse")}}
OPENAI_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"description": text, "content": _OPENAI_ERROR_CONTENT}
    for status, text in _ERRORS.items() if status != 409
}
_OPENAI_SSE = {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string"}}}}}


def openai_generation_doc(body_schema: str, summary: str) -> dict[str, Any]:
    return {
        "response_class": CleanupStreamingResponse,
        "summary": summary,
        "openapi_extra": _request_body(body_schema),
        "responses": {200: {"description": "the completion, or SSE chunks ending with `data: [DONE]`",
                            "headers": GENERATE_HEADERS,
                            "content": {"application/json": {"schema": {"type": "object"}}, **_OPENAI_SSE}},
                      **OPENAI_ERROR_RESPONSES},
    }
