"""The hub source against a hub-protocol server on loopback, driven by the real `huggingface_hub`."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lora_runtime.adapters.refs import Caller, parse_adapter_ref
from lora_runtime.adapter_files import ADAPTER_FILES
from lora_runtime.adapters.sources.download import AdapterStore, DownloadLimits
from lora_runtime.adapters.sources.hub import HubConfig, HubSource
from lora_runtime.errors import (
    AdapterAccessError,
    AdapterInvalidError,
    AdapterNotFoundError,
    AdapterUnavailableError,
    ValidationError,
)
from benchmarks.loopback_hub import HubServer
from tests.sources.conftest import HUB_READER_TOKEN


def _source(hub: HubServer, root: Path, limits: DownloadLimits = DownloadLimits()) -> HubSource:
    return HubSource(HubConfig(endpoint=hub.endpoint, timeout_s=5.0), AdapterStore(root, limits))


def _resolve(source: HubSource, adapter_id: str, api_token: str | None) -> Path:
    """What the engine asks of the source for a request naming `adapter_id` with `api_token`."""
    return source.resolve(parse_adapter_ref(adapter_id, "hub"), Caller(api_token=api_token))


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def _adapter_only(files: dict[str, bytes]) -> dict[str, bytes]:
    return {name: data for name, data in files.items() if name in ADAPTER_FILES}


def test_public_adapter_fetches_only_adapter_files_anonymously(
    hub: HubServer, adapter_files: list[dict[str, bytes]], store_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_the_services_own_token")  # must never be sent on the caller's behalf
    start = len(hub.requests)
    path = _resolve(_source(hub, store_root), "org/public", None)
    assert _files(path) == _adapter_only(adapter_files[1])
    assert set(_files(path)) == {"adapter_config.json", "adapter_model.safetensors"}
    requests = hub.requests[start:]
    assert all(auth is None for _, _, auth in requests)
    assert not any("README" in p or "pytorch_model" in p or "gitattributes" in p for _, p, _ in requests)
    assert path.resolve().is_relative_to(store_root.resolve())


def test_revision_pinning_by_tag_and_commit(
    hub: HubServer, adapter_files: list[dict[str, bytes]], store_root: Path
) -> None:
    source = _source(hub, store_root)
    first_sha = hub.repos["org/public"].refs["v1"]
    assert _files(_resolve(source, "org/public@v1", None)) == _adapter_only(adapter_files[0])
    assert _files(_resolve(source, f"org/public@{first_sha}", None)) == _adapter_only(adapter_files[0])
    assert _files(_resolve(source, "org/public@main", None)) == _adapter_only(adapter_files[1])


def test_private_adapter_needs_the_callers_token_even_when_cached(
    hub: HubServer, adapter_files: list[dict[str, bytes]], store_root: Path
) -> None:
    source = _source(hub, store_root)
    path = _resolve(source, "org/private", HUB_READER_TOKEN)
    assert _files(path) == _adapter_only(adapter_files[0])
    for token in (None, "hf_someone_else"):
        with pytest.raises(AdapterAccessError) as caught:
            _resolve(source, "org/private", token)
        assert hub.endpoint not in caught.value.message and str(store_root) not in caught.value.message
    assert ("GET", "/api/models/org/private", f"Bearer {HUB_READER_TOKEN}") in hub.requests


def test_gated_adapter(hub: HubServer, adapter_files: list[dict[str, bytes]], store_root: Path) -> None:
    source = _source(hub, store_root)
    for token in (None, "hf_not_accepted"):
        with pytest.raises(AdapterAccessError, match="gated"):
            _resolve(source, "org/gated", token)
    assert _files(_resolve(source, "org/gated", HUB_READER_TOKEN)) == _adapter_only(adapter_files[0])


@pytest.mark.parametrize("adapter_id", ["org/missing", "org/public@no-such-branch"])
def test_not_found(hub: HubServer, store_root: Path, adapter_id: str) -> None:
    with pytest.raises(AdapterNotFoundError):
        _resolve(_source(hub, store_root), adapter_id, None)


def test_repo_without_adapter_files_is_invalid(hub: HubServer, store_root: Path) -> None:
    with pytest.raises(AdapterInvalidError, match="adapter_config.json"):
        _resolve(_source(hub, store_root), "org/readme-only", None)


def test_size_limit_is_checked_before_downloading(hub: HubServer, store_root: Path) -> None:
    start = len(hub.requests)
    with pytest.raises(AdapterInvalidError, match="larger than"):
        _resolve(_source(hub, store_root, DownloadLimits(max_total_bytes=100)), "org/public", None)
    assert not any("/resolve/" in p for _, p, _ in hub.requests[start:])
    assert not (store_root / "hub").exists()


def test_unreachable_hub(store_root: Path) -> None:
    with socket.socket() as sock:  # a loopback port with nothing listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    source = HubSource(HubConfig(endpoint=f"http://127.0.0.1:{port}", timeout_s=2.0), AdapterStore(store_root))
    with pytest.raises(AdapterUnavailableError) as caught:
        _resolve(source, "org/public", "hf_secret_token")
    assert str(port) not in caught.value.message and "hf_secret_token" not in caught.value.message


@pytest.mark.parametrize(
    "adapter_id", ["../etc", "org/..", "org/a/b", "/abs/path", "org\\name", "org/" + "n" * 300, ""]
)
def test_malformed_ids_are_refused_before_any_source(adapter_id: str) -> None:
    # A source takes only a parsed `AdapterRef`, so a malformed id never reaches the hub.
    with pytest.raises(ValidationError) as refused:
        parse_adapter_ref(adapter_id, "hub")
    assert refused.value.field == "adapter_id"


def test_concurrent_requests_download_once(
    hub: HubServer, adapter_files: list[dict[str, bytes]], store_root: Path
) -> None:
    source = _source(hub, store_root)
    start = len(hub.requests)
    with ThreadPoolExecutor(max_workers=4) as pool:
        paths = list(pool.map(lambda _: _resolve(source, "org/public@v1", None), range(4)))
    assert len(set(paths)) == 1
    assert _files(paths[0]) == _adapter_only(adapter_files[0])
    weight_gets = [p for m, p, _ in hub.requests[start:] if m == "GET" and p.endswith("/adapter_model.safetensors")]
    assert len(weight_gets) == 1
    assert list((store_root / ".staging").iterdir()) == []
