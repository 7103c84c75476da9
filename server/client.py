"""The project's client library for the inference routes, sync (`Client`) and async
(`AsyncClient`), speaking the same wire format as the official clients.

    client = Client("http://127.0.0.1:8080", token, tenant="demo", deployment="smollm2-135m-instruct")
    client.generate("Hello", max_new_tokens=8).generated_text
    for chunk in client.generate_stream("Hello"): ...
    version = client.upload("./my-adapter", "my-repo")  # then adapter_id=version.adapter_id

Failures raise `ApiError` subclasses carrying `status` and `error_type`.
"""
from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from lora_runtime.adapter_files import ADAPTER_FILES
from server.protocol import GenerateResponse, StreamResponse

_CHECKPOINT_DIR = re.compile(r"checkpoint-[0-9]{1,9}")


class ApiError(Exception):
    def __init__(self, status: int, error_type: str, message: str) -> None:
        super().__init__(f"{status} {error_type}: {message}")
        self.status = status
        self.error_type = error_type
        self.message = message


class BadRequestError(ApiError): ...
class AuthenticationError(ApiError): ...
class ForbiddenError(ApiError): ...
class NotFoundError(ApiError): ...
class PayloadTooLargeError(ApiError): ...
class ValidationError(ApiError): ...
class GenerationError(ApiError): ...
class OverloadedError(ApiError): ...
class ServiceUnavailableError(ApiError): ...


_BY_STATUS: dict[int, type[ApiError]] = {
    400: BadRequestError, 401: AuthenticationError, 403: ForbiddenError, 404: NotFoundError,
    413: PayloadTooLargeError, 422: ValidationError, 424: GenerationError, 429: OverloadedError,
    500: GenerationError, 503: ServiceUnavailableError,
}


def error_from(status: int, payload: Any) -> ApiError:
    """The typed exception for an error body (`{error, error_type}`) with its HTTP status."""
    if not isinstance(payload, dict):
        payload = {"error": str(payload)}
    error_class = _BY_STATUS.get(status, ApiError)
    return error_class(status, str(payload.get("error_type", "unknown")), str(payload.get("error", "")))


def _raise_for(response: httpx.Response, body: bytes) -> None:
    if response.status_code == 200:
        return
    try:
        payload = json.loads(body)
    except ValueError:
        payload = body.decode(errors="replace")
    raise error_from(response.status_code, payload)


def _chunk_of(line: str) -> StreamResponse | None:
    """The chunk of one SSE line; None for blank lines and keep-alive comments."""
    if not line.startswith("data:"):
        return None
    payload = json.loads(line[len("data:"):])
    if "error" in payload:
        # An error after the first byte: the stream's status was already 200.
        raise error_from(424 if payload.get("error_type") == "generation" else 500, payload)
    return StreamResponse.model_validate(payload)


@dataclass(frozen=True, slots=True)
class AdapterVersion:
    """A version created by `upload`: generate with `adapter_id` (`repo/tag`), or `repo/tag@N`
    for one of its `checkpoints`."""

    repo: str
    tag: int
    base_model: str
    checkpoints: tuple[int, ...]

    @property
    def adapter_id(self) -> str:
        return f"{self.repo}/{self.tag}"

    @classmethod
    def from_api(cls, payload: dict[str, Any]) -> AdapterVersion:
        return cls(payload["repo"], int(payload["tag"]), payload.get("baseModel", ""),
                   tuple(payload.get("checkpoints", ())))


