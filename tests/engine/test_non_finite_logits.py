"""A request whose next-token scores turn NaN or infinite ends with `NonFiniteLogitsError` (its own
message, never torch's "index 49152 is out of bounds" or "probability tensor contains either inf, nan
or element < 0"), greedy or sampled, while the other requests of its batch finish as they would alone.

The scores are made non-finite by an adapter whose weights are all 1e30, with the bound that refuses
it at the door (`weights.MAX_DELTA_NORM`) lifted: what the engine does when weights get past it anyway."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import save_file

from lora_runtime.adapters import weights
from lora_runtime.engine_info import BaseModelShape
from lora_runtime.core import SamplingParams
from lora_runtime.errors import NonFiniteLogitsError

RANK = 8
PROMPTS = ["The capital of France is", "Once upon a time"]


def _overflowing_adapter(directory: Path, model_dir: Path) -> str:
    """A PEFT adapter of layer 0's q_proj whose every weight is 1e30: q overflows float32."""
    shape = BaseModelShape.from_hf_config("embedded", json.loads((model_dir / "config.json").read_text()))
    in_features, out_features = shape.module_shapes["q_proj"]
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    LoraConfig(r=RANK, lora_alpha=RANK, target_modules=["q_proj"]).save_pretrained(str(directory))
    save_file({f"{prefix}.lora_A.weight": torch.full((RANK, in_features), 1e30),
               f"{prefix}.lora_B.weight": torch.full((out_features, RANK), 1e30)},
              str(directory / "adapter_model.safetensors"))
    return str(directory)


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=4),
    SamplingParams(max_new_tokens=4, temperature=1.0, seed=7),
], ids=["greedy", "sampled"])
def test_non_finite_scores_fail_their_request_alone(
    params: SamplingParams, engine, embedded_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(weights, "MAX_DELTA_NORM", float("inf"))
    hostile = _overflowing_adapter(tmp_path / "overflowing", embedded_model_dir)
    alone = engine.generate(PROMPTS[1:], params)[0]
    failed, sibling = engine.generate(PROMPTS, params, adapters=[hostile, None])
    assert isinstance(failed.error, NonFiniteLogitsError), repr(failed.error)
    assert failed.finished and failed.token_ids == [] and "NaN or infinite" in failed.error.message
    assert failed.error.error_type == "generation"
    assert sibling.error is None and sibling.finished
    assert sibling.token_ids == alone.token_ids and len(sibling.token_ids) == 4
