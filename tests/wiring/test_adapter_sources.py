"""The engine's sources as the operator configures them: without a hub endpoint hub adapters are
unavailable (424, saying why), without an adapter directory there is no local source, and with one
its ids stay inside it. No server needed."""
from __future__ import annotations

from pathlib import Path

import pytest

from lora_runtime.adapters.refs import Caller, LocalSource, parse_adapter_ref
from lora_runtime.adapters.sources.download import AdapterStore
from lora_runtime.adapters.sources.hub import HubSource
from lora_runtime.adapters.sources.s3 import S3Source
from lora_runtime.errors import AdapterUnavailableError, ValidationError
from server.adapter_sources import build_adapter_sources
from server.config import ServerConfig
from server.registry.blobs import LocalBlobStore
from server.registry.source import PbaseResolver


def _sources(tmp_path: Path, **options):
    store = AdapterStore(tmp_path / "store")
    pbase = PbaseResolver(sessions=None, blobs=LocalBlobStore(tmp_path / "blobs"), store=store)
    return build_adapter_sources(ServerConfig(data_dir=tmp_path, **options), pbase, store)


def test_every_source_is_an_adapter_source_object(tmp_path: Path) -> None:
    sources = _sources(tmp_path, hub_endpoint="http://127.0.0.1:9", adapter_dir=tmp_path)
    assert isinstance(sources["pbase"], PbaseResolver)
    assert isinstance(sources["hub"], HubSource) and isinstance(sources["s3"], S3Source)
    assert isinstance(sources["local"], LocalSource) and sources["local"].root == tmp_path.resolve()


def test_without_hub_endpoint_hub_adapters_are_unavailable(tmp_path: Path) -> None:
    sources = _sources(tmp_path)
    with pytest.raises(AdapterUnavailableError, match="--hub-endpoint"):
        sources["hub"].resolve(parse_adapter_ref("org/name"), Caller("demo", "hf_token"))


def test_local_source_only_with_an_adapter_dir_and_inside_it(tmp_path: Path) -> None:
    ref = parse_adapter_ref("team/a", "local", allow_local=True)
    with pytest.raises(ValidationError) as refused:
        _sources(tmp_path)["local"].resolve(ref, Caller("demo"))
    assert refused.value.field == "adapter_source"
    adapter_dir = tmp_path / "adapters"
    (adapter_dir / "team" / "a").mkdir(parents=True)
    (adapter_dir / "team" / "a" / "adapter_config.json").write_text("{}")
    local = _sources(tmp_path, adapter_dir=adapter_dir)["local"]
    assert local.resolve(ref, Caller("demo")) == (adapter_dir / "team" / "a").resolve()
    with pytest.raises(ValidationError):
        local.resolve(parse_adapter_ref("../../etc", "local", allow_local=True), Caller("demo"))
