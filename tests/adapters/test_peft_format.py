"""Loading PEFT LoRA directories: the oracle is PEFT's own `get_delta_weight` per module."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from peft import IA3Config, LoraConfig, PeftModel
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file

from lora_runtime.adapters import AdapterLimits, load_peft_adapter
from lora_runtime.adapter_files import ADAPTER_CONFIG_FILE as CONFIG_FILE
from lora_runtime.adapter_files import BIN_FILE, SAFETENSORS_FILE
from lora_runtime.errors import AdapterIncompatibleError, AdapterInvalidError
from tests.adapters.peft_factory import peft_model, save_adapter, tiny_llama, tiny_shape

LIMITS = AdapterLimits(max_rank=64, max_bytes=1 << 30)

LOAD_CASES = {
    "q_v_rank8": LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all_linear_rank4": LoraConfig(r=4, lora_alpha=32, target_modules="all-linear"),
    "rslora": LoraConfig(r=16, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "o_proj", "down_proj"]),
    "rank_alpha_pattern": LoraConfig(
        r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "up_proj", "gate_proj"],
        rank_pattern={"layers.1.self_attn.q_proj": 2, "up_proj": 12},
        alpha_pattern={"k_proj": 3, "layers.0.mlp.gate_proj": 40},
    ),
    "layers_to_transform": LoraConfig(
        r=6, lora_alpha=12, target_modules=["v_proj", "down_proj"], layers_to_transform=[1],
    ),
    "regex_targets": LoraConfig(r=5, lora_alpha=7, target_modules=r".*\.(q_proj|gate_proj)"),
}


def _peft_deltas(model: PeftModel) -> dict[tuple[int, str], torch.Tensor]:
    deltas = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            layer_idx = int(name.split("layers.")[1].split(".")[0])
            deltas[(layer_idx, name.rsplit(".", 1)[-1])] = module.get_delta_weight("default")
    return deltas


@pytest.mark.parametrize("case", sorted(LOAD_CASES))
def test_delta_equals_peft_get_delta_weight(case: str, tiny_base, tmp_path: Path) -> None:
    model = peft_model(tiny_base, LOAD_CASES[case], seed=1)
    weights = load_peft_adapter(save_adapter(model, tmp_path), tiny_shape(), LIMITS)
    expected = _peft_deltas(model)
    assert set(weights.modules) == set(expected)
    for key, delta in expected.items():
        torch.testing.assert_close(weights.modules[key].delta_weight(), delta, rtol=1e-6, atol=1e-7)


def test_fan_in_fan_out_on_linear_layers_matches_peft(tiny_base, tmp_path: Path) -> None:
    """PEFT turns fan_in_fan_out off for nn.Linear targets; a config saying true loads the same."""
    model = peft_model(tiny_base, LOAD_CASES["q_v_rank8"], seed=2)
    directory = save_adapter(model, tmp_path)
    _edit_config(directory, fan_in_fan_out=True)
    reloaded = PeftModel.from_pretrained(tiny_llama(), str(directory))
    weights = load_peft_adapter(directory, tiny_shape(), LIMITS)
    for key, delta in _peft_deltas(reloaded).items():
        torch.testing.assert_close(weights.modules[key].delta_weight(), delta, rtol=1e-6, atol=1e-7)


def test_bin_file_loads_like_safetensors(tiny_base, tmp_path: Path) -> None:
    directory = save_adapter(peft_model(tiny_base, LOAD_CASES["q_v_rank8"], seed=3), tmp_path)
    from_safetensors = load_peft_adapter(directory, tiny_shape(), LIMITS)
    torch.save(load_file(directory / SAFETENSORS_FILE), directory / BIN_FILE)
    (directory / SAFETENSORS_FILE).unlink()
    from_bin = load_peft_adapter(directory, tiny_shape(), LIMITS)
    for key, module in from_safetensors.modules.items():
        assert torch.equal(from_bin.modules[key].delta_weight(), module.delta_weight())
    assert from_bin.max_rank == 8
    num_layers, fp32_bytes = 2, 4  # q: A [8, 64], B [64, 8]; v: A [8, 64], B [32, 8]
    assert from_bin.num_bytes == num_layers * (8 * 64 + 64 * 8 + 8 * 64 + 32 * 8) * fp32_bytes


def _edit_config(directory: Path, **fields: object) -> None:
    path = directory / CONFIG_FILE
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


@pytest.fixture
def good_adapter(tiny_base, tmp_path: Path) -> Path:
    return save_adapter(peft_model(tiny_base, LOAD_CASES["q_v_rank8"], seed=4), tmp_path / "good")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"task_type": "SEQ_CLS"}, "classification adapters need a different deployment flow"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules"),
        ({"r": 0}, "r:"),
        ({"r": 4}, "r:"),  # the weights say 8
        ({"layers_to_transform": [1]}, "layers_to_transform"),
        ({"rank_pattern": {"q_proj": "big"}}, "rank_pattern"),
        ({"lora_alpha": float("nan")}, "lora_alpha"),
        ({"alpha_pattern": {"q_proj": float("nan")}}, "alpha_pattern"),
        ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
    ],
)
def test_unsupported_config_fields_are_refused_by_name(good_adapter: Path, fields, named) -> None:
    _edit_config(good_adapter, **fields)
    with pytest.raises(AdapterInvalidError, match=named):
        load_peft_adapter(good_adapter, tiny_shape(), LIMITS)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (LoraConfig(r=4, target_modules=["q_proj"], use_dora=True), "use_dora"),
        (LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]), "embedding and lm_head"),
        (LoraConfig(r=4, target_modules=["lm_head", "q_proj"]), "embedding and lm_head"),
        (LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]), "modules_to_save"),
        (IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]), "peft_type"),
    ],
)
def test_real_peft_saves_of_unsupported_kinds_are_refused(config, named, tiny_base, tmp_path) -> None:
    directory = save_adapter(peft_model(tiny_base, config, seed=5), tmp_path)
    with pytest.raises(AdapterInvalidError, match=named):
        load_peft_adapter(directory, tiny_shape(), LIMITS)


def test_corrupt_or_missing_files_are_invalid(good_adapter: Path) -> None:
    weights_path = good_adapter / SAFETENSORS_FILE
    weights_path.write_bytes(weights_path.read_bytes()[:100])
    with pytest.raises(AdapterInvalidError, match="corrupt"):
        load_peft_adapter(good_adapter, tiny_shape(), LIMITS)
    weights_path.unlink()
    with pytest.raises(AdapterInvalidError, match=SAFETENSORS_FILE):
        load_peft_adapter(good_adapter, tiny_shape(), LIMITS)
    (good_adapter / CONFIG_FILE).write_text("{not json")
    with pytest.raises(AdapterInvalidError, match="not valid JSON"):
        load_peft_adapter(good_adapter, tiny_shape(), LIMITS)
    (good_adapter / CONFIG_FILE).unlink()
    with pytest.raises(AdapterInvalidError, match=CONFIG_FILE):
        load_peft_adapter(good_adapter, tiny_shape(), LIMITS)


def test_bin_with_pickled_code_is_refused(good_adapter: Path) -> None:
    (good_adapter / SAFETENSORS_FILE).unlink()
    torch.save({"weights": logging.getLogger}, good_adapter / BIN_FILE)
    with pytest.raises(AdapterInvalidError, match="corrupt"):
        load_peft_adapter(good_adapter, tiny_shape(), LIMITS)


def test_shapes_of_another_model_are_incompatible(good_adapter: Path) -> None:
    with pytest.raises(AdapterIncompatibleError, match="q_proj expects lora_A"):
        load_peft_adapter(good_adapter, tiny_shape(hidden_size=128), LIMITS)
    with pytest.raises(AdapterIncompatibleError, match="layer 1 does not exist"):
        load_peft_adapter(good_adapter, tiny_shape(num_hidden_layers=1), LIMITS)


def test_rank_and_size_limits_are_incompatible(good_adapter: Path) -> None:
    with pytest.raises(AdapterIncompatibleError, match="rank 8 exceeds the maximum adapter rank 4"):
        load_peft_adapter(good_adapter, tiny_shape(), AdapterLimits(max_rank=4))
    with pytest.raises(AdapterIncompatibleError, match="exceeds the limit of 1000 bytes"):
        load_peft_adapter(good_adapter, tiny_shape(), AdapterLimits(max_bytes=1000))


def test_other_base_model_name_with_fitting_shapes_only_warns(good_adapter: Path, caplog) -> None:
    _edit_config(good_adapter, base_model_name_or_path="someone/other-model")
    with caplog.at_level(logging.WARNING, logger="lora_runtime.adapters.peft_format"):
        weights = load_peft_adapter(good_adapter, tiny_shape(), LIMITS)
    assert "someone/other-model" in caplog.text
    assert weights.base_model_name == "someone/other-model"
