"""Small factories for adapter tests: a tiny random HF Llama and PEFT LoRA adapters on it, with
non-zero random B factors (PEFT initialises B to zero, which would make every check trivial)."""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from lora_runtime.adapters import BaseModelShape

# GQA with q (64) wider than k/v (32), and an MLP width (96) unlike hidden (64).
TINY_LLAMA = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
)
TINY_NAME = "tiny-random-llama"


def tiny_llama(seed: int = 0, **overrides: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA, **overrides})
    config.name_or_path = TINY_NAME
    return LlamaForCausalLM(config).eval()


def tiny_shape(**overrides: int) -> BaseModelShape:
    return BaseModelShape.from_hf_config(TINY_NAME, {**TINY_LLAMA, **overrides})


def randomize_lora(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def peft_model(base: LlamaForCausalLM, config: LoraConfig, seed: int, name: str = "default") -> PeftModel:
    """A PeftModel on a copy of `base` with one randomized adapter called `name`."""
    model = get_peft_model(copy.deepcopy(base), config, adapter_name=name)
    randomize_lora(model, seed)
    return model


def save_adapter(model: PeftModel, directory: Path, name: str = "default") -> Path:
    """Save adapter `name` as a plain PEFT directory and return its path."""
    # save_embedding_layers=False: "auto" would look the base model up on the hub.
    model.save_pretrained(str(directory), selected_adapters=[name], save_embedding_layers=False)
    return directory if name == "default" else directory / name


def save_adapters(model: PeftModel, root: Path, names: list[str]) -> list[Path]:
    """Save each named adapter of one PeftModel as a PEFT directory `root/name` (PEFT's config and
    its state-dict key names, the adapter name dropped). `save_pretrained` walks the whole model
    once per adapter, which for hundreds of adapters costs minutes; this walks it once."""
    tensors: dict[str, dict[str, torch.Tensor]] = {name: {} for name in names}
    for key, value in model.state_dict().items():
        for part in (".lora_A.", ".lora_B."):
            if part in key:
                head, tail = key.split(part)
                name, rest = tail.split(".", 1)
                if name in tensors:
                    tensors[name][f"{head}{part}{rest}"] = value.contiguous()
    directories = []
    for name in names:
        directory = root / name
        directory.mkdir(parents=True)
        model.peft_config[name].save_pretrained(str(directory))
        save_file(tensors[name], str(directory / "adapter_model.safetensors"))
        directories.append(directory)
    return directories
