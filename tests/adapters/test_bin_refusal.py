"""An `adapter_model.bin` that torch's `weights_only` loader refuses (pickled code, or a truncated
file) gets one short message whichever way it arrives: the engine loading it through the `local`
or the `hub` source (the hub on loopback), or an upload's conversion to safetensors. torch's own
text (paragraphs, advice to turn the safety check off) never reaches the message."""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kernels
from lora_runtime.adapters.manager import AdapterManager
from lora_runtime.adapters.peft_format import BIN_FILE, SAFETENSORS_FILE, load_peft_adapter
from lora_runtime.adapters.refs import AdapterRequest, Caller, parse_adapter_ref
from lora_runtime.adapters.sources.download import ADAPTER_FILES, AdapterStore
from lora_runtime.adapters.weights import AdapterLimits, BaseModelShape
from lora_runtime.config import AdapterConfig
from lora_runtime.errors import AdapterInvalidError
from server.adapter_sources import build_adapter_sources
from server.config import ServerConfig
from server.registry.blobs import LocalBlobStore
from server.registry.layout import read_layout
from server.registry.source import PbaseResolver
from tests.fixtures.adapters import BASE_MODEL_NAME, TINY_LLAMA, make_lora_adapter, read_file_bytes
from tests.fixtures.hub_server import HubRepo, HubServer

BASE_SHAPE = BaseModelShape.from_hf_config(BASE_MODEL_NAME, TINY_LLAMA)
LIBRARY_TEXT = ("weights_only", "torch.load", "Weights only", "GLOBAL", "miniz", "pytorch.org", "\x1b")


class _RunsCode:
    """A pickle that would create `marker` when unpickled without `weights_only`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, ...]]:
        return (os.system, (f"touch {self.marker}",))


def _bad_bin_adapter(directory: Path, kind: str, marker: Path) -> Path:
    """A real PEFT adapter whose weights are a `.bin` that torch's safe loader refuses."""
    make_lora_adapter(directory, seed=1)
    (directory / SAFETENSORS_FILE).unlink()
    if kind == "pickled_code":
        torch.save({"base_model.model.layers.0.self_attn.q_proj.lora_A.weight": _RunsCode(marker)},
                   directory / BIN_FILE)
    else:
        torch.save({"weight": torch.ones(4, 4)}, directory / BIN_FILE)
        (directory / BIN_FILE).write_bytes((directory / BIN_FILE).read_bytes()[:64])
    return directory


@pytest.fixture(scope="module")
def hub() -> Iterator[HubServer]:
    server = HubServer().start()
    yield server
    server.stop()


def _manager(tmp_path: Path, hub: HubServer) -> AdapterManager:
    """The engine's adapter manager with the sources the server builds for an operator's config."""
    config = ServerConfig(data_dir=tmp_path, hub_endpoint=hub.endpoint, adapter_dir=tmp_path / "local")
    store = AdapterStore(tmp_path / "store")
    pbase = PbaseResolver(sessions=None, blobs=LocalBlobStore(tmp_path / "blobs"), store=store)
    return AdapterManager(AdapterConfig(), BASE_SHAPE, kernels.backend_for("cpu"), torch.float32,
                          build_adapter_sources(config, pbase, store))


def _engine_refusal(manager: AdapterManager, adapter_id: str, source: str) -> str:
    request = AdapterRequest(parse_adapter_ref(adapter_id, source, allow_local=True), Caller(scope="demo"))
    error = manager.acquire(request).load.exception(timeout=60)
    assert isinstance(error, AdapterInvalidError), repr(error)
    return error.message


def _upload_refusal(adapter: Path, upload_dir: Path) -> str:
    """What finishing an upload of the adapter's files answers (the upload's layout check)."""
    upload_dir.mkdir()
    for name in ADAPTER_FILES:
        if (adapter / name).is_file():
            shutil.copy(adapter / name, upload_dir / name)
    with pytest.raises(AdapterInvalidError) as refused:
        read_layout(upload_dir, lambda directory: load_peft_adapter(directory, BASE_SHAPE, AdapterLimits()))
    return refused.value.message


@pytest.mark.parametrize("kind", ["pickled_code", "truncated"])
def test_local_hub_and_upload_answer_one_clean_message(kind: str, hub: HubServer, tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    adapter = _bad_bin_adapter(tmp_path / "local" / "team" / "bad", kind, marker)
    hub.repos[f"org/bad-{kind}"] = HubRepo("public")
    hub.repos[f"org/bad-{kind}"].add_commit(
        {name: data for name, data in read_file_bytes(adapter).items() if name in ADAPTER_FILES})
    manager = _manager(tmp_path, hub)
    try:
        messages = {"local": _engine_refusal(manager, "team/bad", "local"),
                    "hub": _engine_refusal(manager, f"org/bad-{kind}", "hub"),
                    "upload": _upload_refusal(adapter, tmp_path / "upload")}
    finally:
        manager.close()
    assert len(set(messages.values())) == 1, messages
    message = messages["local"]
    assert message.startswith(BIN_FILE) and "\n" not in message and len(message) < 160, message
    assert not any(text in message for text in LIBRARY_TEXT), message
    assert not marker.exists(), "the pickled code ran"
