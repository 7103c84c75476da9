"""The adapter registry routes of docs/api.md section 1, shaped like the Predibase REST paths the
`predibase` SDK calls: repos, versions, and the three-step upload. A thin layer over
`server.registry`: each route authenticates the caller (its tenant scopes everything), reads its
body, and runs the service call in a worker thread (database and blob I/O block).

The signed upload route (`PUT /v2/adapters/upload/files/...`) takes no Authorization header: its
URL, signed and expiring, is the authorization. Its signature is checked before the body is read.
"""
from __future__ import annotations

import tempfile
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from server.auth import authenticate
from server.body import read_model
from server.errors import bad_request
from server.registry.errors import ByteBound
from server.registry.uploads import UPLOAD_ROUTE
from server.routes.openapi import error_responses
from server.state import ServerState, server_state

router = APIRouter(tags=["registry"])
_BODY_LIMIT_BYTES = 64 * 1024  # JSON bodies of these routes are a few fields
_SPOOL_BYTES = 8 << 20  # upload bodies past this go to a temporary file while they arrive
# A version number, bounded so it fits every database's INTEGER (past it: 422, not a driver error).
Tag = Annotated[int, Path(ge=1, le=2**31 - 1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class CreateRepo(_Body):
    name: str
    description: str | None = None
    exists_ok: bool | None = Field(default=None, alias="existsOk")


class StartUpload(_Body):
    repo: str
    region: str | None = None
    description: str | None = None
    files: list[str] | None = None  # names beyond the standard three (checkpoints, tokenizer files)


class FinishUpload(_Body):
    upload_token: str = Field(alias="uploadToken")


class SetArchived(_Body):
    archived: bool


def _doc(*statuses: int, body: type[_Body] | None = None) -> dict[str, Any]:
    """OpenAPI: the errors a route answers (every route reads its body by hand: 400 and 422 when
    it has one, 401 unless it is the signed route) and its request body's schema."""
    extra = {} if body is None else {"openapi_extra": {"requestBody": {"required": True, "content": {
        "application/json": {"schema": body.model_json_schema(by_alias=True)}}}}}
    return {"responses": error_responses(*sorted(set(statuses) | ({400, 413, 422} if body else set()))), **extra}


async def _caller(request: Request) -> tuple[ServerState, str]:
    state = server_state(request)
    return state, await run_in_threadpool(authenticate, request, state.database)


async def _body(request: Request, model: type[_Body]) -> Any:
    return await read_model(request, model, _BODY_LIMIT_BYTES)


@router.post("/v2/repos", **_doc(401, 409, body=CreateRepo))
async def create_repo(request: Request) -> JSONResponse:
    state, tenant = await _caller(request)
    body: CreateRepo = await _body(request, CreateRepo)
    repo = await run_in_threadpool(state.adapters.registry.create_repo, tenant, body.name, tenant,
                                   body.description or "", bool(body.exists_ok))
    return JSONResponse(repo.to_api())


@router.get("/v2/repos", **_doc(401, 422))
async def list_repos(request: Request, limit: int = 100) -> JSONResponse:
    state, tenant = await _caller(request)
    repos = await run_in_threadpool(state.adapters.registry.list_repos, tenant, limit)
    return JSONResponse({"data": {"repos": [repo.to_api() for repo in repos]}})


@router.get("/v2/repos/{name}", **_doc(401, 404, 422))
async def get_repo(request: Request, name: str) -> JSONResponse:
    state, tenant = await _caller(request)
    return JSONResponse((await run_in_threadpool(state.adapters.registry.get_repo, tenant, name)).to_api())


@router.delete("/v2/repos/{name}", **_doc(401, 404, 422))
async def delete_repo(request: Request, name: str) -> Response:
    state, tenant = await _caller(request)
    await run_in_threadpool(state.adapters.registry.delete_repo, tenant, name)
    return JSONResponse({})


@router.get("/v2/repos/{repo}/version/{tag}", **_doc(401, 404, 422))
async def get_version(request: Request, repo: str, tag: Tag) -> JSONResponse:
    state, tenant = await _caller(request)
    version = await run_in_threadpool(state.adapters.registry.get_version, tenant, repo, tag)
    return JSONResponse(version.to_api())


@router.put("/v2/repos/{repo}/version/{tag}", **_doc(401, 404, body=SetArchived))
async def set_archived(request: Request, repo: str, tag: Tag) -> JSONResponse:
    state, tenant = await _caller(request)
    body: SetArchived = await _body(request, SetArchived)
    version = await run_in_threadpool(state.adapters.registry.set_archived, tenant, repo, tag, body.archived)
    return JSONResponse(version.to_api())


@router.delete("/v2/repos/{repo}/version/{tag}", **_doc(401, 404, 422))
async def delete_version(request: Request, repo: str, tag: Tag) -> Response:
    state, tenant = await _caller(request)
    await run_in_threadpool(state.adapters.registry.delete_version, tenant, repo, tag)
    return JSONResponse({})


@router.post("/v2/adapters/upload", **_doc(401, 429, body=StartUpload))
async def start_upload(request: Request) -> JSONResponse:
    """Step 1: signed URLs for the files, and the token that finishes the upload."""
    state, tenant = await _caller(request)
    body: StartUpload = await _body(request, StartUpload)
    uploads = state.adapters.uploads(state.config, str(request.base_url))
    started = await run_in_threadpool(uploads.start_upload, tenant, tenant, body.repo,
                                      body.description or "", body.files or ())
    return JSONResponse(started.to_api())


@router.put(UPLOAD_ROUTE + "/{upload_id}/{name:path}", **_doc(403, 404, 413, 422))
async def receive_upload_file(request: Request, upload_id: str, name: str, expires: str = "",
                              signature: str = "") -> Response:
    """Step 2: the raw bytes of one file, to a signed URL (no Authorization header). Refused before
    the body is read (bad URL, finished or expired upload, a Content-Length past the file's bound),
    else as the body passes its bound."""
    state = server_state(request)
    uploads = state.adapters.uploads(state.config, str(request.base_url))
    declared = request.headers.get("content-length")
    declared_bytes = int(declared) if declared is not None and declared.isdigit() else None
    admission = await run_in_threadpool(uploads.admit_file, upload_id, name, expires, signature, declared_bytes)
    try:
        with await _spooled_body(request, admission.bound) as spool:
            await run_in_threadpool(uploads.store_file, admission, spool)
    finally:
        uploads.release(admission)
    return Response(status_code=200)


async def _spooled_body(request: Request, bound: ByteBound) -> tempfile.SpooledTemporaryFile:
    """The body, rewound, in memory or (past `_SPOOL_BYTES`) a temporary file; 413 naming the bound
    as soon as the body passes it. A client that leaves mid-body gets a 400 it will not read: a
    disconnect is the client's doing, not an error of the server's to log."""
    spool = tempfile.SpooledTemporaryFile(max_size=_SPOOL_BYTES)
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > bound.max_bytes:
                raise bound.error()
            spool.write(chunk)
    except BaseException as error:
        spool.close()
        if isinstance(error, ClientDisconnect):
            raise bad_request("the client disconnected before the end of the body") from None
        raise
    spool.seek(0)
    return spool


@router.put("/v2/adapters/upload/", **_doc(401, 404, body=FinishUpload))
async def finish_upload(request: Request) -> JSONResponse:
    """Step 3: validate the uploaded files and record them as the repo's next version."""
    state, tenant = await _caller(request)
    body: FinishUpload = await _body(request, FinishUpload)
    uploads = state.adapters.uploads(state.config, str(request.base_url))
    version = await run_in_threadpool(uploads.finish_upload, tenant, body.upload_token)
    return JSONResponse(version.to_api())
