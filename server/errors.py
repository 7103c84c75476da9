"""The service's HTTP errors and their one JSON shape, `{"error": ..., "error_type": ...}`
(docs/api.md section 6). Engine errors already carry `error_type` and `status_code`; the errors
here are the ones only the HTTP layer can raise (auth, routing, body, admission)."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lora_runtime.errors import EngineError

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """A refusal with a status, an error type and a message, plus optional response headers."""

    def __init__(
        self, status_code: int, error_type: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.error_type = error_type
        self.message = message
        self.headers = headers or {}


def bad_request(message: str) -> ApiError:
    return ApiError(400, "bad_request", message)


def unauthenticated(message: str) -> ApiError:
    return ApiError(401, "authentication", message, {"WWW-Authenticate": "Bearer"})


def forbidden(message: str) -> ApiError:
    return ApiError(403, "forbidden", message)


def not_found(message: str) -> ApiError:
    return ApiError(404, "not_found", message)


def validation(message: str) -> ApiError:
    return ApiError(422, "validation", message)


def overloaded(retry_after_s: int) -> ApiError:
    return ApiError(429, "overloaded", "too many requests in flight; retry later",
                    {"Retry-After": str(retry_after_s)})


def shutting_down(retry_after_s: int) -> ApiError:
    return ApiError(503, "shutting_down", "the server is shutting down", {"Retry-After": str(retry_after_s)})


def payload_too_large(limit_bytes: int) -> ApiError:
    return ApiError(413, "payload_too_large", f"request body is larger than {limit_bytes} bytes")


def from_engine_error(error: EngineError, retry_after_s: int) -> ApiError:
    """The HTTP form of an engine error; 429 from the engine also gets `Retry-After`."""
    headers = {"Retry-After": str(retry_after_s)} if error.status_code == 429 else None
    return ApiError(error.status_code, error.error_type, error.message, headers)


def error_body(error_type: str, message: str) -> dict[str, str]:
    return {"error": message, "error_type": error_type}


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error_body(error.error_type, error.message), error.status_code, error.headers)


# Starlette raises these for routing failures (unknown path, wrong method); keep our error shape.
_STATUS_ERROR_TYPES = {400: "bad_request", 401: "authentication", 403: "forbidden", 404: "not_found",
                       405: "method_not_allowed", 413: "payload_too_large", 422: "validation"}


def install_error_handlers(app: FastAPI) -> None:
    """Replace FastAPI's default error bodies (detail lists) with the service's shape."""

    async def on_api_error(_: Request, error: ApiError) -> JSONResponse:
        return error_response(error)

    async def on_http_exception(_: Request, error: StarletteHTTPException) -> JSONResponse:
        error_type = _STATUS_ERROR_TYPES.get(error.status_code, "bad_request")
        return JSONResponse(error_body(error_type, str(error.detail)), error.status_code, error.headers)

    async def on_request_validation(_: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(validation(describe_validation_errors(error.errors())))

    async def on_engine_error(request: Request, error: EngineError) -> JSONResponse:
        # Registry and adapter failures raised by routes that are not the engine's own.
        return error_response(from_engine_error(error, request.app.state.server.config.retry_after_s))

    async def on_unexpected(_: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=error)
        return JSONResponse(error_body("internal", "internal server error"), 500)

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(RequestValidationError, on_request_validation)
    app.add_exception_handler(EngineError, on_engine_error)
    app.add_exception_handler(Exception, on_unexpected)


def describe_validation_errors(errors: list[dict]) -> str:
    """One readable line per pydantic error, each naming the field by its dotted path."""
    parts = []
    for item in errors:
        location = ".".join(str(part) for part in item.get("loc", ()) if part != "body")
        parts.append(f"{location or 'body'}: {item.get('msg', 'invalid value')}")
    return "; ".join(parts)
