"""How our engine scales with compute threads: the one benchmark that runs more than one.

    python -m benchmarks.threads [--threads 1,2] [--num-requests 64] [--new-tokens 64] [--adapters 8]
                                 [--repeats 3] [--llama-cpp] [--random-llama-1b [--layers 16]]

The workloads of `benchmarks.peers`: 64 requests of 20-60 prompt tokens, 64 new tokens each, greedy,
EOS ignored, on the embedded model in the engine's default dtype; "base" (no adapter) and "W" (the
requests spread over 8 random all-linear adapters of ranks 8-64). Each thread count (default 1 to
the physical cores of this process's affinity mask) runs each workload `--repeats` times, interleaved
round by round, and reports its median run: tokens per wall-second (the figure threads improve; the
CPU time grows with them), the speed-up over one thread, and the machine's load (/proc/loadavg's
1-minute figure before and after: other processes on the cores make the speed-ups smaller than the
engine's). The engine times every step's phases (`lora_runtime.step_timing`): the serial share of a
step (scheduling, plan building, sampling, the requests' updates and detokenization) measured at
one thread, and the speed-up Amdahl's law allows with it at 16 and 64 cores; beside it, the serial
share that the measured speed-up at N threads implies (`fitted`: it also counts the Python between a
layer's ops and the threads' imbalance). `--llama-cpp` runs llama.cpp's server on the same workloads
at the same thread counts (`benchmarks.peers`; built on first use, 7-17 minutes).
`--random-llama-1b` runs a random-weight model of Llama-3.2-1B's shape instead of the embedded one
(`benchmarks.random_model`, written on first use; base workload only: the random adapters are made
for the embedded model); `--layers N` cuts it to its first N layers (a quick check of the benchmark:
the serial share then weighs more than on the whole model). The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from benchmarks import peers, options
from benchmarks.engine import NO_PREFIX_CACHE, make_prompts, median_of_interleaved
from benchmarks.peft_baseline import make_random_adapters
from benchmarks.random_model import random_llama
from benchmarks.timing import Timer
from lora_runtime import Engine, EngineConfig, SamplingParams
from lora_runtime.config import SchedulerConfig
from lora_runtime.embedded import default_cache_dir, ensure_embedded_model
from lora_runtime.step_timing import PHASES
from lora_runtime.threads import default_num_threads

logger = logging.getLogger("benchmarks.threads")

PROJECTED_CORES = (16, 64)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default=None,
                        help="comma-separated thread counts (default: 1 to this process's physical cores)")
    options.add_dtype(parser)
    options.add_workload(parser)
    parser.add_argument("--adapters", type=int, default=8, help="adapters of workload W (0: base only)")
    options.add_repeats(parser)
    parser.add_argument("--llama-cpp", action="store_true", help="also run llama.cpp's server (bf16 GGUF)")
    options.add_random_llama(parser)
    return options.parse_random_llama(parser, argv)


def thread_counts(text: str | None) -> list[int]:
    if text is None:
        return list(range(1, default_num_threads()[0] + 1))
    counts = sorted({int(part) for part in text.split(",")})
    if counts[0] < 1:
        raise ValueError("thread counts are positive")
    return counts if counts[0] == 1 else [1, *counts]  # speed-ups are over one thread


def load_average() -> float:
    """The 1-minute load average: runnable processes, ours included."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def run_at(engine: Engine, threads: int, prompts: list[list[int]], new_tokens: int,
           adapters: list[str] | None) -> dict:
    """One timed `generate` at `threads` threads, after a warm-up that loads the run's adapters; with
    the phases of its steps and the load around it."""
    torch.set_num_threads(threads)
    warm_up = list(dict.fromkeys(adapters)) if adapters else [None, None]
    engine.generate([prompts[i % len(prompts)] for i in range(len(warm_up))], SamplingParams(max_new_tokens=2),
                    adapters=warm_up)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos_token=True)
    load_before, before = load_average(), engine.step_times.snapshot()
    with Timer() as timer:
        outputs = engine.generate(prompts, params, adapters=adapters)
    assert all(output.error is None for output in outputs), [o.error for o in outputs if o.error]
    times = engine.step_times.since(before)
    report = timer.report(sum(len(output.token_ids) for output in outputs))
    return report | {"load_before": load_before, "load_after": load_average(), "steps": times.steps,
                     "phase_s": times.seconds, "serial_fraction": times.serial_fraction}


def amdahl_speedup(serial_fraction: float, cores: int) -> float:
    return 1.0 / (serial_fraction + (1.0 - serial_fraction) / cores)


def fitted_serial_fraction(speedup: float, threads: int) -> float:
    """The serial share s for which Amdahl's law gives `speedup` at `threads` threads."""
    return (threads / speedup - 1.0) / (threads - 1.0)


