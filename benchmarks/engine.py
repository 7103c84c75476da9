"""Engine throughput against HF transformers (or PEFT, with adapters), measured in the same run.

    python -m benchmarks.engine [--threads 1] [--num-requests 64] [--new-tokens 64] [--adapters N]
                                [--device cuda] [--baselines hf,peft] [--model-dir DIR]

64 requests of ~20-60 prompt tokens, 64 new tokens each, greedy, EOS ignored, on the embedded model
in the engine's default dtype ("auto": bf16 where the CPU multiplies it natively, else float32;
`--dtype` picks one), the baselines in the same dtype. Without `--adapters`: ours against HF's batched `generate`. With `--adapters N`: the requests
are spread over N random adapters (ranks 8-64; `--targets`, default PEFT's default for Llama, q_proj and
v_proj; `all-linear` for every projection) and run against PEFT's mixed-
adapter batched `generate` (`adapter_names=`), and against our own base-model run (LoRA overhead).
Our engine runs `--repeats` times per configuration, interleaved, and its median run is reported (the
baseline, much slower, runs once). Prints tokens per CPU-second and per wall second, ratios on CPU
time, peak RSS, and the base model's floor on this machine for the workload (`benchmarks.roofline`:
weights and KV read once per step, prefill at the matmul peak, both rates measured in this run), and
where the issues' goals (5x HF, 10x PEFT) stand against that floor; the last line is one JSON object.

`--device cuda` runs our engine and the baselines on the GPU, each timed to its last token on the
host; there the CPU time says nothing of the work, so runs are ranked and ratios taken on wall time,
and the floor (a CPU measurement) is left out. `--baselines hf,peft` runs both baselines whatever
`--adapters` is (default: HF without adapters, PEFT with). `--model-dir` runs another checkpoint of
the same family instead of the embedded model.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
from pathlib import Path
from typing import Callable

import torch

from benchmarks import options
from benchmarks.peft_baseline import left_padded, make_random_adapters, run_peft
from benchmarks.roofline import workload_floor
from benchmarks.timing import Timer, peak_rss_mib
from kernels import cpu_ops
from lora_runtime import Engine, EngineConfig, SamplingParams
from lora_runtime.config import KVCacheConfig, SchedulerConfig
from lora_runtime.embedded import default_cache_dir, ensure_embedded_model

logger = logging.getLogger("benchmarks.engine")
# The throughput benchmarks run the same prompts again and again (repeats, interleaved systems): the
# prefix cache would serve later runs from earlier ones, so they measure with it off
# (`benchmarks.prefix` measures the cache).
NO_PREFIX_CACHE = KVCacheConfig(enable_prefix_caching=False)

# The throughput goals of the engine issues, as multiples of the baseline measured in the same run.
GOAL_VS_HF = 5.0
GOAL_VS_PEFT = 10.0

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
        prompts.append(tokenizer("Tell a story about " + " ".join(words))["input_ids"][:target])
    return prompts


def run_ours(engine: Engine, prompts: list[list[int]], new_tokens: int, adapters=None) -> dict:
    """One timed `generate`, after a warm-up that loads every adapter of the run (PEFT and llama.cpp
    load theirs before their clocks start too)."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos_token=True)
    warm_up = list(dict.fromkeys(adapters)) if adapters else [None, None]
    engine.generate([prompts[i % len(prompts)] for i in range(len(warm_up))], SamplingParams(max_new_tokens=2),
                    adapters=warm_up)
    with Timer() as timer:
        outputs = engine.generate(prompts, params, adapters=adapters)
    assert all(o.error is None for o in outputs), [o.error for o in outputs if o.error]
    return timer.report(sum(len(o.token_ids) for o in outputs))


def run_hf(model_dir: Path, prompts: list[list[int]], new_tokens: int, dtype: torch.dtype, pad_id: int,
           device: str = "cpu") -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    input_ids, attention_mask = left_padded(prompts, pad_id, device)
    with torch.inference_mode():
        with Timer() as timer:
            out = model.generate(
                input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, pad_token_id=pad_id,
            )
            out = out.cpu()  # the clock stops with the tokens on the host, as ours does
    return timer.report((out.shape[1] - input_ids.shape[1]) * out.shape[0])


