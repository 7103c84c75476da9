"""The S3 source against moto's S3 server on loopback, with credentials from the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_runtime.adapters.refs import Caller, parse_adapter_ref
from lora_runtime.adapter_files import ADAPTER_FILES
from lora_runtime.adapters.sources.download import AdapterStore, DownloadLimits
from lora_runtime.adapters.sources.s3 import S3Config, S3Source
from lora_runtime.errors import (
    AdapterAccessError,
    AdapterInvalidError,
    AdapterNotFoundError,
    AdapterUnavailableError,
    ValidationError,
)
from benchmarks.loopback_s3 import S3Server


def _source(s3: S3Server, root: Path, limits: DownloadLimits = DownloadLimits()) -> S3Source:
    return S3Source(S3Config(endpoint_url=s3.endpoint_url, path_style=True, timeout_s=5.0), AdapterStore(root, limits))


def _resolve(source: S3Source, adapter_id: str, api_token: str | None = None) -> Path:
    """What the engine asks of the source for a request naming `adapter_id` (with `api_token`)."""
    return source.resolve(parse_adapter_ref(adapter_id, "s3"), Caller(api_token=api_token))


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def _adapter_only(files: dict[str, bytes]) -> dict[str, bytes]:
    return {name: data for name, data in files.items() if name in ADAPTER_FILES}


def test_prefix_a1_never_matches_a10(
    s3: S3Server, adapter_files: list[dict[str, bytes]], store_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3.use_credentials(monkeypatch)
    source = _source(s3, store_root)
    first = _resolve(source, "s3://adapters/a/1", "ignored-token")
    assert _files(first) == _adapter_only(adapter_files[0])  # no README, nothing from a/1/nested/ or a/10/
    assert _files(_resolve(source, "adapters/a/10/")) == _adapter_only(adapter_files[1])
    assert first.resolve().is_relative_to(store_root.resolve())


def test_changed_objects_are_fetched_again(
    s3: S3Server, adapter_files: list[dict[str, bytes]], store_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3.use_credentials(monkeypatch)
    client = s3.client()
    for name, data in _adapter_only(adapter_files[0]).items():
        client.put_object(Bucket="adapters", Key=f"mutable/x/{name}", Body=data)
    source = _source(s3, store_root)
    assert _files(_resolve(source, "s3://adapters/mutable/x")) == _adapter_only(adapter_files[0])
    weights = adapter_files[1]["adapter_model.safetensors"]
    client.put_object(Bucket="adapters", Key="mutable/x/adapter_model.safetensors", Body=weights)
    assert _files(_resolve(source, "s3://adapters/mutable/x"))["adapter_model.safetensors"] == weights


def test_wrong_credentials_are_an_access_error(s3: S3Server, store_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s3.use_credentials(monkeypatch, access_key_id="AKIAWRONGWRONGWRONG0")
    with pytest.raises(AdapterAccessError) as caught:
        _resolve(_source(s3, store_root), "s3://adapters/a/1")
    assert "AKIA" not in caught.value.message and s3.endpoint_url not in caught.value.message


@pytest.mark.parametrize("adapter_id", ["s3://no-such-bucket/a/1", "s3://adapters/a/3", "s3://adapters/a"])
def test_missing_bucket_or_prefix(
    s3: S3Server, store_root: Path, monkeypatch: pytest.MonkeyPatch, adapter_id: str
) -> None:
    s3.use_credentials(monkeypatch)
    with pytest.raises(AdapterNotFoundError):
        _resolve(_source(s3, store_root), adapter_id)


def test_prefix_without_adapter_files_is_invalid(
    s3: S3Server, store_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3.use_credentials(monkeypatch)
    with pytest.raises(AdapterInvalidError, match="adapter_config.json"):
        _resolve(_source(s3, store_root), "s3://adapters/a/2")


def test_size_limit(s3: S3Server, store_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s3.use_credentials(monkeypatch)
    with pytest.raises(AdapterInvalidError, match="larger than"):
        _resolve(_source(s3, store_root, DownloadLimits(max_total_bytes=100)), "s3://adapters/a/1")


def test_unreachable_endpoint(store_root: Path, s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    s3.use_credentials(monkeypatch)
    config = S3Config(endpoint_url="http://127.0.0.1:9", path_style=True, timeout_s=1.0)
    with pytest.raises(AdapterUnavailableError):
        _resolve(S3Source(config, AdapterStore(store_root)), "s3://adapters/a/1")


@pytest.mark.parametrize("adapter_id", ["s3://adapters/../x", "s3://Bad_Bucket/a", "s3://adapters", "s3://adapters//a"])
def test_malformed_ids_are_refused_before_any_source(adapter_id: str) -> None:
    with pytest.raises(ValidationError) as refused:
        parse_adapter_ref(adapter_id, "s3")
    assert refused.value.field == "adapter_id"
