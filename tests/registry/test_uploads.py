"""The three-step upload with a local blob store, then resolving the result as a `pbase` adapter."""

from __future__ import annotations

import io
import os
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import torch
from safetensors.torch import load_file

from lora_runtime.errors import AdapterIncompatibleError, AdapterInvalidError, AdapterNotFoundError, ValidationError
from server.registry import repos
from server.registry.errors import UploadNotFoundError, UploadSignatureError
from server.registry.service import AdapterRegistry
from server.registry.source import PbaseResolver
from server.registry.uploads import STANDARD_UPLOAD_FILES, UploadService, UploadStart
from tests.registry.conftest import adapter_only, put_via_url, resolve_in


def _start(uploads: UploadService, tenant: str, repo: str, files: dict[str, bytes]) -> UploadStart:
    start = uploads.start_upload(tenant, "alice", repo, files=[n for n in files if n not in STANDARD_UPLOAD_FILES])
    for name, data in files.items():
        assert put_via_url(uploads, start.presigned_urls[name], data) == len(data)
    return start


def _upload(uploads: UploadService, tenant: str, repo: str, files: dict[str, bytes]) -> str:
    return _start(uploads, tenant, repo, files).upload_token


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def test_upload_creates_consecutive_versions_that_resolve_in_the_tenant_only(
    uploads: UploadService, resolver: PbaseResolver, peft_files: dict[str, dict[str, bytes]]
) -> None:
    start = uploads.start_upload("t1", "alice", "news")
    assert set(start.to_api()["presignedUrls"]) == set(STANDARD_UPLOAD_FILES)
    for name, data in adapter_only(peft_files["a"]).items():
        put_via_url(uploads, start.presigned_urls[name], data)
    first = uploads.finish_upload("t1", start.upload_token)
    second = uploads.finish_upload("t1", _upload(uploads, "t1", "news", adapter_only(peft_files["b"])))
    assert (first.to_api()["adapterPath"], second.tag, first.base_model) == ("news/1", 2, "tests/tiny-llama")
    assert _files(resolve_in(resolver, "t1", "news/1")) == adapter_only(peft_files["a"])
    assert _files(resolve_in(resolver, "t1", "news/2")) == adapter_only(peft_files["b"])
    for tenant, adapter_id in (("t2", "news/1"), ("t1", "news/3"), ("t1", "news/1@1")):
        with pytest.raises(AdapterNotFoundError):
            resolve_in(resolver, tenant, adapter_id)


def test_a_token_finishes_once_and_only_for_its_tenant(
    uploads: UploadService, peft_files: dict[str, dict[str, bytes]]
) -> None:
    token = _upload(uploads, "t1", "news", adapter_only(peft_files["a"]))
    with pytest.raises(UploadNotFoundError):
        uploads.finish_upload("t2", token)
    uploads.finish_upload("t1", token)
    for tenant, bad_token in (("t1", token), ("t1", "0" * 48)):
        with pytest.raises(UploadNotFoundError):
            uploads.finish_upload(tenant, bad_token)


def test_signed_urls_refuse_tampering_and_expiry(uploads: UploadService) -> None:
    url = uploads.start_upload("t1", "alice", "news").presigned_urls["adapter_config.json"]
    upload_id = urlsplit(url).path.split("/")[-2]
    query = parse_qs(urlsplit(url).query)
    expires, signature = query["expires"][0], query["signature"][0]
    attempts = [
        (upload_id, "adapter_model.bin", expires, signature),  # another file
        ("f" * 48, "adapter_config.json", expires, signature),  # another upload
        (upload_id, "adapter_config.json", str(int(expires) + 60), signature),  # a later expiry
        (
            upload_id,
            "adapter_config.json",
            "1",
            uploads.signer.signature(f"/v2/adapters/upload/files/{upload_id}/adapter_config.json", 1),
        ),
    ]
    for args in attempts:
        with pytest.raises(UploadSignatureError):
            uploads.admit_file(*args)


