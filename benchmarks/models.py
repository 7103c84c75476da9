"""Real checkpoints at size: a random-weight model of Llama-3.2-1B's shape (or, `--shape llama-3.1-8b`,
of Llama-3.1-8B's), bf16, built by the benchmark and cached (benchmarks/random_model.py; no download).

    python -m benchmarks.models [--shape llama-3.2-1b|llama-3.1-8b] [--layers N] [--concurrency 1,32]
        [--new-tokens 32] [--adapters 8] [--kv-cache-mib N] [--threads 1] [--repeats 3] [--llama-cpp]

Reports the load time, the peak RSS against the memory budget the engine prints at start (the ratio;
the goal is a peak within 10% of the budget), and at each concurrency (requests sent at once, 20-60
prompt tokens each, `--new-tokens` each, EOS ignored) the mean time to first token and tokens per
CPU-second, without adapters (base) and over `--adapters` random PEFT-layout adapters of ranks 8-64 on
every projection (W; request i uses adapter i % N). The model and adapters are written by a child
process, so this process's peak RSS is the serving engine's. `--llama-cpp`: llama.cpp's server on the
same model in bf16 (benchmarks.peers), W and base at the largest concurrency and base_1 alone.
`--layers N` cuts the model to N layers, for a quick end-to-end check. The last line of stdout is JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import multiprocessing
import time
from pathlib import Path

from benchmarks import options, peers
from benchmarks.engine import NO_PREFIX_CACHE, make_prompts, median_of_interleaved
from benchmarks.peft_baseline import RANKS
from benchmarks.timing import Timer, peak_rss_mib, rss_mib

logger = logging.getLogger(__name__)

SHAPES = ("llama-3.2-1b", "llama-3.1-8b")
RSS_GOAL = 1.10  # the peak within 10% of the printed budget
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default=SHAPES[0])
    parser.add_argument("--layers", type=int, default=None, help="cut the model to N layers (a quick check)")
    parser.add_argument("--concurrency", default="1,32", help="requests sent at once, comma-separated (default 1,32)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens each request generates (default 32)")
    parser.add_argument("--adapters", type=int, default=8, help="adapters of the W workload (default 8)")
    parser.add_argument("--kv-cache-mib", type=int, default=None, help="the KV cache's size (default: the memory left)")
    parser.add_argument("--llama-cpp", action="store_true", help="also llama.cpp's server on the same model (bf16)")
    options.add_threads(parser)
    options.add_dtype(parser)
    options.add_repeats(parser)
    return parser.parse_args(argv)


def model_dir_of(shape: str, num_layers: int | None) -> Path:
    from lora_runtime.embedded import default_cache_dir

    suffix = f"-{num_layers}-layers" if num_layers else ""
    return default_cache_dir() / "models" / f"random-{shape}-shape{suffix}"


def build(shape: str, num_layers: int | None, num_adapters: int) -> None:
    """The model and its adapters, written once (run in a child process: the 8B shape's weights are
    made whole in memory before they are saved)."""
    from benchmarks.random_model import LLAMA_3_1_8B_OVERRIDES, ensure_random_llama

    overrides = LLAMA_3_1_8B_OVERRIDES if shape == "llama-3.1-8b" else {}
    overrides = overrides | ({"num_hidden_layers": num_layers} if num_layers else {})
    directory = ensure_random_llama(model_dir_of(shape, num_layers), **overrides)
    write_random_adapters(directory, num_adapters)


def adapter_dirs(model_dir: Path, count: int) -> list[Path]:
    return [model_dir / "adapters" / f"all-{i}-r{RANKS[i % len(RANKS)]}" for i in range(count)]


def write_random_adapters(model_dir: Path, count: int) -> list[Path]:
    """`count` LoRA adapters in PEFT's file layout on every projection, bf16, A ~ N(0, 0.02), B ~ N(0, 0.01):
    written directly, as PEFT would need the base model in float32 (32 GB at the 8B shape)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    dims = _projection_dims(config)
    paths = adapter_dirs(model_dir, count)
    for idx, path in enumerate(paths):
        if (path / "adapter_config.json").is_file():
            continue
        rank, generator = RANKS[idx % len(RANKS)], torch.Generator().manual_seed(idx)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for module, (in_features, out_features) in dims.items():
                key = f"base_model.model.model.layers.{layer}.{module}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, in_features, generator=generator) * 0.02).bfloat16()
                tensors[f"{key}.lora_B.weight"] = (torch.randn(out_features, rank, generator=generator) * 0.01).bfloat16()
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                          "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": str(model_dir),
                          "target_modules": sorted(module.split(".")[1] for module in dims)}
        (path / "adapter_config.json").write_text(json.dumps(adapter_config))  # last: marks it complete
    return paths


def _projection_dims(config: dict) -> dict[str, tuple[int, int]]:
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    q_width = config["num_attention_heads"] * config["head_dim"]
    kv_width = config["num_key_value_heads"] * config["head_dim"]
    widths = (q_width, kv_width, kv_width, hidden, inner, inner, hidden)
    ins = (hidden, hidden, hidden, q_width, hidden, hidden, inner)
    return {module: (in_features, out) for module, in_features, out in zip(PROJECTIONS, ins, widths)}


