"""Upload bounds over real HTTP (issue 41 item 2): a live server with small per-tenant bounds refuses
each bound with its status and a JSON error naming it (413 as the body streams in, before it ends),
and keeps serving; it sweeps an upload that expired before it started, and one that expires while
it runs."""

from __future__ import annotations

import datetime as dt
import http.client
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from sqlalchemy import create_engine, update
from sqlalchemy.orm import sessionmaker

from server.registry.blobs import LocalBlobStore
from server.registry.models import RegistryBase, UploadSession, utc_now
from server.registry.upload_bounds import CONFIG_MAX_BYTES, weights_max_bytes
from tests.server.live import LiveServer, start_live_server

pytestmark = pytest.mark.xdist_group("test_upload_bounds_http")
_STALE = "e" * 48  # an upload that expired before the server started
_MiB = 1024**2
_STAGED_LIMIT = 90 * _MiB  # per tenant; the embedded model's weights bound is ~76 MiB


def _stage_expired_upload(data_dir: Path) -> Path:
    database = create_engine(f"sqlite:///{data_dir / 'state.db'}")
    RegistryBase.metadata.create_all(database)
    with sessionmaker(database).begin() as session:
        session.add(UploadSession(id=_STALE, tenant_id="demo", repo_name="stale", created_by="demo",
                                  expires_at=utc_now() - dt.timedelta(days=1)))
    database.dispose()
    (data_dir / "config.json").write_bytes(b"{}")
    LocalBlobStore(data_dir / "blobs").put_file(f"uploads/{_STALE}/adapter_config.json", data_dir / "config.json")
    return data_dir / "blobs" / "uploads" / _STALE


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from lora_runtime import Engine, EngineConfig
    from lora_runtime.embedded import ensure_embedded_model

    data_dir = tmp_path_factory.mktemp("uploads")
    _stage_expired_upload(data_dir)
    server = start_live_server(Engine.from_config(EngineConfig(model=str(ensure_embedded_model()), dtype="float32")), data_dir, max_open_uploads=8,
                               max_staged_upload_bytes=_STAGED_LIMIT, max_upload_files=8,
                               upload_sweep_interval_s=0.5)
    yield server
    server.stop()


def _start(live: LiveServer, tenant: str = "demo", files: list[str] | None = None) -> httpx.Response:
    return httpx.post(f"{live.base_url}/v2/adapters/upload", json={"repo": "news", "files": files or []},
                      headers=live.headers(tenant))