def test_bin_weights_are_converted_to_safetensors(
    uploads: UploadService, resolver: PbaseResolver, peft_dirs: dict[str, Path], peft_files: dict[str, dict[str, bytes]]
) -> None:
    version = uploads.finish_upload("t1", _upload(uploads, "t1", "bin", adapter_only(peft_files["bin"])))
    stored = resolve_in(resolver, "t1", f"bin/{version.tag}")
    assert sorted(p.name for p in stored.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    expected = torch.load(peft_dirs["bin"] / "adapter_model.bin", weights_only=True)
    converted = load_file(stored / "adapter_model.safetensors")
    assert converted.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(converted[name], tensor, rtol=0, atol=0)


class _RunsCode:
    """A pickle that would create a file when unpickled without `weights_only`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, ...]]:
        return (os.system, (f"touch {self.marker}",))


def test_a_bad_upload_creates_nothing_and_can_be_fixed(
    uploads: UploadService, registry: AdapterRegistry, tmp_path: Path, peft_files: dict[str, dict[str, bytes]]
) -> None:
    marker = tmp_path / "pwned"
    buffer = io.BytesIO()
    torch.save({"weight": _RunsCode(marker)}, buffer)
    config = peft_files["bin"]["adapter_config.json"]
    start = _start(uploads, "t1", "news", {"adapter_config.json": config, "adapter_model.bin": buffer.getvalue()})
    with pytest.raises(AdapterInvalidError, match="plain tensor"):
        uploads.finish_upload("t1", start.upload_token)
    assert not marker.exists()
    assert repos.list_repos(registry.sessions, "t1") == []
    assert registry.blobs.list("adapters") == {}
    # The session stays open: replacing the weights and finishing again gives version 1.
    put_via_url(uploads, start.presigned_urls["adapter_model.bin"], peft_files["bin"]["adapter_model.bin"])
    assert uploads.finish_upload("t1", start.upload_token).tag == 1


def test_an_incompatible_adapter_is_refused_by_the_validator(
    uploads: UploadService, registry: AdapterRegistry, peft_files: dict[str, dict[str, bytes]]
) -> None:
    files = adapter_only(peft_files["a"])
    files["adapter_config.json"] = files["adapter_config.json"].replace(b"tests/tiny-llama", b"other/model")
    with pytest.raises(AdapterIncompatibleError):
        uploads.finish_upload("t1", _upload(uploads, "t1", "news", files))
    assert repos.list_repos(registry.sessions, "t1") == []


def test_checkpoint_folders_become_addressable_checkpoints(
    uploads: UploadService, resolver: PbaseResolver, peft_files: dict[str, dict[str, bytes]]
) -> None:
    files = {
        f"checkpoint-{n}/{name}": data
        for n, key in ((10, "a"), (20, "b"))
        for name, data in adapter_only(peft_files[key]).items()
    }
    version = uploads.finish_upload("t1", _upload(uploads, "t1", "trained", files))
    assert version.checkpoints == (10, 20)
    assert _files(resolve_in(resolver, "t1", "trained/1@10")) == adapter_only(peft_files["a"])
    assert _files(resolve_in(resolver, "t1", "trained/1@20")) == adapter_only(peft_files["b"])
    assert _files(resolve_in(resolver, "t1", "trained/1")) == adapter_only(peft_files["b"])  # the last checkpoint
    with pytest.raises(AdapterNotFoundError):
        resolve_in(resolver, "t1", "trained/1@30")


@pytest.mark.parametrize(
    "name", ["../adapter_config.json", "README.md", "checkpoint-x/adapter_config.json", "a/b/adapter_config.json"]
)
def test_only_adapter_file_names_get_upload_urls(uploads: UploadService, name: str) -> None:
    with pytest.raises(ValidationError):
        uploads.start_upload("t1", "alice", "news", files=[name])


def test_deleted_versions_are_not_served(
    uploads: UploadService, registry: AdapterRegistry, resolver: PbaseResolver, peft_files: dict[str, dict[str, bytes]]
) -> None:
    uploads.finish_upload("t1", _upload(uploads, "t1", "news", adapter_only(peft_files["a"])))
    resolve_in(resolver, "t1", "news/1")  # now in the local store too
    registry.delete_version("t1", "news", 1)
    with pytest.raises(AdapterNotFoundError):
        resolve_in(resolver, "t1", "news/1")
    assert registry.blobs.list("adapters") == {}
