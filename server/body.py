"""Reading a request body: bounded in size (413 before it is read whole) and parsed to a JSON
object (400 otherwise), then validated into a protocol model (422 naming the field)."""
from __future__ import annotations

import json
from typing import TypeVar

import pydantic
from starlette.requests import Request

from server.errors import (bad_request, describe_validation_errors, first_location, payload_too_large,
                           validation)

Model = TypeVar("Model", bound=pydantic.BaseModel)


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """The raw body; refuses at once on a larger Content-Length, else as soon as the limit is passed."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise payload_too_large(limit_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise payload_too_large(limit_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_model(request: Request, model: type[Model], limit_bytes: int) -> Model:
    body = await read_body(request, limit_bytes)
    try:
        document = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise bad_request(f"body is not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise bad_request("body must be a JSON object")
    try:
        return model.model_validate(document)
    except pydantic.ValidationError as error:
        errors = error.errors()
        raise validation(describe_validation_errors(errors), first_location(errors)) from None
