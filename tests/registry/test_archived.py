"""Archived versions are not served (as Predibase hides archived versions from use): their ids, with
or without a checkpoint, alone or in a merge, are `adapter_not_found` saying "archived", also while
their weights are cached, until the version is unarchived. The version itself stays listed."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from lora_runtime.adapters import MergedAdapters
from lora_runtime.adapters.refs import AdapterRequest, Caller, parse_adapter_ref, parse_merged_ids
from lora_runtime.errors import AdapterNotFoundError
from server.adapter_sources import AdapterServices
from server.registry.service import AdapterRegistry
from server.registry.signing import UrlSigner
from server.registry.source import PbaseResolver
from tests.fixtures.adapters import read_file_bytes
from tests.registry.conftest import adapter_only, resolve_in, write_files


def _upload_dir(peft_dir: Path, root: Path) -> Path:
    """The adapter's files, also as its checkpoint 1 (so `news/1@1` exists)."""
    files = adapter_only(read_file_bytes(peft_dir))
    return write_files(root, {**files, **{f"checkpoint-1/{name}": data for name, data in files.items()}})


def _requests(tenant: str) -> list[AdapterRequest]:
    """Every way a request names version 1 of repo `news`."""
    caller = Caller(scope=tenant)
    return [AdapterRequest(parse_adapter_ref("news/1"), caller),
            AdapterRequest(parse_adapter_ref("news/1@1"), caller),
            _merged_request(MergedAdapters(ids=("news/2", "news/1")), caller)]


def _merged_request(merge: MergedAdapters, caller: Caller) -> AdapterRequest:
    """A merge's request as the service builds it: its ids parsed once, into its parts."""
    return AdapterRequest(merge, caller, parts=parse_merged_ids(merge))


def test_an_archived_version_is_not_served_until_unarchived(
    registry: AdapterRegistry, resolver: PbaseResolver, peft_dirs: dict[str, Path], tmp_path: Path
) -> None:
    services = AdapterServices(registry, UrlSigner(b"s" * 32), weights_max_bytes=1 << 20)
    first = registry.create_version("t1", "alice", "news", _upload_dir(peft_dirs["a"], tmp_path / "v1"))
    registry.create_version("t1", "alice", "news", _upload_dir(peft_dirs["b"], tmp_path / "v2"))
    assert resolve_in(resolver, "t1", "news/1").is_dir()
    assert services.with_current_versions(_requests("t1")[0]).version_key == first.blob_id

    assert registry.set_archived("t1", "news", 1, True).archived
    for adapter_id in ("news/1", "news/1@1"):
        with pytest.raises(AdapterNotFoundError, match="archived"):
            resolve_in(resolver, "t1", adapter_id)
    for request in _requests("t1"):
        with pytest.raises(AdapterNotFoundError, match="archived"):
            services.with_current_versions(request)
    assert [v.archived for v in registry.get_repo("t1", "news").versions] == [True, False]
    assert resolve_in(resolver, "t1", "news/2").is_dir()

    registry.set_archived("t1", "news", 1, False)
    assert resolve_in(resolver, "t1", "news/1@1").is_dir()
    assert services.with_current_versions(_requests("t1")[0]).version_key == first.blob_id


def test_archiving_stops_a_cached_version_over_http(tmp_path: Path) -> None:
    from lora_runtime import Engine, EngineConfig
    from lora_runtime.embedded import ensure_embedded_model
    from server.adapter_sources import engine_adapter_sources
    from server.config import ServerConfig
    from server.db import open_database
    from tests.server.live import start_live_server
    from tests.wiring.conftest import make_embedded_adapter

    # The engine's pbase source reads the registry the live server's routes write (same data dir).
    database = open_database(f"sqlite:///{tmp_path / 'state.db'}")
    sources = engine_adapter_sources(ServerConfig(data_dir=tmp_path), database)
    engine = Engine.from_config(EngineConfig(model=str(ensure_embedded_model()), dtype="float32"), adapter_sources=sources)
    live = start_live_server(engine, tmp_path)
    try:
        adapter = make_embedded_adapter(tmp_path / "peft", seed=1)
        upload = write_files(tmp_path / "upload", adapter_only(read_file_bytes(adapter)))
        live.state.adapters.registry.create_version("demo", "demo", "news", upload)
        version_url = f"{live.base_url}/v2/repos/news/version/1"

        def generate() -> httpx.Response:
            return httpx.post(live.prefix() + "/generate", headers=live.headers(), timeout=120,
                              json={"inputs": "Hello", "parameters": {"max_new_tokens": 4,
                                                                     "adapter_id": "news/1"}})

        served = generate()  # now cached in the engine
        assert served.status_code == 200, served.text
        assert httpx.put(version_url, json={"archived": True}, headers=live.headers()).status_code == 200
        refused = generate()
        assert refused.status_code == 404 and refused.json()["error_type"] == "adapter_not_found"
        assert "archived" in refused.json()["error"]
        assert httpx.get(version_url, headers=live.headers()).json()["archived"] is True
        assert httpx.put(version_url, json={"archived": False}, headers=live.headers()).status_code == 200
        assert generate().json() == served.json()
    finally:
        live.stop()
        database.dispose()
