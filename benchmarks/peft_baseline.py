"""The adapter side of `benchmarks.engine --adapters N`: random PEFT adapters for the embedded model
(ranks 8-64 on the chosen target modules) and PEFT's mixed-adapter batched `generate` as the baseline."""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from benchmarks.timing import Timer

RANKS = (8, 16, 32, 64)


def make_random_adapters(model_dir: Path, root: Path, count: int, targets: str, b_std: float = 0.01) -> list[Path]:
    """`count` PEFT LoRA adapters with B factors ~N(0, b_std) on `targets` (comma-separated module
    names or `all-linear`), saved under `root` (reused if present)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = [root / f"{targets.replace(',', '-')}-{i}-r{RANKS[i % len(RANKS)]}" for i in range(count)]
    if all((path / "adapter_config.json").is_file() for path in paths):
        return paths
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for i, path in enumerate(paths):
        rank = RANKS[i % len(RANKS)]
        target_modules = targets if targets == "all-linear" else targets.split(",")
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=target_modules)
        model = get_peft_model(copy.deepcopy(base), config)
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * b_std)
        model.save_pretrained(str(path), save_embedding_layers=False)
    return paths


def run_peft(model_dir: Path, adapter_paths: list[Path], prompts: list[list[int]], adapter_of: list[int],
             new_tokens: int, dtype: torch.dtype, pad_id: int, device: str = "cpu") -> dict:
    """PEFT's mixed-adapter batch: one `generate` with `adapter_names` naming each row's adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = PeftModel.from_pretrained(base, str(adapter_paths[0]), adapter_name="a0")
    for i, path in enumerate(adapter_paths[1:], start=1):
        model.load_adapter(str(path), adapter_name=f"a{i}")
    model = model.to(device, dtype).eval()
    input_ids, attention_mask = left_padded(prompts, pad_id, device)
    names = [f"a{i}" for i in adapter_of]
    with torch.inference_mode():
        with Timer() as timer:
            out = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, adapter_names=names,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id,
            )
            out = out.cpu()  # the clock stops with the tokens on the host, as ours does
    return timer.report((out.shape[1] - input_ids.shape[1]) * out.shape[0])


def left_padded(prompts: list[list[int]], pad_id: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [num_prompts, longest] of the prompts padded on the left, as HF's
    batched `generate` takes them."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return input_ids, attention_mask
