"""Each family with a random PEFT adapter on every projection it has (Phi-3's fused qkv_proj and
gate_up_proj included), served by our engine from an HF directory with a tokenizer, in one batch with
base-model requests: greedy tokens equal to PEFT's (`PeftModel` on the HF model), and their
logprobs and the prompts' within fp32 atol 1e-4. Prompts are longer than the families' windows."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel
from transformers import AutoTokenizer

from lora_runtime import Engine, EngineConfig, SamplingParams
from lora_runtime.embedded import ensure_embedded_model
from lora_runtime.errors import AdapterIncompatibleError
from tests.adapters.peft_factory import peft_model, save_adapter
from tests.engine.factories import FAMILY_CONFIGS, save_tiny_model

ATOL = 1e-4
SEPARATE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS = {family: SEPARATE for family in FAMILY_CONFIGS}
TARGETS["phi3"] = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
PROMPTS = [[5, 17, 33, 9, 60, 12, 77, 41, 8, 19, 23], [44, 3, 90, 61, 7, 15, 28, 70], [5, 17, 33, 9, 60, 12, 77]]


@pytest.fixture
def family_engine(request, tmp_path):
    """(engine, HF base model, PeftModel, adapter directory) of `request.param`'s family."""
    family = request.param
    model_dir = tmp_path / family
    hf_base = save_tiny_model(family, model_dir)
    AutoTokenizer.from_pretrained(ensure_embedded_model()).save_pretrained(model_dir)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[family])
    adapter_dir = save_adapter(peft_model(hf_base, config, seed=5), tmp_path / "adapter")
    peft = PeftModel.from_pretrained(hf_base, str(adapter_dir)).eval()
    engine = Engine.from_config(EngineConfig(model=str(model_dir), dtype="float32"))
    return engine, peft, adapter_dir


@pytest.mark.parametrize("family_engine", sorted(FAMILY_CONFIGS), indirect=True)
def test_family_with_an_adapter_on_every_projection_matches_peft(family_engine) -> None:
    engine, peft, adapter_dir = family_engine
    assignment = [str(adapter_dir), None, str(adapter_dir)]
    params = SamplingParams(max_new_tokens=5, decoder_input_details=True, details=True, ignore_eos_token=True)
    outputs = engine.generate(PROMPTS, params, adapters=assignment)
    differs = 0
    with torch.no_grad():
        for output, adapter in zip(outputs, assignment):
            ids = torch.tensor([output.prompt_token_ids + output.token_ids])
            if adapter is None:
                with peft.disable_adapter():
                    logits = peft(ids).logits[0]
            else:
                logits = peft(ids).logits[0]
                with peft.disable_adapter():
                    differs += int(not torch.allclose(peft(ids).logits[0], logits, atol=1e-2))
            logprobs = torch.log_softmax(logits, dim=-1)
            num_prompt = len(output.prompt_token_ids)
            assert output.token_ids == logprobs[num_prompt - 1 : -1].argmax(-1).tolist()
            expected = [logprobs[num_prompt - 1 + i, t].item() for i, t in enumerate(output.token_ids)]
            assert [t.logprob for t in output.tokens] == pytest.approx(expected, abs=ATOL)
            expected_prompt = [logprobs[i, t].item() for i, t in enumerate(output.prompt_token_ids[1:])]
            assert [p.logprob for p in output.prefill][1:] == pytest.approx(expected_prompt, abs=ATOL)
    assert differs == 2, "the adapter must change the logits for this test to mean anything"


def test_a_fused_adapter_on_a_family_without_fused_modules_is_refused_by_name(tmp_path) -> None:
    """Phi-3's qkv_proj adapter given to a Qwen3 model: refused, naming the module."""
    phi3 = save_tiny_model("phi3", tmp_path / "phi3")
    adapter_dir = save_adapter(peft_model(phi3, LoraConfig(r=4, target_modules=["qkv_proj"]), seed=1), tmp_path / "a")
    save_tiny_model("qwen3", tmp_path / "qwen3")
    AutoTokenizer.from_pretrained(ensure_embedded_model()).save_pretrained(tmp_path / "qwen3")
    engine = Engine.from_config(EngineConfig(model=str(tmp_path / "qwen3"), dtype="float32"))
    output = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2), adapters=[str(adapter_dir)])[0]
    assert isinstance(output.error, AdapterIncompatibleError) and "qkv_proj" in str(output.error)