def upload_files(local_dir: str | Path) -> dict[str, Path]:
    """What `upload` sends: the adapter files of `local_dir` and of its `checkpoint-<N>/`
    subfolders (as `checkpoint-<N>/<file>`), nothing else (no optimizer states, no logs)."""
    root = Path(local_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    files = {p.name: p for p in sorted(root.iterdir()) if p.name in ADAPTER_FILES and p.is_file()}
    for checkpoint in sorted(p for p in root.iterdir() if p.is_dir() and _CHECKPOINT_DIR.fullmatch(p.name)):
        files.update({f"{checkpoint.name}/{p.name}": p for p in sorted(checkpoint.iterdir())
                      if p.name in ADAPTER_FILES and p.is_file()})
    return files


class _Base:
    def __init__(self, base_url: str, token: str, tenant: str, deployment: str,
                 timeout_s: float = 120.0) -> None:
        self.base_url = base_url.rstrip("/")
        prefix = f"{base_url.rstrip('/')}/{tenant}/deployments/v2/llms/{deployment}"
        self.generate_url = prefix + "/generate"
        self.stream_url = prefix + "/generate_stream"
        self.headers = {"Authorization": f"Bearer {token}"}
        self.timeout_s = timeout_s

    @staticmethod
    def body(inputs: str, parameters: dict[str, Any]) -> dict[str, Any]:
        return {"inputs": inputs, "parameters": parameters}

    @staticmethod
    def upload_request(repo: str, description: str, files: dict[str, Path]) -> dict[str, Any]:
        return {"repo": repo, "description": description, "files": sorted(files)}


class Client(_Base):
    """Blocking client; `parameters` are the wire names of docs/api.md section 2 (`max_new_tokens=...`)."""

    def generate(self, inputs: str, **parameters: Any) -> GenerateResponse:
        with httpx.Client(timeout=self.timeout_s) as http:
            response = http.post(self.generate_url, json=self.body(inputs, parameters),
                                 headers=self.headers)
        _raise_for(response, response.content)
        return GenerateResponse.model_validate_json(response.content)

    def generate_stream(self, inputs: str, **parameters: Any) -> Iterator[StreamResponse]:
        with httpx.Client(timeout=self.timeout_s) as http:
            with http.stream("POST", self.stream_url, json=self.body(inputs, parameters),
                             headers=self.headers) as response:
                _raise_for(response, response.read() if response.status_code != 200 else b"")
                for line in response.iter_lines():
                    chunk = _chunk_of(line)
                    if chunk is not None:
                        yield chunk


    def upload(self, local_dir: str | Path, repo: str, description: str = "") -> AdapterVersion:
        """Uploads an adapter directory as `repo`'s next version (the repo is created if missing)."""
        files = upload_files(local_dir)
        with httpx.Client(timeout=self.timeout_s) as http:
            response = http.post(f"{self.base_url}/v2/adapters/upload", headers=self.headers,
                                 json=self.upload_request(repo, description, files))
            _raise_for(response, response.content)
            started = response.json()
            for name, path in files.items():
                put = http.put(started["presignedUrls"][name], content=path.read_bytes(),
                               headers=started.get("requiredHeaders") or {})
                _raise_for(put, put.content)
            response = http.put(f"{self.base_url}/v2/adapters/upload/", headers=self.headers,
                                json={"uploadToken": started["uploadToken"]})
        _raise_for(response, response.content)
        return AdapterVersion.from_api(response.json())


class AsyncClient(_Base):
    """The same calls for asyncio."""

    async def generate(self, inputs: str, **parameters: Any) -> GenerateResponse:
        async with httpx.AsyncClient(timeout=self.timeout_s) as http:
            response = await http.post(self.generate_url, json=self.body(inputs, parameters),
                                       headers=self.headers)
        _raise_for(response, response.content)
        return GenerateResponse.model_validate_json(response.content)

    async def generate_stream(self, inputs: str, **parameters: Any) -> AsyncIterator[StreamResponse]:
        async with httpx.AsyncClient(timeout=self.timeout_s) as http:
            async with http.stream("POST", self.stream_url, json=self.body(inputs, parameters),
                                   headers=self.headers) as response:
                _raise_for(response, await response.aread() if response.status_code != 200 else b"")
                async for line in response.aiter_lines():
                    chunk = _chunk_of(line)
                    if chunk is not None:
                        yield chunk

    async def upload(self, local_dir: str | Path, repo: str, description: str = "") -> AdapterVersion:
        """Uploads an adapter directory as `repo`'s next version (the repo is created if missing)."""
        files = upload_files(local_dir)
        async with httpx.AsyncClient(timeout=self.timeout_s) as http:
            response = await http.post(f"{self.base_url}/v2/adapters/upload", headers=self.headers,
                                       json=self.upload_request(repo, description, files))
            _raise_for(response, response.content)
            started = response.json()
            for name, path in files.items():
                put = await http.put(started["presignedUrls"][name], content=path.read_bytes(),
                                     headers=started.get("requiredHeaders") or {})
                _raise_for(put, put.content)
            response = await http.put(f"{self.base_url}/v2/adapters/upload/", headers=self.headers,
                                      json={"uploadToken": started["uploadToken"]})
        _raise_for(response, response.content)
        return AdapterVersion.from_api(response.json())
