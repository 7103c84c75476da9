"""A tiny random Llama saved as a checkpoint, PEFT adapters on it, and our engine over the same files.
The embedded tokenizer stands in for the tiny model's (its first ids decode fine); prompts are ids."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel
from transformers import AutoTokenizer

import kernels
from lora_runtime import Engine, EngineConfig
from lora_runtime.adapters.refs import AdapterSource
from lora_runtime.config import AdapterConfig, SchedulerConfig
from lora_runtime.embedded import ensure_embedded_model
from lora_runtime.loader import load_model
from tests.adapters.peft_factory import TINY_NAME, peft_model, save_adapter, tiny_llama

ADAPTER_CONFIGS = {
    "q_v_r8": LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all_linear_r4": LoraConfig(r=4, lora_alpha=32, target_modules="all-linear"),
    "rslora_r16": LoraConfig(r=16, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "o_proj", "down_proj"]),
    "patterns": LoraConfig(
        r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "up_proj", "gate_proj"],
        rank_pattern={"layers.1.self_attn.q_proj": 2, "up_proj": 12}, alpha_pattern={"k_proj": 3},
    ),
    "layer1_only": LoraConfig(r=6, lora_alpha=12, target_modules=["v_proj", "down_proj"], layers_to_transform=[1]),
    # Same rank as q_v_r8 with overlapping targets: mergeable with it (PEFT needs equal ranks).
    "q_o_up_r8": LoraConfig(r=8, lora_alpha=4, target_modules=["q_proj", "o_proj", "up_proj"]),
}


@pytest.fixture(scope="package")
def tiny_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(seed=3).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="package")
def hf_base(tiny_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="package")
def adapter_dirs(hf_base, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    dirs = {}
    for seed, (name, config) in enumerate(ADAPTER_CONFIGS.items()):
        dirs[name] = save_adapter(peft_model(hf_base, config, seed=seed + 10), root / name)
    return dirs


@pytest.fixture(scope="package")
def peft_models(hf_base, adapter_dirs) -> dict[str, PeftModel]:
    """One PeftModel per adapter, loaded back from disk (the same files our engine reads)."""
    return {
        name: PeftModel.from_pretrained(copy.deepcopy(hf_base), str(path)).eval() for name, path in adapter_dirs.items()
    }


def make_engine(tiny_dir: Path, adapters: AdapterConfig = AdapterConfig(), scheduler: SchedulerConfig = SchedulerConfig(),
                backend: str | None = None, sources: dict[str, AdapterSource] | None = None) -> Engine:
    """Our engine on the tiny model in float32, on the device's backend or the one named."""
    config = EngineConfig(model=str(tiny_dir), dtype="float32", kernel_backend=backend, adapters=adapters,
                          scheduler=scheduler)
    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_model())
    model = load_model(tiny_dir, "float32", "cpu", kernels.backend_for("cpu", backend))
    return Engine(config, model, tokenizer, TINY_NAME, sources)
