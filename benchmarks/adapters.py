"""S-LoRA's sweep on the embedded model: throughput as the number of distinct adapters grows.

    python -m benchmarks.adapters [--threads 1] [--counts 1,8,64,256,1024] [--num-requests 128]
        [--new-tokens 32] [--dtype auto] [--repeats 1] [--quick]

The registry: `max(counts)` adapters on disk, ranks 8, 16, 32 and 64 in turn on every projection
(`all-linear`), made from 32 random PEFT adapters (`benchmarks.peft_baseline`): adapter j's
directory holds its own config and a hard link to template j % 32's weights, so 1024 adapters take
the disk of 32, while the engine reads, caches and places each as its own adapter (it keys adapters
by id, never by content).

For each N in `counts` and each popularity (uniform; power law, P(adapter k) proportional to
1/(k+1), as in S-LoRA), `num-requests` requests of 20-60 prompt tokens each name one of the first
N adapters, are submitted at once, and run to `new-tokens` tokens (greedy, EOS ignored) in one
batch; the base model runs the same requests without adapters, interleaved with them (see
`benchmarks.engine.median_of_interleaved`). Before each timed run its adapters are loaded into the
host cache (S-LoRA's adapters live in host memory too); writing them into device pages happens in
the timed steps. The device pool's memory is committed before the first run, as in a server whose
pool has been used once: the first touch of fresh memory is a one-time cost of the process (on the
VMs this was written on it is ~40x the cost of the copy itself), measured and printed apart.

Prints tokens per CPU-second for each N and popularity and their ratio to the base model; the
distinct adapters each run used, the adapters and pages resident after it, and the process's
memory; the floor of each ratio on this machine (a step must read each of its distinct adapters'
factors once, beside the base weights: `benchmarks.roofline` with the adapters' bytes and FLOPs
added), with those reads under the arithmetic ("floor") and after it ("serial"); and the cold-load
latency of one adapter from each source (`benchmarks.adapter_sources`).
Writes JSON and a PNG (throughput against N, log axis) to benchmarks/results/ (or `--results-dir`).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import platform
import random
from pathlib import Path

import torch

from benchmarks import options
from benchmarks.adapter_sources import cold_load_latencies
from benchmarks.engine import NO_PREFIX_CACHE, make_prompts, median_of_interleaved
from benchmarks.instruction_peak import instruction_peak
from benchmarks.peft_baseline import RANKS, make_random_adapters
from benchmarks.results_writer import RESULTS_DIR, results_stem, write_results
from benchmarks.roofline import floor_seconds, measure_rates, model_costs
from benchmarks.timing import Timer, peak_rss_mib, rss_mib
from kernels.lora.layouts import PAGE_ROWS
from lora_runtime import Engine, EngineConfig, SamplingParams
from lora_runtime.adapters.page_tensors import bytes_per_page
from lora_runtime.config import AdapterConfig, SchedulerConfig
from lora_runtime.embedded import default_cache_dir, ensure_embedded_model

logger = logging.getLogger("benchmarks.adapters")
NUM_TEMPLATES = 32
POPULARITIES = ("uniform", "power_law")
GOAL = {"num_adapters": 128, "min_ratio_to_base": 0.80}
GIB = 1024**3


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_threads(parser)
    options.add_dtype(parser)
    parser.add_argument("--counts", default="1,8,64,256,1024", help="numbers of distinct adapters to sweep")
    options.add_workload(parser)
    options.add_repeats(parser)
    parser.add_argument("--device-pool-gib", type=float, default=4.0)
    parser.add_argument("--host-cache-gib", type=float, default=6.0)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    options.add_quick(parser, "counts 1,4 from 4 templates, 8 requests, 4 tokens, a 0.25 GiB pool")
    args = parser.parse_args(argv)
    args.num_templates = NUM_TEMPLATES
    if args.quick:
        args.counts, args.num_requests, args.new_tokens, args.num_templates = "1,4", 8, 4, len(RANKS)
        args.device_pool_gib, args.host_cache_gib = 0.25, 1.0
    args.counts = [int(c) for c in args.counts.split(",")]
    return args


def make_registry(model_dir: Path, count: int, num_templates: int) -> list[Path]:
    """`count` adapter directories (see the module's docstring), made once and reused."""
    assert num_templates % len(RANKS) == 0, "adapter_rank relies on every template cycle being whole"
    templates = make_random_adapters(model_dir, default_cache_dir() / "bench-adapters", num_templates, "all-linear")
    root = templates[0].parent / f"registry-of-{num_templates}"
    paths = []
    for j in range(count):
        template, path = templates[j % num_templates], root / f"adapter-{j:04d}"
        if not (path / "adapter_config.json").is_file():
            path.mkdir(parents=True, exist_ok=True)
            weights = path / "adapter_model.safetensors"
            weights.unlink(missing_ok=True)
            os.link(template / "adapter_model.safetensors", weights)
            # The config last: its presence marks a complete directory.
            (path / "adapter_config.json").write_bytes((template / "adapter_config.json").read_bytes())
        paths.append(path)
    return paths


def commit_pool(engine: Engine) -> float:
    """Touch every page of the device pool once (see the module's docstring); its seconds."""
    with Timer() as timer:
        for a, b in engine.adapters.page_tensors.tensors.values():
            a.zero_()
            b.zero_()
    return timer.wall


def pick_adapters(count: int, num_requests: int, popularity: str, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    if popularity == "uniform":
        return [rng.randrange(count) for _ in range(num_requests)]
    return rng.choices(range(count), weights=[1 / (k + 1) for k in range(count)], k=num_requests)


def adapter_rank(index: int) -> int:
    """The rank of registry adapter `index`: its template's (`make_random_adapters` cycles through
    RANKS, and the number of templates is a multiple of their count)."""
    return RANKS[index % len(RANKS)]


def run_once(engine: Engine, prompts: list[list[int]], new_tokens: int, adapters: list[str] | None) -> dict:
    if adapters:
        leases = [engine.adapters.acquire(engine.adapters.parse(path)) for path in dict.fromkeys(adapters)]
        for lease in leases:
            lease.load.result()
            lease.release()  # stays in the host cache, which holds a run's adapters
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos_token=True)
    with Timer() as timer:
        outputs = engine.generate(prompts, params, adapters=adapters)
    assert all(o.error is None for o in outputs), [o.error for o in outputs if o.error]
    pages = engine.adapters.pages
    return timer.report(sum(len(o.token_ids) for o in outputs)) | {
        "distinct_adapters": len(set(adapters)) if adapters else 0,
        "resident_adapters": pages.num_resident,
        "pages_in_use": pages.num_pages - min(pages.num_free_pages.values()),
        "host_cache_mib": engine.adapters.host.num_bytes / 2**20,
        "rss_mib": rss_mib(),
    }


def ratio_floor(engine: Engine, prompt_lens: list[int], new_tokens: int,
                runs: dict[str, list[int]]) -> dict[str, tuple[float, float]]:
    """For each run (its requests' adapter indices), the floor of its throughput as a fraction of the
    base model's: the base weights and its distinct adapters' factors (their own ranks, in the
    pages' dtype) read once per step, its FLOPs at the higher of the matmul library's rate and the
    instruction peak (the optimistic choice, so the bound holds); first with the adapters' reads
    under the arithmetic, then after it (what one core reaches when its prefetches cannot overlap
    the reads with the matmuls: measured on an Intel Xeon, docs/benchmarks.md)."""
    model = engine.model
    rates = measure_rates(model.shape.hidden_size, model.shape.intermediate_size, model.dtype)
    peak = instruction_peak(str(model.dtype).removeprefix("torch."))
    if peak is not None and peak > rates.matmul_flops_per_s:
        rates = dataclasses.replace(rates, matmul_flops_per_s=peak)
    logger.info("the floors: reads at %.1f GB/s, matmuls at %.0f GFLOP/s", rates.read_bytes_per_s / 1e9,
                rates.matmul_flops_per_s / 1e9)
    costs = model_costs(model)
    base_s = floor_seconds(costs, rates, prompt_lens, new_tokens)
    pages_dtype = engine.adapters.page_tensors.layout.dtype
    rank_params = bytes_per_page(engine.adapters.base_shape, pages_dtype) // (PAGE_ROWS * pages_dtype.itemsize)
    floors = {}
    for name, indices in runs.items():
        distinct = set(indices)
        adapter_bytes = sum(adapter_rank(i) for i in distinct) * rank_params * pages_dtype.itemsize
        params_per_token = sum(adapter_rank(i) for i in indices) / len(indices) * rank_params
        with_flops = dataclasses.replace(costs, layer_params=costs.layer_params + int(params_per_token))
        with_adapters = dataclasses.replace(with_flops, weight_bytes=costs.weight_bytes + adapter_bytes)
        floors[name] = (base_s / floor_seconds(with_adapters, rates, prompt_lens, new_tokens),
                        base_s / floor_seconds(with_flops, rates, prompt_lens, new_tokens, serial_bytes=adapter_bytes))
    return floors


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    model_dir = ensure_embedded_model()
    rss_before_registry = rss_mib()
    registry = make_registry(model_dir, max(args.counts), args.num_templates)
    config = EngineConfig(
        model=str(model_dir), dtype=args.dtype, scheduler=SchedulerConfig(max_num_seqs=args.num_requests), kv_cache=NO_PREFIX_CACHE,
        num_threads=args.threads,
        adapters=AdapterConfig(device_pool_bytes=int(args.device_pool_gib * GIB), host_cache_bytes=int(args.host_cache_gib * GIB)),
    )
    engine = Engine.from_config(config)
    commit_s = commit_pool(engine)
    prompts = make_prompts(engine.tokenizer, args.num_requests)
    picks = {f"{popularity}-{count}": pick_adapters(count, args.num_requests, popularity)
             for count in args.counts for popularity in POPULARITIES if not (count == 1 and popularity == "power_law")}
    runs = {"base": lambda: run_once(engine, prompts, args.new_tokens, None)}
    for name, indices in picks.items():
        runs[name] = lambda indices=indices: run_once(engine, prompts, args.new_tokens, [str(registry[i]) for i in indices])
    results = median_of_interleaved(runs, args.repeats)
    floors = ratio_floor(engine, [len(p) for p in prompts], args.new_tokens, picks)
    base = results["base"]["tokens_per_cpu_s"]
    rows = []
    for name, indices in picks.items():
        popularity, count = name.rsplit("-", 1)
        figures = results[name]
        rows.append({"popularity": popularity, "num_adapters": int(count), "ratio_to_base": figures["tokens_per_cpu_s"] / base,
                     "floor_ratio": floors[name][0], "serial_floor_ratio": floors[name][1], **figures})
    report = {
        "environment": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                        "dtype": engine.dtype_name, "kernel_backend": engine.kernel_backend, "torch": torch.__version__},
        "workload": {"num_requests": args.num_requests, "new_tokens": args.new_tokens, "ranks": list(RANKS),
                     "targets": "all-linear", "registered_adapters": len(registry)},
        "base": base_figures(results["base"]), "rows": rows,
        "registry_rss_mib": rss_before_registry, "peak_rss_mib": peak_rss_mib(),
        "pool_commit": {"seconds": commit_s, "gib": args.device_pool_gib},
        "cold_load": cold_load_latencies(registry[0], engine.adapters.base_shape, engine.adapters.limits,
                                         repeats=1 if args.quick else 3),
    }
    log_report(report)
    stem = results_stem("adapters", report["environment"]["dtype"], f"{args.threads}t", quick=args.quick)
    write_results(report, args.results_dir, stem, lambda path: plot(report, path))
    return report