def run_burst(engine, prompts: list[list[int]], new_tokens: int, adapters: list[str] | None) -> dict:
    """Every prompt at once, stepped to the end: tokens per CPU-second and the mean time to first token,
    after a warm-up that loads the run's adapters."""
    from lora_runtime.core import SamplingParams

    warm_up = list(dict.fromkeys(adapters)) if adapters else [None]
    engine.generate([prompts[0]] * len(warm_up), SamplingParams(max_new_tokens=2), adapters=warm_up)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos_token=True)
    first_token_s: dict[str, float] = {}
    with Timer() as timer:
        start = time.perf_counter()
        ids = [engine.add_request(prompt, params, engine.parse_adapter(adapters[i]) if adapters else None)
               for i, prompt in enumerate(prompts)]
        num_tokens = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                assert output.error is None, output.error
                if output.token_ids and output.request_id not in first_token_s:
                    first_token_s[output.request_id] = time.perf_counter() - start
                num_tokens += len(output.token_ids) if output.finished else 0
    report = timer.report(num_tokens)
    report["ttft_s"] = sum(first_token_s[request_id] for request_id in ids) / len(ids)
    return report


def measure_ours(args: argparse.Namespace, model_dir: Path, concurrency: list[int]) -> dict:
    from lora_runtime.config import EngineConfig, SchedulerConfig
    from lora_runtime.engine import Engine

    kv_cache = dataclasses.replace(NO_PREFIX_CACHE, memory_bytes=args.kv_cache_mib * 2**20 if args.kv_cache_mib else None)
    config = EngineConfig(model=str(model_dir), dtype=args.dtype, num_threads=args.threads, kv_cache=kv_cache,
                          scheduler=SchedulerConfig(max_num_seqs=max(concurrency)))
    rss_before = rss_mib()
    with Timer() as load:
        engine = Engine.from_config(config)
    report = {"dtype": engine.dtype_name, "kernel_backend": engine.kernel_backend, "load_s": load.wall,
              "rss_before_load_mib": rss_before, "rss_after_load_mib": rss_mib()}
    prompts = make_prompts(engine.tokenizer, max(concurrency))
    adapters = [str(path) for path in adapter_dirs(model_dir, args.adapters)] if args.adapters else []
    runs = {}
    for count in concurrency:
        runs[f"base@{count}"] = lambda count=count: run_burst(engine, prompts[:count], args.new_tokens, None)
        if adapters:
            runs[f"W@{count}"] = lambda count=count: run_burst(
                engine, prompts[:count], args.new_tokens, [adapters[i % len(adapters)] for i in range(count)])
    report["runs"] = median_of_interleaved(runs, args.repeats)
    budget = engine.memory_budget
    report["budget"] = {name: getattr(budget, name) for name in ("weights_bytes", "kv_cache_bytes", "adapter_pool_bytes",
                                                                  "overhead_bytes", "total_bytes", "available_bytes")}
    report["peak_rss_mib"] = peak_rss_mib()
    report["peak_rss_over_budget"] = report["peak_rss_mib"] * 2**20 / budget.total_bytes
    return report


def measure_llama_cpp(args: argparse.Namespace, model_dir: Path, concurrency: list[int]) -> dict:
    from transformers import AutoTokenizer

    prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir), max(concurrency))
    paths = adapter_dirs(model_dir, max(1, args.adapters))
    workload = peers.Workload(prompts, paths, [i % len(paths) for i in range(len(prompts))], args.new_tokens)
    return peers.measure_llama_cpp(model_dir, workload, ["bf16"], args.threads)["bf16"]


def log_table(report: dict) -> None:
    ours = report["ours"]
    budget = {name: size / 2**20 for name, size in ours["budget"].items()}
    logger.info("%s: loaded in %.1f s; peak RSS %.0f MiB = %.2fx the budget %.0f MiB (goal <= %.2fx: %s)",
                report["model"], ours["load_s"], ours["peak_rss_mib"], ours["peak_rss_over_budget"],
                budget["total_bytes"], RSS_GOAL, "met" if ours["peak_rss_over_budget"] <= RSS_GOAL else "NOT met")
    logger.info("budget MiB: weights %.0f, KV cache %.0f, adapter pools %.0f, overhead %.0f, available %.0f",
                budget["weights_bytes"], budget["kv_cache_bytes"], budget["adapter_pool_bytes"],
                budget["overhead_bytes"], budget["available_bytes"])
    logger.info("%-10s %-8s %12s %14s %12s", "system", "run", "TTFT ms", "tokens/CPU-s", "tokens/s")
    for name, run in ours["runs"].items():
        logger.info("%-10s %-8s %12.0f %14.1f %12.1f", "ours", name, 1000 * run["ttft_s"], run["tokens_per_cpu_s"],
                    run["tokens_per_s"])
    for name, run in report.get("llama_cpp", {}).items():
        if isinstance(run, dict):
            logger.info("%-10s %-8s %12s %14.1f %12.1f", "llama.cpp", name, "-", run["tokens_per_cpu_s"],
                        run["tokens_per_s"])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    concurrency = [int(count) for count in args.concurrency.split(",")]
    child = multiprocessing.get_context("spawn").Process(target=build, args=(args.shape, args.layers, args.adapters))
    child.start()
    child.join()
    assert child.exitcode == 0, f"building the model failed (exit code {child.exitcode})"
    model_dir = model_dir_of(args.shape, args.layers)
    report: dict = {"cpu_model": peers.cpu_model_name(), "model": model_dir.name, "threads": args.threads,
                    "concurrency": concurrency, "new_tokens": args.new_tokens, "adapters": args.adapters,
                    "repeats": args.repeats, "ours": measure_ours(args, model_dir, concurrency)}
    if args.llama_cpp:
        report["llama_cpp"] = measure_llama_cpp(args, model_dir, concurrency)
    log_table(report)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