def _put(url: str, declared_bytes: int | None, chunks: list[bytes] = ()) -> tuple[int, dict]:
    """A PUT that sends `chunks` and then waits for the answer, the body unfinished if the chunks
    fall short of it: with `declared_bytes` as Content-Length, else chunked."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    connection.putrequest("PUT", f"{parts.path}?{parts.query}")
    if declared_bytes is None:
        connection.putheader("Transfer-Encoding", "chunked")
    else:
        connection.putheader("Content-Length", str(declared_bytes))
    connection.endheaders()
    for chunk in chunks:
        connection.send(chunk if declared_bytes is not None else b"%x\r\n%s\r\n" % (len(chunk), chunk))
    response = connection.getresponse()
    answer = response.status, json.loads(response.read())
    connection.close()
    return answer


def _still_serving(live: LiveServer) -> None:
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}
    response = httpx.post(live.prefix() + "/generate", json=body, headers=live.headers(), timeout=120)
    assert response.status_code == 200, response.text


def _refusal(answer: tuple[int, dict], status: int, error_type: str, starts: str) -> None:
    assert answer[0] == status, answer
    assert answer[1]["error_type"] == error_type and answer[1]["error"].startswith(starts), answer


def test_a_config_past_its_bound_is_413_as_it_streams_in(live: LiveServer) -> None:
    url = _start(live).json()["presignedUrls"]["adapter_config.json"]
    refusal = "adapter_config.json: an adapter config holds at most"
    _refusal(_put(url, CONFIG_MAX_BYTES + 1), 413, "payload_too_large", refusal)  # refused on the header
    chunks = [b" " * 16384] * (CONFIG_MAX_BYTES // 16384) + [b" "]  # one byte past, and no end of body
    _refusal(_put(url, None, chunks), 413, "payload_too_large", refusal)
    _still_serving(live)


def test_weights_past_the_base_model_s_bound_are_413(live: LiveServer) -> None:
    info = live.state.async_engine.info
    bound = weights_max_bytes(info.adapter_shape, info.adapter_limits)
    assert 70 * _MiB < bound < 80 * _MiB  # SmolLM2-135M's 7 projections x 30 layers at rank 64, float32
    url = _start(live).json()["presignedUrls"]["adapter_model.safetensors"]
    _refusal(_put(url, bound + 1), 413, "payload_too_large",
             "adapter_model.safetensors: adapter weights of this server's base model")
    _still_serving(live)


def test_a_tenant_s_staged_bytes_are_bounded(live: LiveServer) -> None:
    first = _start(live, files=["tokenizer.json"]).json()["presignedUrls"]
    assert httpx.put(first["tokenizer.json"], content=b"x" * 20 * _MiB, timeout=60).status_code == 200
    weights_url = _start(live).json()["presignedUrls"]["adapter_model.safetensors"]
    _refusal(_put(weights_url, 75 * _MiB), 413, "payload_too_large",
             f"adapter_model.safetensors: the staged files of tenant 'demo''s unfinished uploads hold at most "
             f"{_STAGED_LIMIT} bytes, {20 * _MiB} of them taken")
    _still_serving(live)


def test_open_uploads_and_files_per_upload_are_bounded(live: LiveServer) -> None:
    for _ in range(8):
        assert _start(live, "other").status_code == 200
    refused = _start(live, "other")
    assert (refused.status_code, refused.json()["error_type"]) == (429, "too_many_uploads"), refused.text
    assert refused.json()["error"].startswith("tenant 'other' has 8 uploads open")
    assert "Retry-After" in refused.headers
    files = [f"checkpoint-{n}/adapter_config.json" for n in range(6)]
    too_many = _start(live, files=files)
    assert (too_many.status_code, too_many.json()["error"]) == (422, "files: an upload names at most 8 files, got 9")
    _still_serving(live)


def _wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _wait_until_gone(path: Path) -> None:
    _wait_until(lambda: not path.exists(), f"{path} was not swept")


def test_a_put_cut_short_stages_nothing_and_holds_nothing(live: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    start = _start(live, files=["tokenizer.json"]).json()
    parts = urlsplit(start["presignedUrls"]["tokenizer.json"])
    staging = live.state.adapters.staging
    with socket.create_connection((parts.hostname, parts.port)) as connection:
        connection.sendall(f"PUT {parts.path}?{parts.query} HTTP/1.1\r\nHost: test\r\n"
                           "Transfer-Encoding: chunked\r\n\r\n4\r\n{}{}\r\n".encode())
        _wait_until(lambda: staging.reserved("demo", start["uploadToken"]) > 0, "the PUT was not admitted")
    _wait_until(lambda: staging.reserved("demo") == 0, "the PUT's reservation was not released")
    assert live.state.adapters.registry.blobs.list(f"uploads/{start['uploadToken']}") == {}
    assert "unhandled error" not in caplog.text
    _still_serving(live)


def test_uploads_expired_before_the_start_and_while_serving_are_swept(live: LiveServer) -> None:
    _wait_until_gone(live.state.config.data_dir / "blobs" / "uploads" / _STALE)
    start = _start(live, files=["vocab.json"]).json()
    assert httpx.put(start["presignedUrls"]["vocab.json"], content=b"{}").status_code == 200
    staged = live.state.config.data_dir / "blobs" / "uploads" / start["uploadToken"]
    assert staged.is_dir()
    with live.database.sessions() as session, session.begin():
        session.execute(update(UploadSession).where(UploadSession.id == start["uploadToken"])
                        .values(expires_at=utc_now() - dt.timedelta(seconds=1)))
    _wait_until_gone(staged)
    finish = httpx.put(f"{live.base_url}/v2/adapters/upload/", json={"uploadToken": start["uploadToken"]},
                       headers=live.headers())
    assert finish.status_code == 404
