"""The upload sweeper (issue 41 item 2) on the local blob store and on S3 (moto on loopback): the
staged files and records of expired uploads (abandoned, failed, finished) and staged files no upload
owns are deleted; open uploads and a finish still within its grace keep theirs."""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path

import httpx
import pytest
from sqlalchemy import update

from lora_runtime.adapters.sources.s3 import S3Config
from lora_runtime.errors import AdapterInvalidError
from server.registry.blobs import S3BlobStore
from server.registry.models import UploadSession, utc_now
from server.registry.repos import SessionFactory
from server.registry.service import AdapterRegistry
from server.registry.signing import UrlSigner
from server.registry.sweeper import FINISHING_GRACE, sweep_uploads
from server.registry.uploads import UploadConfig, UploadService, UploadStart
from tests.fixtures.adapters import check_tiny_llama_adapter
from benchmarks.loopback_s3 import s3_server
from tests.registry.conftest import put_via_url

_ORPHAN = "f" * 48  # an upload id with staged files and no record


@pytest.fixture(params=["local", "s3"])
def swept_registry(
    request: pytest.FixtureRequest, registry: AdapterRegistry, sessions: SessionFactory, monkeypatch: pytest.MonkeyPatch
) -> AdapterRegistry:
    if request.param == "local":
        return registry
    server = s3_server()
    server.use_credentials(monkeypatch)
    bucket = f"sweep-{uuid.uuid4().hex}"  # the S3 server is shared: a bucket of this test's own
    server.client().create_bucket(Bucket=bucket)
    blobs = S3BlobStore(S3Config(endpoint_url=server.endpoint_url, path_style=True), bucket=bucket)
    return AdapterRegistry(sessions, blobs, check_tiny_llama_adapter)


def _stage(uploads: UploadService, start: UploadStart, name: str, data: bytes) -> None:
    """A PUT to the URL the upload handed out: to S3 itself, or to this server's route."""
    url = start.presigned_urls[name]
    if "X-Amz-Signature=" in url:
        with s3_server().without_authentication():
            assert httpx.put(url, content=data).status_code == 200
    else:
        put_via_url(uploads, url, data)


def _expire(registry: AdapterRegistry, upload_id: str, ago: dt.timedelta, state: str | None = None) -> None:
    values = {"expires_at": utc_now() - ago, **({"state": state} if state else {})}
    with registry.sessions() as session, session.begin():
        session.execute(update(UploadSession).where(UploadSession.id == upload_id).values(**values))


def _staged_ids(registry: AdapterRegistry) -> set[str]:
    return registry.blobs.child_names("uploads")


def test_expired_and_orphaned_uploads_are_swept(swept_registry: AdapterRegistry, tmp_path: Path) -> None:
    uploads = UploadService(swept_registry, UrlSigner(b"w" * 32), UploadConfig(public_base_url="http://127.0.0.1"))
    starts = {kind: uploads.start_upload("t1", "alice", kind) for kind in
              ("abandoned", "failed", "open", "finishing", "crashed")}
    for start in starts.values():
        _stage(uploads, start, "adapter_config.json", b"{}")
    with pytest.raises(AdapterInvalidError):
        uploads.finish_upload("t1", starts["failed"].upload_token)  # no weights: stays open, files kept
    (tmp_path / "orphan.json").write_bytes(b"{}")
    swept_registry.blobs.put_file(f"uploads/{_ORPHAN}/adapter_config.json", tmp_path / "orphan.json")
    second = dt.timedelta(seconds=1)
    _expire(swept_registry, starts["abandoned"].upload_token, second)
    _expire(swept_registry, starts["failed"].upload_token, second)
    _expire(swept_registry, starts["finishing"].upload_token, second, state="finishing")
    _expire(swept_registry, starts["crashed"].upload_token, FINISHING_GRACE + second, state="finishing")
    token = {kind: start.upload_token for kind, start in starts.items()}
    assert _staged_ids(swept_registry) == {*token.values(), _ORPHAN}

    swept = sweep_uploads(swept_registry)

    assert sorted(swept) == sorted([token["abandoned"], token["failed"], token["crashed"], _ORPHAN])
    assert _staged_ids(swept_registry) == {token["open"], token["finishing"]}
    with swept_registry.sessions() as session:
        assert {u.id for u in session.query(UploadSession)} == {token["open"], token["finishing"]}
    assert sweep_uploads(swept_registry) == []


def test_a_finished_upload_s_record_is_swept_once_expired(
    swept_registry: AdapterRegistry, peft_files: dict[str, dict[str, bytes]]
) -> None:
    uploads = UploadService(swept_registry, UrlSigner(b"w" * 32), UploadConfig(public_base_url="http://127.0.0.1"))
    start = uploads.start_upload("t1", "alice", "news")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        _stage(uploads, start, name, peft_files["a"][name])
    uploads.finish_upload("t1", start.upload_token)
    assert sweep_uploads(swept_registry) == []
    _expire(swept_registry, start.upload_token, dt.timedelta(seconds=1))
    assert sweep_uploads(swept_registry) == [start.upload_token]  # its files went at the finish
    with swept_registry.sessions() as session:
        assert session.query(UploadSession).count() == 0
    assert swept_registry.blobs.list("adapters") != {}  # the version's files are not the sweeper's
