"""The registry on an S3 blob store (moto on loopback): real presigned URLs, PUT with no Authorization."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from lora_runtime.adapters.sources.download import AdapterStore
from lora_runtime.adapters.sources.s3 import S3Config
from server.registry.blobs import S3BlobStore
from server.registry.repos import SessionFactory
from server.registry.service import AdapterRegistry
from server.registry.signing import UrlSigner
from server.registry.source import PbaseResolver
from server.registry.uploads import UploadConfig, UploadService
from tests.fixtures.adapters import check_tiny_llama_adapter
from benchmarks.loopback_s3 import s3_server
from tests.registry.conftest import adapter_only, resolve_in


@pytest.fixture()
def s3_registry(
    sessions: SessionFactory, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> AdapterRegistry:
    server = s3_server()
    server.use_credentials(monkeypatch)
    bucket = f"registry-{request.node.callspec.id}"
    server.client().create_bucket(Bucket=bucket)
    blobs = S3BlobStore(S3Config(endpoint_url=server.endpoint_url, path_style=True), bucket=bucket)
    return AdapterRegistry(sessions, blobs, check_tiny_llama_adapter)


def test_upload_through_presigned_s3_urls(
    s3_registry: AdapterRegistry, tmp_path: Path, peft_files: dict[str, dict[str, bytes]]
) -> None:
    uploads = UploadService(s3_registry, UrlSigner(b"k" * 32), UploadConfig(public_base_url="http://unused"))
    start = uploads.start_upload("t1", "alice", "news")
    files = adapter_only(peft_files["a"])
    with s3_server().without_authentication():
        for name, data in files.items():
            url = start.presigned_urls[name]
            assert url.startswith(s3_server().endpoint_url) and "X-Amz-Signature=" in url
            response = httpx.put(url, content=data)  # no Authorization header: the URL carries the signature
            assert response.status_code == 200, response.text
    version = uploads.finish_upload("t1", start.upload_token)
    assert version.tag == 1
    assert s3_registry.blobs.list(f"uploads/{start.upload_token}") == {}
    resolver = PbaseResolver(s3_registry.sessions, s3_registry.blobs, AdapterStore(tmp_path / "store"))
    stored = resolve_in(resolver, "t1", "news/1")
    assert {p.name: p.read_bytes() for p in stored.iterdir()} == files
    s3_registry.delete_repo("t1", "news")
    assert s3_registry.blobs.list("adapters") == {}