def median_of_interleaved(runs: dict[str, Callable[[], dict]], repeats: int, rate: str = "tokens_per_cpu_s") -> dict[str, dict]:
    """Each of `runs` `repeats` times, interleaved round by round (so a noisy spell on the shared
    machine hits every configuration alike); per run name, the run of median `rate`, with every
    run's rate kept under "all_<rate>"."""
    results: dict[str, list[dict]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            results[name].append(run())
    chosen = {}
    for name, figures in results.items():
        ranked = sorted(figures, key=lambda f: f[rate])
        chosen[name] = ranked[len(ranked) // 2] | {f"all_{rate}": [f[rate] for f in figures]}
    return chosen



def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_threads(parser)
    options.add_dtype(parser)
    parser.add_argument("--form", default=None,
                        help="compiled CPU ops form to run (default: the best this CPU runs), e.g. avx2 to see an AVX2 machine's kernels")
    options.add_workload(parser)
    parser.add_argument("--adapters", type=int, default=0, help="spread requests over N random adapters")
    parser.add_argument("--targets", default="q_proj,v_proj", help="adapter target modules, or all-linear")
    parser.add_argument("--skip-baseline", action="store_true", help="measure our engine only")
    options.add_repeats(parser)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (our engine and the baselines)")
    parser.add_argument("--baselines", default=None,
                        help="comma-separated: hf, peft (default: hf without --adapters, peft with)")
    parser.add_argument("--model-dir", type=Path, default=None, help="a checkpoint to run instead of the embedded model")
    return parser.parse_args(argv)


def baselines_of(args: argparse.Namespace) -> set[str]:
    """The baselines this run measures."""
    if args.skip_baseline:
        return set()
    if args.baselines is not None:
        return set(filter(None, args.baselines.split(",")))
    return {"peft"} if args.adapters else {"hf"}


def _log(name: str, figures: dict) -> None:
    logger.info("%s: %.1f tokens/CPU-s, %.1f tokens/s wall", name, figures["tokens_per_cpu_s"], figures["tokens_per_s"])


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    if args.form is None:
        return run(args)
    with cpu_ops.using_form(args.form):
        return run(args)


def run(args: argparse.Namespace) -> dict:
    # The embedded model's Hugging Face directory, not the default (its GGUF, served quantized): ours and
    # the baselines load the same weights in the same dtype.
    model_dir = args.model_dir or ensure_embedded_model()
    config = EngineConfig(model=str(model_dir), dtype=args.dtype, device=args.device,
                          scheduler=SchedulerConfig(max_num_seqs=args.num_requests), kv_cache=NO_PREFIX_CACHE,
                          num_threads=args.threads)
    engine = Engine.from_config(config)
    prompts = make_prompts(engine.tokenizer, args.num_requests)
    pad_id = engine.tokenizer.eos_token_id
    dtype = engine.model.dtype
    on_gpu = torch.device(args.device).type == "cuda"
    rate = "tokens_per_s" if on_gpu else "tokens_per_cpu_s"
    report: dict = {"threads": args.threads, "dtype": engine.dtype_name, "kernel_backend": engine.kernel_backend,
                    "device": args.device, "rate": rate, "num_requests": args.num_requests,
                    "new_tokens": args.new_tokens, "adapters": args.adapters, "targets": args.targets}
    runs = {"ours": lambda: run_ours(engine, prompts, args.new_tokens)}
    if args.adapters:
        adapter_root = default_cache_dir() / "bench-adapters" / (args.model_dir.name if args.model_dir else "")
        paths = make_random_adapters(model_dir, adapter_root, args.adapters, args.targets)
        adapter_of = [i % args.adapters for i in range(args.num_requests)]
        adapters = [str(paths[i]) for i in adapter_of]
        report.update(adapter_paths=[str(p) for p in paths], adapter_of=adapter_of)
        runs["ours_adapters"] = lambda: run_ours(engine, prompts, args.new_tokens, adapters)
    report.update(median_of_interleaved(runs, args.repeats, rate))
    ours = report["ours"]
    _log("ours, base model", ours)
    if args.adapters:
        mixed = report["ours_adapters"]
        report["lora_overhead"] = ours[rate] / mixed[rate] - 1
        _log(f"ours, {args.adapters} adapters", mixed)
        logger.info("LoRA overhead against our base model: %+.0f%%", 100 * report["lora_overhead"])
    report.update(run_baselines(args, model_dir, prompts, dtype, pad_id, report))
    report["peak_rss_mib"] = peak_rss_mib()  # before the floor's measurements, which allocate 512 MiB
    if not on_gpu:  # the floor is a CPU measurement
        report.update(floor_figures(engine, [len(p) for p in prompts], args.new_tokens, report))
    print(json.dumps(report))
    return report


def floor_figures(engine: Engine, prompt_lens: list[int], new_tokens: int, report: dict) -> dict:
    """The base model's floor on this CPU for the workload, ours against it, and the goal against it."""
    ours = report["ours"]
    figures: dict = {"floor": (floor := workload_floor(engine.model, prompt_lens, new_tokens))}
    figures["ours_of_floor"] = ours["tokens_per_cpu_s"] / floor["tokens_per_s"]
    logger.info("floor of the base model on this machine: %.0f tokens/s (%.0f MB of weights per step at %.1f GB/s, "
                "matmuls at %.0f GFLOP/s, the library's rate at prefill shape); ours, base model: %.0f%% of it",
                floor["tokens_per_s"], floor["weight_mb_per_step"], floor["read_gb_per_s"], floor["matmul_gflop_per_s"],
                100 * figures["ours_of_floor"])
    if floor["instruction_tokens_per_s"] is not None:
        figures["ours_of_instruction_floor"] = ours["tokens_per_cpu_s"] / floor["instruction_tokens_per_s"]
        logger.info("floor at the %s instruction peak (%.0f GFLOP/s): %.0f tokens/s; ours, base model: %.0f%% of it",
                    engine.dtype_name, floor["instruction_gflop_per_s"], floor["instruction_tokens_per_s"],
                    100 * figures["ours_of_instruction_floor"])
    figures.update(_goal_against_floor(report, floor))
    return figures

def run_baselines(args: argparse.Namespace, model_dir: Path, prompts: list[list[int]], dtype: torch.dtype,
                  pad_id: int, report: dict) -> dict:
    """The baselines' figures and our ratios to them (`report` holds our runs)."""
    rate, clock = report["rate"], "wall time" if report["rate"] == "tokens_per_s" else "CPU time"
    baselines, figures = baselines_of(args), {}
    if "peft" in baselines and args.adapters:
        figures["peft_generate"] = peft = run_peft(model_dir, report["adapter_paths"], prompts,
                                                   report["adapter_of"], args.new_tokens, dtype, pad_id, args.device)
        figures["ratio_vs_peft"] = report["ours_adapters"][rate] / peft[rate]
        _log("PEFT mixed-adapter generate", peft)
        logger.info("ours / PEFT = %.2fx (%s)", figures["ratio_vs_peft"], clock)
    if "hf" in baselines:
        figures["hf_generate"] = hf = run_hf(model_dir, prompts, args.new_tokens, dtype, pad_id, args.device)
        figures["ratio_vs_hf"] = report["ours"][rate] / hf[rate]
        _log(f"HF generate (batch {args.num_requests})", hf)
        logger.info("ours / HF = %.2fx (%s)", figures["ratio_vs_hf"], clock)
    return figures


def _goal_against_floor(report: dict, floor: dict) -> dict:
    """The issue's goal in tokens/s and as a fraction of the highest floor measured (the base model's:
    adapters only add work, so it bounds the adapter runs too). Above 1, no engine reaches the goal
    on this machine with this model's arithmetic in this dtype."""
    if "hf_generate" in report:
        goal = GOAL_VS_HF * report["hf_generate"]["tokens_per_cpu_s"]
        name = f"{GOAL_VS_HF:g}x HF"
    elif "peft_generate" in report:
        goal = GOAL_VS_PEFT * report["peft_generate"]["tokens_per_cpu_s"]
        name = f"{GOAL_VS_PEFT:g}x PEFT"
    else:
        return {}
    best_floor = max(floor["tokens_per_s"], floor["instruction_tokens_per_s"] or 0.0)
    goal_of_floor = goal / best_floor
    verdict = "out of reach on this machine" if goal_of_floor > 1 else "within the floor"
    logger.info("goal %s = %.0f tokens/CPU-s: %.0f%% of the floor (%.0f tokens/s), %s",
                name, goal, 100 * goal_of_floor, best_floor, verdict)
    return {"goal_tokens_per_s": goal, "goal_of_floor": goal_of_floor}


if __name__ == "__main__":
    main()
