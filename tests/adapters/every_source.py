"""An adapter driven through every way it can arrive (the `local`, `hub`, `s3` and `pbase` sources of
the engine's adapter manager, and an upload's layout check), for the tests that a refusal reads the
same whichever way the adapter comes."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import kernels
from lora_runtime.adapters.manager import AdapterManager
from lora_runtime.adapters.peft_format import load_peft_adapter
from lora_runtime.adapters.refs import AdapterRequest, Caller, parse_adapter_ref
from lora_runtime.adapter_files import ADAPTER_FILES
from lora_runtime.adapters.sources.download import AdapterStore
from lora_runtime.engine_info import AdapterLimits, BaseModelShape
from lora_runtime.config import AdapterConfig
from lora_runtime.errors import AdapterInvalidError
from server.adapter_sources import build_adapter_sources
from server.config import ServerConfig
from server.registry.blobs import LocalBlobStore
from server.registry.layout import read_layout
from server.registry.source import PbaseResolver
from tests.fixtures.adapters import BASE_MODEL_NAME, TINY_LLAMA
from benchmarks.loopback_hub import HubServer

BASE_SHAPE = BaseModelShape.from_hf_config(BASE_MODEL_NAME, TINY_LLAMA)


def manager_with_every_source(tmp_path: Path, hub: HubServer, s3_endpoint: str | None = None) -> AdapterManager:
    """The engine's adapter manager with the sources the server builds for an operator's config."""
    config = ServerConfig(data_dir=tmp_path, hub_endpoint=hub.endpoint, s3_endpoint=s3_endpoint,
                          adapter_dir=tmp_path / "local")
    store = AdapterStore(tmp_path / "store")
    pbase = PbaseResolver(sessions=None, blobs=LocalBlobStore(tmp_path / "blobs"), store=store)
    return AdapterManager(AdapterConfig(), BASE_SHAPE, kernels.backend_for("cpu"), torch.float32,
                          build_adapter_sources(config, pbase, store))


def engine_refusal(manager: AdapterManager, adapter_id: str, source: str) -> AdapterInvalidError:
    """The error the manager's load of `adapter_id` from `source` ends with (it must be a refusal)."""
    request = AdapterRequest(parse_adapter_ref(adapter_id, source, allow_local=True), Caller(scope="demo"))
    error = manager.acquire(request).load.exception(timeout=60)
    assert isinstance(error, AdapterInvalidError), repr(error)
    return error


def upload_refusal(adapter: Path, upload_dir: Path) -> AdapterInvalidError:
    """What finishing an upload of the adapter's files answers (the server validates with
    `load_peft_adapter`, as `server.adapter_sources.adapter_services` does)."""
    upload_dir.mkdir()
    for name in ADAPTER_FILES:
        if (adapter / name).is_file():
            shutil.copy(adapter / name, upload_dir / name)
    with pytest.raises(AdapterInvalidError) as refused:
        read_layout(upload_dir, lambda directory: load_peft_adapter(directory, BASE_SHAPE, AdapterLimits()))
    return refused.value
