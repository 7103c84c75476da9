"""Shared fixtures for the source tests: real PEFT adapters and a hub-protocol server on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.adapters import make_lora_adapter, read_file_bytes
from benchmarks.loopback_hub import HubRepo, HubServer
from benchmarks.loopback_s3 import S3Server, s3_server

HUB_READER_TOKEN = "hf_reader_token"


@pytest.fixture(scope="session")
def adapter_files(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, bytes]]:
    """Two different adapters' files as PEFT saves them (config, safetensors weights, README)."""
    root = tmp_path_factory.mktemp("peft")
    return [read_file_bytes(make_lora_adapter(root / f"a{seed}", seed=seed)) for seed in (1, 2)]


@pytest.fixture(scope="session")
def hub(adapter_files: list[dict[str, bytes]]) -> Iterator[HubServer]:
    server = HubServer()
    first, second = adapter_files
    public = HubRepo("public")
    public.add_commit(
        {**first, ".gitattributes": b"*.safetensors filter=lfs\n", "big/pytorch_model.bin": b"x" * 4096},
        refs=("main", "v1"),
    )
    public.add_commit(second, refs=("main",))
    server.repos["org/public"] = public
    for visibility in ("private", "gated"):
        repo = HubRepo(visibility, readers=frozenset({HUB_READER_TOKEN}))
        repo.add_commit(first)
        server.repos[f"org/{visibility}"] = repo
    not_adapter = HubRepo("public")
    not_adapter.add_commit({"README.md": b"# just a readme\n"})
    server.repos["org/readme-only"] = not_adapter
    yield server.start()
    server.stop()


@pytest.fixture()
def store_root(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture(scope="session")
def s3(adapter_files: list[dict[str, bytes]]) -> S3Server:
    """Bucket `adapters` holds adapters at `a/1` and `a/10`; `a/2` has no adapter files."""
    server = s3_server()
    client = server.client()
    client.create_bucket(Bucket="adapters")
    for prefix, files in (("a/1", adapter_files[0]), ("a/10", adapter_files[1])):
        for name, data in files.items():
            client.put_object(Bucket="adapters", Key=f"{prefix}/{name}", Body=data)
    client.put_object(Bucket="adapters", Key="a/1/nested/adapter_model.safetensors", Body=b"not this one")
    client.put_object(Bucket="adapters", Key="a/2/README.md", Body=b"# nothing here\n")
    return server