def summarise(runs: dict[int, dict], counts: list[int]) -> dict:
    """Per thread count: the median run, its speed-up over one thread; the projections at
    PROJECTED_CORES from the serial share measured at one thread and from the fitted one."""
    one = runs[1]
    serial = one["serial_fraction"]
    summary = {"by_threads": {}, "serial_fraction": serial,
               "amdahl": {cores: amdahl_speedup(serial, cores) for cores in PROJECTED_CORES}}
    for threads in counts:
        run = runs[threads]
        speedup = run["tokens_per_s"] / one["tokens_per_s"]
        summary["by_threads"][threads] = run | {"speedup": speedup}
    most = counts[-1]
    if most > 1:
        fitted = min(1.0, max(0.0, fitted_serial_fraction(summary["by_threads"][most]["speedup"], most)))
        summary["fitted_serial_fraction"] = fitted
        summary["fitted_amdahl"] = {cores: amdahl_speedup(fitted, cores) for cores in PROJECTED_CORES}
    return summary


def _log_summary(name: str, summary: dict) -> None:
    for threads, run in summary["by_threads"].items():
        phases = ", ".join(f"{phase} {1000 * run['phase_s'][phase] / max(1, run['steps']):.2f}" for phase in PHASES)
        logger.info("%s, %d thread(s): %.1f tokens/s wall (%.2fx one thread), serial %.1f%% of a step; ms a step: "
                    "%s; load %.2f -> %.2f", name, threads, run["tokens_per_s"], run["speedup"],
                    100 * run["serial_fraction"], phases, run["load_before"], run["load_after"])
    projected = ", ".join(f"{cores} cores {speedup:.1f}x" for cores, speedup in summary["amdahl"].items())
    logger.info("%s: serial share at one thread %.1f%%: Amdahl allows %s", name, 100 * summary["serial_fraction"],
                projected)
    if "fitted_serial_fraction" in summary:
        fitted = ", ".join(f"{cores} cores {speedup:.1f}x" for cores, speedup in summary["fitted_amdahl"].items())
        logger.info("%s: serial share implied by the measured speed-up %.1f%%: %s", name,
                    100 * summary["fitted_serial_fraction"], fitted)


def model_of(args: argparse.Namespace) -> Path:
    return random_llama(args.layers) if args.random_llama_1b else ensure_embedded_model()


def adapter_root(model_dir: Path) -> Path:
    """The benchmark's adapters, a directory per model: their shapes are the model's."""
    return default_cache_dir() / "bench-adapters" / model_dir.name


def measure_ours(args: argparse.Namespace, counts: list[int]) -> dict:
    model_dir = model_of(args)
    engine = Engine.from_config(EngineConfig(model=str(model_dir), dtype=args.dtype,
                                             scheduler=SchedulerConfig(max_num_seqs=args.num_requests),
                                             kv_cache=NO_PREFIX_CACHE, num_threads=counts[-1]))
    prompts = make_prompts(engine.tokenizer, args.num_requests)
    workloads: dict[str, list[str] | None] = {"base": None}
    if args.adapters:
        paths = make_random_adapters(model_dir, adapter_root(model_dir), args.adapters, peers.TARGETS)
        workloads["W"] = [str(paths[i % args.adapters]) for i in range(args.num_requests)]
    runs = {(name, threads): (lambda name=name, threads=threads:
                              run_at(engine, threads, prompts, args.new_tokens, workloads[name]))
            for threads in counts for name in workloads}
    medians = median_of_interleaved({f"{name}@{threads}": run for (name, threads), run in runs.items()}, args.repeats,
                                    rate="tokens_per_s")  # with threads, wall time is the figure
    report = {"model": engine.model_name, "dtype": engine.dtype_name, "kernel_backend": engine.kernel_backend}
    for name in workloads:
        report[name] = summarise({threads: medians[f"{name}@{threads}"] for threads in counts}, counts)
        _log_summary(f"ours ({engine.dtype_name}), {name}", report[name])
    return report


def measure_llama_cpp(args: argparse.Namespace, counts: list[int]) -> dict:
    """llama.cpp's server (bf16 GGUF) on the same model and workloads at each thread count, once each."""
    model_dir = model_of(args)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    paths = make_random_adapters(model_dir, adapter_root(model_dir), max(1, args.adapters), peers.TARGETS)
    workload = peers.Workload(make_prompts(tokenizer, args.num_requests), paths,
                              [i % len(paths) for i in range(args.num_requests)], args.new_tokens)
    report = {}
    for threads in counts:
        load_before = load_average()
        report[threads] = peers.measure_llama_cpp(model_dir, workload, ["bf16"], threads)["bf16"]
        report[threads]["load_before"], report[threads]["load_after"] = load_before, load_average()
    for name in ("base", "W"):
        for threads in counts:
            speedup = report[threads][name]["tokens_per_s"] / report[1][name]["tokens_per_s"]
            logger.info("llama.cpp (bf16), %s, %d thread(s): %.1f tokens/s wall (%.2fx one thread)", name, threads,
                        report[threads][name]["tokens_per_s"], speedup)
    return report


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    counts = thread_counts(args.threads)
    report: dict = {"cpu_model": peers.cpu_model_name(), "threads": counts, "num_requests": args.num_requests,
                    "new_tokens": args.new_tokens, "adapters": args.adapters, "repeats": args.repeats}
    logger.info("%s; thread counts %s; load %.2f", report["cpu_model"], counts, load_average())
    report["ours"] = measure_ours(args, counts)
    if args.llama_cpp:
        report["llama_cpp"] = measure_llama_cpp(args, counts)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
