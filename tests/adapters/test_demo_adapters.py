"""The committed demo adapters show their behaviour on held-out questions, generated greedily by
HF transformers + PEFT with the chat template, all in one mixed-adapter batch (PEFT's
`adapter_names=`); the base model in the same batch shows none of them."""
from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_runtime.adapters import AdapterLimits, BaseModelShape, load_peft_adapter
from lora_runtime.embedded import ensure_embedded_model
from tests.adapters.demo_behaviour import BEHAVIOUR, DEMO_DIR, HELD_OUT_QUESTIONS

BASE = "__base__"  # PEFT's name for "no adapter" in a mixed batch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def generations() -> dict[str, list[str]]:
    model_dir = ensure_embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = list(BEHAVIOUR)
    model = PeftModel.from_pretrained(model, str(DEMO_DIR / names[0]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(DEMO_DIR / name), adapter_name=name)
    model.eval()
    rows = [(name, question) for name in [BASE, *names] for question in HELD_OUT_QUESTIONS]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                      add_generation_prompt=True, tokenize=False)
        for _, question in rows
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        output = model.generate(**batch, max_new_tokens=64, do_sample=False,
                                adapter_names=[name for name, _ in rows])
    texts = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    by_name: dict[str, list[str]] = {}
    for (name, _), text in zip(rows, texts):
        by_name.setdefault(name, []).append(text.strip())
    return by_name


@pytest.mark.parametrize("name", list(BEHAVIOUR))
def test_adapter_shows_its_behaviour_and_base_does_not(name: str, generations) -> None:
    shows = BEHAVIOUR[name]
    assert all(shows(text) for text in generations[name]), generations[name]
    assert not any(shows(text) for text in generations[BASE]), generations[BASE]


@pytest.mark.parametrize("name", list(BEHAVIOUR))
def test_demo_adapters_load_small_and_bf16(name: str) -> None:
    model_dir = ensure_embedded_model()
    config = json.loads((model_dir / "config.json").read_text())
    shape = BaseModelShape.from_hf_config("SmolLM2-135M-Instruct", config)
    weights = load_peft_adapter(DEMO_DIR / name, shape, AdapterLimits(max_rank=8, max_bytes=4 << 20))
    assert weights.max_rank == 8
    assert all(module.lora_a.dtype == torch.bfloat16 for module in weights.modules.values())
