"""Registry fixtures: the same tests on SQLite and on a real PostgreSQL started for the session."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker

from lora_runtime.adapters.refs import Caller, parse_adapter_ref
from lora_runtime.adapter_files import ADAPTER_FILES
from lora_runtime.adapters.sources.download import AdapterStore
from server.registry.blobs import LocalBlobStore
from server.registry.models import RegistryBase
from server.registry.repos import SessionFactory
from server.registry.service import AdapterRegistry
from server.registry.signing import UrlSigner
from server.registry.source import PbaseResolver
from server.registry.uploads import UPLOAD_ROUTE, UploadConfig, UploadService
from tests.fixtures.adapters import check_tiny_llama_adapter, make_lora_adapter, read_file_bytes
from tests.fixtures.postgres import PostgresServer, find_postgres_bin_dir, start_postgres


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    bin_dir = find_postgres_bin_dir()
    if bin_dir is None:
        pytest.skip("PostgreSQL binaries (initdb, pg_ctl) are not installed; run scripts/ensure_postgres.sh")
    server = start_postgres(bin_dir)
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def sessions(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SessionFactory]:
    """A session factory on an empty registry schema."""
    if request.param == "sqlite":
        engine = create_engine(f"sqlite:///{tmp_path / 'registry.db'}")
    else:
        engine = create_engine(request.getfixturevalue("postgres").url, pool_size=8)
        RegistryBase.metadata.drop_all(engine)
    RegistryBase.metadata.create_all(engine)
    yield sessionmaker(engine)
    engine.dispose()


@pytest.fixture(scope="session")
def peft_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real PEFT adapters: safetensors (`a`, `b`) and a torch-pickled `adapter_model.bin` (`bin`)."""
    root = tmp_path_factory.mktemp("peft")
    return {
        "a": make_lora_adapter(root / "a", seed=1),
        "b": make_lora_adapter(root / "b", seed=2),
        "bin": make_lora_adapter(root / "bin", seed=3, safe_serialization=False),
    }


@pytest.fixture(scope="session")
def peft_files(peft_dirs: dict[str, Path]) -> dict[str, dict[str, bytes]]:
    return {name: read_file_bytes(path) for name, path in peft_dirs.items()}


@pytest.fixture()
def registry(sessions: SessionFactory, tmp_path: Path) -> AdapterRegistry:
    return AdapterRegistry(sessions, LocalBlobStore(tmp_path / "blobs"), check_tiny_llama_adapter)


@pytest.fixture()
def uploads(registry: AdapterRegistry) -> UploadService:
    return UploadService(registry, UrlSigner(b"s" * 32), UploadConfig(public_base_url="http://127.0.0.1:8080"))


@pytest.fixture()
def resolver(registry: AdapterRegistry, tmp_path: Path) -> PbaseResolver:
    return PbaseResolver(registry.sessions, registry.blobs, AdapterStore(tmp_path / "store"))


def resolve_in(resolver: PbaseResolver, tenant: str, adapter_id: str) -> Path:
    """What the engine asks of the `pbase` source for a request of `tenant` naming `adapter_id`."""
    return resolver.resolve(parse_adapter_ref(adapter_id, "pbase"), Caller(scope=tenant))


def adapter_only(files: dict[str, bytes]) -> dict[str, bytes]:
    return {name: data for name, data in files.items() if name in ADAPTER_FILES}


def write_files(directory: Path, files: dict[str, bytes]) -> Path:
    """Writes `files` (names may contain one `checkpoint-<N>/` level) into `directory`."""
    for name, data in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
    return directory


def put_via_url(uploads: UploadService, url: str, data: bytes) -> int:
    """What this server's PUT route does with a signed URL to it: hand path, query and body over."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    upload_id, name = parts.path.removeprefix(UPLOAD_ROUTE + "/").split("/", 1)
    admission = uploads.admit_file(upload_id, name, query["expires"][0], query["signature"][0])
    try:
        return uploads.store_file(admission, io.BytesIO(data))
    finally:
        uploads.release(admission)
