"""The service's HTTP errors and their JSON shape, `{"error": ..., "error_type": ...}` (docs/api.md
section 6), or OpenAI's `{"error": {message, type, param, code}}` on the OpenAI-compatible routes. The engine's errors and the service's own (`ServiceError`: the registry's)
name what went wrong by their `error_type`; `STATUS_OF_ERROR_TYPE` is the one place that gives each
its HTTP status. `ApiError`s are the refusals only the HTTP layer raises (auth, routing, body,
admission), their status given."""
from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lora_runtime.api import EngineError, ValidationError

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """A refusal with a status, an error type and a message, plus optional response headers and
    the request field it concerns (`param`, shown by the OpenAI error shape)."""

    def __init__(
        self, status_code: int, error_type: str, message: str, headers: dict[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.error_type = error_type
        self.message = message
        self.headers = headers or {}
        self.param = param


class ServiceError(Exception):
    """A failure of the service's own parts (the registry), named by its wire `error_type`."""

    error_type = "bad_request"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


# The HTTP status of every `error_type` an engine or service error carries (docs/api.md section 6).
STATUS_OF_ERROR_TYPE = {
    "bad_request": 400,
    "forbidden": 403, "adapter_access": 403,
    "not_found": 404, "adapter_not_found": 404,
    "conflict": 409,
    "payload_too_large": 413,
    "validation": 422, "adapter_incompatible": 422, "adapter_invalid": 422,
    "generation": 424, "adapter_unavailable": 424,
    "overloaded": 429, "too_many_uploads": 429,
    "incomplete_generation": 500,
    "replica_unavailable": 503,
}


def bad_request(message: str) -> ApiError:
    return ApiError(400, "bad_request", message)


def unauthenticated(message: str) -> ApiError:
    return ApiError(401, "authentication", message, {"WWW-Authenticate": "Bearer"})


def forbidden(message: str) -> ApiError:
    return ApiError(403, "forbidden", message)


def not_found(message: str) -> ApiError:
    return ApiError(404, "not_found", message)


def model_not_found(field: str, model: str, base_model: str, models_path: str) -> ApiError:
    """`field` names neither this deployment's model nor an adapter this server could serve."""
    return ApiError(404, "model_not_found",
                    f"{field}: {model!r} is not a model of this deployment, whose base model is "
                    f"{base_model!r}, nor an adapter this server can serve (it serves no hub adapters); "
                    f"GET {models_path} lists the base model and the adapters you can name", param=field)


def validation(message: str, param: str | None = None) -> ApiError:
    return ApiError(422, "validation", message, param=param)


def overloaded(retry_after_s: int) -> ApiError:
    return ApiError(429, "overloaded", "too many requests in flight; retry later",
                    {"Retry-After": str(retry_after_s)})


def shutting_down(retry_after_s: int) -> ApiError:
    return ApiError(503, "shutting_down", "the server is shutting down", {"Retry-After": str(retry_after_s)})


def payload_too_large(limit_bytes: int) -> ApiError:
    return ApiError(413, "payload_too_large", f"request body is larger than {limit_bytes} bytes")


def from_engine_error(error: EngineError | ServiceError, retry_after_s: int) -> ApiError:
    """The HTTP form of an engine or service error; a 429 also gets `Retry-After`."""
    status = STATUS_OF_ERROR_TYPE[error.error_type]
    headers = {"Retry-After": str(retry_after_s)} if status == 429 else None
    param = error.field if isinstance(error, ValidationError) else None
    return ApiError(status, error.error_type, error.message, headers, param)


def error_body(error_type: str, message: str) -> dict[str, str]:
    return {"error": message, "error_type": error_type}


# OpenAI's error types by status; its client raises a typed exception per status.
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "invalid_request_error", 413: "invalid_request_error",
                 422: "invalid_request_error", 429: "rate_limit_error"}
# The OpenAI-compatible routes live under `PREFIX/v1`; their errors take OpenAI's shape.
_OPENAI_PATH = re.compile(r"^/[^/]+/deployments/v2/llms/[^/]+/v1(/|$)")


def openai_error_body(error: ApiError) -> dict[str, dict[str, str | None]]:
    """OpenAI's shape: `{"error": {message, type, param, code}}`; `code` is our `error_type`."""
    kind = _OPENAI_TYPES.get(error.status_code, "server_error")
    return {"error": {"message": error.message, "type": kind, "param": error.param,
                      "code": error.error_type}}


def is_openai_path(path: str) -> bool:
    return _OPENAI_PATH.match(path) is not None


def error_response(error: ApiError, path: str = "") -> JSONResponse:
    """The error in the shape of the route at `path`: OpenAI's under `/v1`, ours elsewhere."""
    if is_openai_path(path):
        # OpenAI answers a bad parameter with 400, never 422, and so do its peers; its client
        # raises BadRequestError for it.
        status = 400 if error.error_type == "validation" else error.status_code
        return JSONResponse(openai_error_body(error), status, error.headers)
    return JSONResponse(error_body(error.error_type, error.message), error.status_code, error.headers)


# Starlette raises these for routing failures (unknown path, wrong method); keep our error shape.
_STATUS_ERROR_TYPES = {400: "bad_request", 401: "authentication", 403: "forbidden", 404: "not_found",
                       405: "method_not_allowed", 413: "payload_too_large", 422: "validation"}


def install_error_handlers(app: FastAPI) -> None:
    """Replace FastAPI's default error bodies (detail lists) with the service's shape."""

    async def on_api_error(request: Request, error: ApiError) -> JSONResponse:
        return error_response(error, request.url.path)

    async def on_http_exception(request: Request, error: StarletteHTTPException) -> JSONResponse:
        error_type = _STATUS_ERROR_TYPES.get(error.status_code, "bad_request")
        api_error = ApiError(error.status_code, error_type, str(error.detail), dict(error.headers or {}))
        return error_response(api_error, request.url.path)

    async def on_request_validation(request: Request, error: RequestValidationError) -> JSONResponse:
        errors = error.errors()
        return error_response(validation(describe_validation_errors(errors), first_location(errors)),
                              request.url.path)

    async def on_engine_error(request: Request, error: EngineError | ServiceError) -> JSONResponse:
        # Registry and adapter failures raised by routes that are not the engine's own.
        api_error = from_engine_error(error, request.app.state.server.config.retry_after_s)
        return error_response(api_error, request.url.path)

    async def on_unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=error)
        return error_response(ApiError(500, "internal", "internal server error"), request.url.path)

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(RequestValidationError, on_request_validation)
    app.add_exception_handler(EngineError, on_engine_error)
    app.add_exception_handler(ServiceError, on_engine_error)
    app.add_exception_handler(Exception, on_unexpected)


def describe_validation_errors(errors: list[dict]) -> str:
    """One readable line per pydantic error, each naming the field by its dotted path."""
    parts = [f"{_location(item) or 'body'}: {item.get('msg', 'invalid value')}" for item in errors]
    return "; ".join(parts)


def first_location(errors: list[dict]) -> str | None:
    """The dotted path of the first field pydantic refused."""
    return _location(errors[0]) or None if errors else None


def _location(item: dict) -> str:
    return ".".join(str(part) for part in item.get("loc", ()) if part != "body")
