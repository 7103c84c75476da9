"""Adapter ids and the local store: strict parsing, atomic publication, deduplication, bounds."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from lora_runtime.adapters.sources.download import AdapterStore, DownloadLimits
from lora_runtime.adapters.sources.ids import (
    HubId,
    PbaseId,
    S3Id,
    infer_source,
    parse_hub_id,
    parse_pbase_id,
    parse_s3_id,
)
from lora_runtime.errors import AdapterInvalidError, ValidationError


@pytest.mark.parametrize(
    ("adapter_id", "source"),
    [("news/1", "pbase"), ("news/12@3", "pbase"), ("s3://b/p", "s3"), ("org/name", "hub"), ("org/name@v1", "hub")],
)
def test_source_inference(adapter_id: str, source: str) -> None:
    assert infer_source(adapter_id) == source


def test_parsers() -> None:
    assert parse_hub_id("org/name@refs/pr/1") == HubId("org/name", "refs/pr/1")
    assert parse_hub_id("gpt2@main") == HubId("gpt2", "main")  # root-level hub repos have no org
    assert parse_pbase_id("news/12@3") == PbaseId("news", 12, 3)
    assert parse_s3_id("s3://my.bucket/a/1/") == S3Id("my.bucket", "a/1")
    assert parse_s3_id("my-bucket/a") == S3Id("my-bucket", "a")


@pytest.mark.parametrize("adapter_id", ["news/0", "news/1@x", "../1", "news/1/2", "news/" + "9" * 12])
def test_bad_pbase_ids(adapter_id: str) -> None:
    with pytest.raises(ValidationError):
        parse_pbase_id(adapter_id)


def _writer(files: dict[str, bytes], calls: list[int] | None = None):  # noqa: ANN202
    def fill(staging: Path) -> None:
        if calls is not None:
            calls.append(1)
        for name, data in files.items():
            (staging / name).write_bytes(data)

    return fill


GOOD = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"w" * 10}


def test_concurrent_fetches_fill_once(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    calls: list[int] = []
    barrier = threading.Barrier(4)
    paths: list[Path] = []

    def fetch() -> None:
        barrier.wait()
        paths.append(store.fetch(("hub", "org", "name", "abc"), "org/name", _writer(GOOD, calls)))

    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(set(paths)) == 1
    assert {p.name for p in paths[0].iterdir()} == set(GOOD)


@pytest.mark.parametrize(
    ("files", "limits", "message"),
    [
        ({**GOOD, "pytorch_model.bin": b"x"}, DownloadLimits(), "unexpected files"),
        (GOOD, DownloadLimits(max_total_bytes=5), "larger than"),
        (GOOD, DownloadLimits(max_files=1), "more than 1 files"),
    ],
)
def test_a_failed_check_publishes_nothing(
    tmp_path: Path, files: dict[str, bytes], limits: DownloadLimits, message: str
) -> None:
    store = AdapterStore(tmp_path, limits)
    with pytest.raises(AdapterInvalidError, match=message):
        store.fetch(("s3", "bucket", "key"), "bucket/key", _writer(files))
    assert not (tmp_path / "s3").exists()
    assert list((tmp_path / ".staging").iterdir()) == []


def test_a_failing_download_leaves_no_partial_adapter(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)

    def fail_halfway(staging: Path) -> None:
        (staging / "adapter_config.json").write_bytes(b"{}")
        raise OSError("connection reset")

    with pytest.raises(OSError):
        store.fetch(("hub", "org", "x", "abc"), "org/x", fail_halfway)
    assert not (tmp_path / "hub" / "org" / "x" / "abc").exists()
    assert store.fetch(("hub", "org", "x", "abc"), "org/x", _writer(GOOD)).is_dir()


@pytest.mark.parametrize("key", [("..",), ("hub", "../x"), ("a/b",), ("",), (".hidden",)])
def test_store_keys_cannot_leave_the_root(tmp_path: Path, key: tuple[str, ...]) -> None:
    with pytest.raises(AdapterInvalidError):
        AdapterStore(tmp_path).path_for(key)
