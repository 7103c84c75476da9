"""An `adapter_model.bin` that torch's `weights_only` loader refuses (pickled code, or a truncated
file) gets one short message whichever way it arrives: the engine loading it through the `local`
or the `hub` source (the hub on loopback), or an upload's conversion to safetensors. torch's own
text (paragraphs, advice to turn the safety check off) never reaches the message."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lora_runtime.adapters.peft_format import BIN_FILE, SAFETENSORS_FILE
from lora_runtime.adapter_files import ADAPTER_FILES
from tests.adapters.every_source import engine_refusal, manager_with_every_source, upload_refusal
from tests.fixtures.adapters import make_lora_adapter, read_file_bytes
from benchmarks.loopback_hub import HubRepo, HubServer

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


@pytest.mark.parametrize("kind", ["pickled_code", "truncated"])
def test_local_hub_and_upload_answer_one_clean_message(kind: str, hub: HubServer, tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    adapter = _bad_bin_adapter(tmp_path / "local" / "team" / "bad", kind, marker)
    hub.repos[f"org/bad-{kind}"] = HubRepo("public")
    hub.repos[f"org/bad-{kind}"].add_commit(
        {name: data for name, data in read_file_bytes(adapter).items() if name in ADAPTER_FILES})
    manager = manager_with_every_source(tmp_path, hub)
    try:
        messages = {"local": engine_refusal(manager, "team/bad", "local").message,
                    "hub": engine_refusal(manager, f"org/bad-{kind}", "hub").message,
                    "upload": upload_refusal(adapter, tmp_path / "upload").message}
    finally:
        manager.close()
    assert len(set(messages.values())) == 1, messages
    message = messages["local"]
    assert message.startswith(BIN_FILE) and "\n" not in message and len(message) < 160, message
    assert not any(text in message for text in LIBRARY_TEXT), message
    assert not marker.exists(), "the pickled code ran"
