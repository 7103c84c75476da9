"""An adapter's update is bounded at the door: one whose weights are all 1e30 (finite, so a NaN check
alone passes it; every request on it then failed with torch's text) is refused with one 422
`adapter_invalid` message naming the module, whichever way it arrives: the `local`, `hub` (on loopback)
and `s3` (moto on loopback) sources and an upload's check. Merges cannot leave the bound either. The
bound itself (`weights.MAX_DELTA_NORM`) is checked at its edge against the dense product."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_runtime.adapters.merge import merge_lora_weights
from lora_runtime.adapters.merge_request import MergedAdapters
from lora_runtime.adapters.peft_format import SAFETENSORS_FILE
from lora_runtime.adapter_files import ADAPTER_FILES
from lora_runtime.adapters.weights import (
    MAX_DELTA_NORM,
    LoraModuleWeights,
    LoraWeights,
    unbounded_module,
)
from lora_runtime.errors import AdapterIncompatibleError
from tests.adapters.every_source import engine_refusal, manager_with_every_source, upload_refusal
from tests.fixtures.adapters import make_lora_adapter, read_file_bytes
from benchmarks.loopback_hub import HubRepo, HubServer
from benchmarks.loopback_s3 import s3_server

HOSTILE_VALUE = 1e30


def _hostile_adapter(directory: Path) -> Path:
    """A real PEFT adapter (config and key names as PEFT saves them) whose every weight is 1e30."""
    make_lora_adapter(directory, seed=1)
    tensors = load_file(directory / SAFETENSORS_FILE)
    save_file({key: torch.full_like(value, HOSTILE_VALUE) for key, value in tensors.items()},
              directory / SAFETENSORS_FILE)
    return directory


def test_a_1e30_adapter_is_refused_by_every_source_with_one_message(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = _hostile_adapter(tmp_path / "local" / "team" / "huge")
    files = {name: data for name, data in read_file_bytes(adapter).items() if name in ADAPTER_FILES}
    hub.repos["org/huge"] = HubRepo("public")
    hub.repos["org/huge"].add_commit(files)
    s3 = s3_server()
    s3.use_credentials(monkeypatch)
    client = s3.client()
    client.create_bucket(Bucket="hostile-adapters")
    for name, data in files.items():
        client.put_object(Bucket="hostile-adapters", Key=f"huge/{name}", Body=data)
    manager = manager_with_every_source(tmp_path, hub, s3.endpoint_url)
    try:
        errors = {"local": engine_refusal(manager, "team/huge", "local"),
                  "hub": engine_refusal(manager, "org/huge", "hub"),
                  "s3": engine_refusal(manager, "s3://hostile-adapters/huge", "s3"),
                  "upload": upload_refusal(adapter, tmp_path / "upload")}
    finally:
        manager.close()
    messages = {source: error.message for source, error in errors.items()}
    assert len(set(messages.values())) == 1, messages
    message = messages["local"]
    assert message.startswith("weights: layer 0 q_proj holds an update"), message
    assert f"{MAX_DELTA_NORM:g}" in message and "\n" not in message, message
    assert all(error.error_type == "adapter_invalid" for error in errors.values())


def _module(norm_a: float, norm_b: float, scale: float = 2.0, rank: int = 4) -> LoraModuleWeights:
    """Rank-one factors of the given Frobenius norms (so the bound is the update's exact norm)."""
    lora_a, lora_b = torch.zeros(rank, 16), torch.zeros(32, rank)
    lora_a[0, 3], lora_b[5, 0] = norm_a, norm_b
    return LoraModuleWeights(lora_a, lora_b, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_bound_holds_at_its_edge_and_against_the_dense_update(dtype: torch.dtype) -> None:
    inside, outside = _module(50.0, 0.99 * MAX_DELTA_NORM / 100), _module(50.0, 1.01 * MAX_DELTA_NORM / 100)
    for module in (inside, outside):
        module = LoraModuleWeights(module.lora_a.to(dtype), module.lora_b.to(dtype), module.scale)
        dense_norm = torch.linalg.matrix_norm(module.delta_weight().double(), 2).item()
        found = unbounded_module({(0, "q_proj"): module})
        assert (found is None) == (dense_norm <= MAX_DELTA_NORM), (dense_norm, found)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_values_that_are_not_finite_are_named(value: float) -> None:
    module = _module(1.0, 1.0)
    module.lora_b[7, 1] = value
    modules = {(0, "q_proj"): _module(1.0, 1.0), (1, "down_proj"): module}
    assert unbounded_module(modules) == ((1, "down_proj"), "NaN or infinite values")


def test_a_factor_alone_over_the_bound_is_refused() -> None:
    """s * B stored in float16 pages overflows long before the product does when A is tiny."""
    assert unbounded_module({(0, "v_proj"): _module(1e-6, 1e6, scale=1.0)}) is not None


def test_a_merge_of_bounded_adapters_cannot_build_an_unbounded_update() -> None:
    """Each adapter at half the bound; merged with itself its update is (sqrt(w1) + sqrt(w2))^2 times
    its own (merge.py): 0.4x within the bound at weights 0.1, 400x at weights 100 (the largest allowed)."""
    half = LoraWeights({(0, "q_proj"): _module(50.0, MAX_DELTA_NORM / 200)})
    assert unbounded_module(half.modules) is None
    small = merge_lora_weights([half, half], MergedAdapters(["x", "y"], [0.1, 0.1]))
    assert unbounded_module(small.modules) is None
    with pytest.raises(AdapterIncompatibleError, match=r"^merged_adapters.weights: .*layer 0 q_proj overflow") as refused:
        merge_lora_weights([half, half], MergedAdapters(["x", "y"], [100.0, 100.0]))
    assert f"{MAX_DELTA_NORM:g}" in refused.value.message and refused.value.error_type == "adapter_incompatible"
