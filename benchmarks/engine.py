"""Engine throughput against HF transformers' batched `generate`, measured in the same run.

    python -m benchmarks.engine [--threads N] [--num-requests 64] [--new-tokens 64] [--dtype bfloat16]

64 requests of ~20-60 prompt tokens, 64 new tokens each, greedy, EOS ignored, on the embedded model.
Prints tokens/s of both and their ratio, and peak RSS; the last line is one JSON object.

Throughput is counted per CPU-second of this process (`time.process_time`) as well as per wall
second: on a shared machine the CPU time of a single-threaded run is the figure that repeats, so
the ratio is taken on it.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import resource
import time

import torch

from lora_runtime import Engine, EngineConfig, SamplingParams
from lora_runtime.config import SchedulerConfig

logger = logging.getLogger("benchmarks.engine")

WORDS = (
    "river mountain quiet engine lantern orbit velvet harbor signal meadow cipher falcon ember "
    "glacier puzzle copper willow thunder atlas marble canyon lyric prism beacon tundra saffron"
).split()


def make_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    """Deterministic prompts of 20-60 tokens each."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        target = rng.randint(20, 60)
        words = [rng.choice(WORDS) for _ in range(target)]
        ids = tokenizer("Tell a story about " + " ".join(words))["input_ids"][:target]
        prompts.append(ids)
    return prompts


class _Timer:
    """Wall and CPU seconds of a block."""

    def __enter__(self) -> "_Timer":
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu

    def report(self, num_tokens: int) -> dict:
        return {"tokens": num_tokens, "wall_s": self.wall, "cpu_s": self.cpu,
                "tokens_per_s": num_tokens / self.wall, "tokens_per_cpu_s": num_tokens / self.cpu}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_ours(engine: Engine, prompts: list[list[int]], new_tokens: int, adapters=None) -> dict:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos_token=True)
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=2))  # warm-up
    with _Timer() as timer:
        outputs = engine.generate(prompts, params, adapters=adapters)
    return timer.report(sum(len(o.token_ids) for o in outputs))


def run_hf(model_dir, prompts: list[list[int]], new_tokens: int, dtype: torch.dtype, pad_id: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(input_ids[:2], attention_mask=attention_mask[:2], max_new_tokens=2, do_sample=False)
        with _Timer() as timer:
            out = model.generate(
                input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, pad_token_id=pad_id,
            )
    return timer.report((out.shape[1] - width) * out.shape[0])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--skip-hf", action="store_true", help="measure our engine only")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    config = EngineConfig(dtype=args.dtype, scheduler=SchedulerConfig(max_num_seqs=args.num_requests))
    engine = Engine.from_config(config)
    prompts = make_prompts(engine.tokenizer, args.num_requests)
    ours = run_ours(engine, prompts, args.new_tokens)
    report = {"threads": args.threads, "dtype": args.dtype, "num_requests": args.num_requests,
              "new_tokens": args.new_tokens, "ours": ours, "peak_rss_mib_after_ours": peak_rss_mib()}
    logger.info("ours: %.1f tokens/CPU-s, %.1f tokens/s wall", ours["tokens_per_cpu_s"], ours["tokens_per_s"])
    if not args.skip_hf:
        from lora_runtime.embedded import ensure_embedded_model

        hf = run_hf(ensure_embedded_model(), prompts, args.new_tokens, getattr(torch, args.dtype), engine.tokenizer.eos_token_id)
        report["hf_generate"] = hf
        report["ratio_vs_hf"] = ours["tokens_per_cpu_s"] / hf["tokens_per_cpu_s"]
        logger.info("HF generate (batch %d): %.1f tokens/CPU-s, %.1f tokens/s wall; ours / HF = %.2fx (CPU time)",
                    args.num_requests, hf["tokens_per_cpu_s"], hf["tokens_per_s"], report["ratio_vs_hf"])
    report["peak_rss_mib"] = peak_rss_mib()
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
