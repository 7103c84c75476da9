"""The engine on a device against its oracles run on that same device, for `benchmarks.gpu_check`:

1. float32 greedy tokens equal to HF transformers' `generate`, each prompt alone (no padding);
2. one mixed batch over 8 adapters (every linear module, ranks 8-64) equal, request by request, to
   PEFT's `generate` with that request's adapter, and the adapters changing the base model's tokens;
3. bfloat16 greedy tokens agreeing with HF's bfloat16 `generate` on the first `BF16_PREFIX` tokens of
   every prompt (rounding differs between the two, so later tokens may part where two are near-tied;
   each prompt's agreeing length is reported).

    python -m benchmarks.engine_oracles --device cuda [--model-dir DIR] [--tiny] [--json-out FILE]

Each engine is dropped before its oracle loads: on CUDA an engine claims most of the free memory
for its KV cache (`lora_runtime.device_memory`). Exit status 0 when every check passes."""
from __future__ import annotations

import argparse
import gc
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.peft_baseline import make_random_adapters
from lora_runtime import Engine, EngineConfig, SamplingParams
from lora_runtime.embedded import default_cache_dir, ensure_embedded_model

logger = logging.getLogger("benchmarks.engine_oracles")
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis to a child.",
    "List three uses of a paperclip.",
    "Translate good morning into Spanish and explain its use.",
    "What is 17 times 23? Show your working.",
    "Give me a recipe for pancakes.",
    "Describe the colour blue to someone who cannot see.",
]
NUM_ADAPTERS = 8
ADAPTER_B_STD = 0.1  # large enough that the adapters change greedy tokens, so the check can see them
BF16_PREFIX = 4


@dataclass(frozen=True, slots=True)
class Setup:
    model_dir: Path
    device: str
    prompts: list[list[int]]
    num_new_tokens: int
    num_adapters: int
    pad_id: int


def make_setup(model_dir: Path, device: str, tiny: bool) -> Setup:
    """The prompts in the model's chat template where it has one (the stand-in has none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = QUESTIONS[:2] if tiny else QUESTIONS
    if tokenizer.chat_template:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 return_dict=True)["input_ids"] for q in questions]
    else:
        prompts = [tokenizer(question)["input_ids"] for question in questions]
    return Setup(model_dir, device, prompts, 4 if tiny else 24, 2 if tiny else NUM_ADAPTERS, tokenizer.eos_token_id)


def ours(setup: Setup, dtype: str, prompts: list[list[int]], adapters: list[str] | None = None) -> list[list[int]]:
    """Our engine's greedy tokens for all prompts in one batch; the engine is freed before returning."""
    engine = Engine.from_config(EngineConfig(model=str(setup.model_dir), dtype=dtype, device=setup.device))
    try:
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=setup.num_new_tokens), adapters=adapters)
        assert all(output.error is None for output in outputs), [output.error for output in outputs]
        return [output.token_ids for output in outputs]
    finally:
        engine.adapters.close()
        del engine
        _release(setup.device)


def greedy_alone(model, setup: Setup, prompt: list[int]) -> list[int]:
    """HF `generate`'s greedy tokens for one prompt (batch of one: no padding to alter the oracle)."""
    ids = torch.tensor([prompt], device=setup.device)
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=setup.num_new_tokens, do_sample=False, pad_token_id=setup.pad_id)
    return out[0, len(prompt):].tolist()


def hf_greedy(setup: Setup, dtype: torch.dtype) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(setup.model_dir, dtype=dtype).to(setup.device).eval()
    tokens = [greedy_alone(model, setup, prompt) for prompt in setup.prompts]
    del model
    _release(setup.device)
    return tokens


def check_greedy_fp32(setup: Setup) -> dict:
    expected, got = hf_greedy(setup, torch.float32), ours(setup, "float32", setup.prompts)
    differing = [i for i, (a, b) in enumerate(zip(got, expected)) if a != b]
    return {"pass": not differing, "prompts": len(got), "differing_prompts": differing, "ours": got, "hf": expected}


def check_adapters_vs_peft(setup: Setup) -> dict:
    """Request i on adapter i, and every prompt on the base model too, all in one batch."""
    paths = make_random_adapters(setup.model_dir, default_cache_dir() / "oracle-adapters" / setup.model_dir.name,
                                 setup.num_adapters, "all-linear", b_std=ADAPTER_B_STD)
    num_prompts = len(setup.prompts)
    prompts = [setup.prompts[i % num_prompts] for i in range(len(paths))]
    mixed = ours(setup, "float32", prompts + setup.prompts, [str(path) for path in paths] + [None] * num_prompts)
    got, base = mixed[: len(paths)], mixed[len(paths):]
    expected = peft_greedy(setup, paths, prompts)
    differing = [i for i, (a, b) in enumerate(zip(got, expected)) if a != b]
    changed = sum(tokens != base[i % num_prompts] for i, tokens in enumerate(got))
    return {"pass": not differing and changed > 0, "requests": len(got), "differing_requests": differing,
            "requests_the_adapter_changed": changed, "ours": got, "peft": expected}


def peft_greedy(setup: Setup, paths: list[Path], prompts: list[list[int]]) -> list[list[int]]:
    """PEFT's greedy tokens for request i alone, with adapter i active."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(setup.model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(paths[0]), adapter_name="a0")
    for i, path in enumerate(paths[1:], start=1):
        model.load_adapter(str(path), adapter_name=f"a{i}")
    model = model.to(setup.device).eval()
    tokens = []
    for i, prompt in enumerate(prompts):
        model.set_adapter(f"a{i}")
        tokens.append(greedy_alone(model, setup, prompt))
    del model, base
    _release(setup.device)
    return tokens


def check_bf16_prefix(setup: Setup) -> dict:
    expected, got = hf_greedy(setup, torch.bfloat16), ours(setup, "bfloat16", setup.prompts)
    agreeing = [_common_prefix(a, b) for a, b in zip(got, expected)]
    needed = [min(BF16_PREFIX, len(a), len(b)) for a, b in zip(got, expected)]
    return {"pass": all(n >= k for n, k in zip(agreeing, needed)), "prefix": BF16_PREFIX,
            "agreeing_tokens": agreeing, "ours": got, "hf": expected}


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _release(device: str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


CHECKS = {"greedy_fp32_vs_hf": check_greedy_fp32, "adapters_vs_peft": check_adapters_vs_peft,
          "bf16_prefix_vs_hf": check_bf16_prefix}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: the embedded model")
    parser.add_argument("--tiny", action="store_true", help="2 prompts, 4 new tokens (a smoke run)")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    setup = make_setup(args.model_dir or ensure_embedded_model(), args.device, args.tiny)
    report = {}
    for name, check in CHECKS.items():
        try:
            report[name] = check(setup)
        except Exception as error:  # one check's failure is reported, the others still run
            logger.exception("%s failed", name)
            report[name] = {"pass": False, "error": f"{type(error).__name__}: {error}"}
        logger.info("%s: %s", name, "pass" if report[name]["pass"] else "FAIL")
    text = json.dumps(report)
    if args.json_out:
        args.json_out.write_text(text)
    print(text)
    return 0 if all(result["pass"] for result in report.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