def base_figures(figures: dict) -> dict:
    return {key: figures[key] for key in ("tokens", "cpu_s", "tokens_per_cpu_s", "tokens_per_s", "rss_mib")}


def log_report(report: dict) -> None:
    env, work = report["environment"], report["workload"]
    logger.info("%s, %d thread(s), %s, %s backend: %d requests x %d new tokens, adapters of ranks %s on every projection",
                env["cpu"], env["threads"], env["dtype"], env["kernel_backend"], work["num_requests"],
                work["new_tokens"], work["ranks"])
    logger.info("base model: %.1f tokens/CPU-s", report["base"]["tokens_per_cpu_s"])
    logger.info("%-10s %6s %9s %13s %8s %8s %8s %9s %7s %9s", "popularity", "N", "distinct", "tokens/CPU-s",
                "of base", "floor", "serial", "resident", "pages", "RSS MiB")
    for r in report["rows"]:
        logger.info("%-10s %6d %9d %13.1f %7.0f%% %7.0f%% %7.0f%% %9d %7d %9.0f", r["popularity"], r["num_adapters"],
                    r["distinct_adapters"], r["tokens_per_cpu_s"], 100 * r["ratio_to_base"], 100 * r["floor_ratio"],
                    100 * r["serial_floor_ratio"], r["resident_adapters"], r["pages_in_use"], r["rss_mib"])
    for source, figures in report["cold_load"].items():
        logger.info("cold load from %-5s: %.0f ms (median of %d)", source, 1e3 * figures["median_s"], len(figures["tries"]))
    logger.info("committing the %.1f GiB device pool before the runs took %.1f s (the first touch of its memory)",
                report["pool_commit"]["gib"], report["pool_commit"]["seconds"])
    logger.info("peak RSS %.0f MiB (%.0f MiB before the %d adapters were registered)", report["peak_rss_mib"],
                report["registry_rss_mib"], work["registered_adapters"])


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    base = report["base"]["tokens_per_cpu_s"]
    for popularity, color in zip(POPULARITIES, ("tab:blue", "tab:orange")):
        rows = [r for r in report["rows"] if r["popularity"] == popularity or r["num_adapters"] == 1]
        counts = [r["num_adapters"] for r in rows]
        ax.plot(counts, [r["tokens_per_cpu_s"] for r in rows], marker="o", color=color, label=popularity)
        ax.plot(counts, [base * r["floor_ratio"] for r in rows], linestyle=":", color=color,
                label=f"{popularity}: floor, pages read under the arithmetic")
        ax.plot(counts, [base * r["serial_floor_ratio"] for r in rows], linestyle="-.", color=color,
                label=f"{popularity}: floor, pages read after it")
    ax.axhline(base, color="gray", linestyle="--", label="base model")
    ax.set_xscale("log")
    ax.set_xlabel("adapters registered, N (log)")
    ax.set_ylabel("tokens per CPU-second")
    env, work = report["environment"], report["workload"]
    ax.set_title(f"{work['num_requests']} requests, ranks 8-64 on all projections; {env['dtype']}, {env['threads']} thread")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
