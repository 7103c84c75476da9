"""Our engine against its peers on one workload, one thread, in the same run: llama.cpp's
`llama-server` (the standard CPU engine, several LoRA adapters per server) and PEFT.

    python -m benchmarks.peers [--threads 1] [--num-requests 64] [--new-tokens 64] [--adapters 8]
        [--llama-dtypes f32,bf16] [--peft-dtypes float32,bfloat16] [--repeats 3]
        [--skip-peft] [--skip-llama] [--random-llama-1b [--layers N]]

Workloads, on the embedded model: W, 64 requests of 20-60 prompt tokens over 8 random PEFT adapters
(ranks 8-64 on every projection; request i uses adapter i % 8), 64 new tokens each, greedy, EOS
ignored; base, the same prompts with no adapter. Systems: ours at the engine's default dtype, the
median of `--repeats` interleaved runs per workload; llama.cpp in f32 and bf16 GGUF
(`benchmarks.llama_cpp`: built from the pinned sdist's vendored source on first use, 7-17 minutes on
one core), all requests sent at once to one server with a slot per request; PEFT's mixed-adapter
batched `generate` (W only) in float32 and bfloat16. Peers run once each; every system loads its
adapters before its clock starts. Ratios are taken against each peer's best dtype. Prints tokens per
CPU-second and per wall second of every run, the ratios on CPU time and the issue's goals; the last
line of stdout is one JSON object.

Same file (`benchmarks.same_gguf`): each `--llama-dtypes` type is one GGUF file (f32/f16/bf16 from the
converter, any other type, e.g. q8_0 or q4_k_m, by the vendored `llama-quantize` from the bf16 file),
served by llama.cpp and by our engine as it is, W and base at `--num-requests` requests and base_1, the
first request alone; ratios ours over llama.cpp per file and ours per type over ours at bf16, logged
as a Markdown table. A llama.cpp server that dies (an exit status, a signal, no health in time, a burst
cut off) is recorded with its reason and last log lines in the report and the table, and the runs go on.
`--random-llama-1b` runs a random-weight model of Llama-3.2-1B's shape instead of the embedded model
(`--layers N` cuts it to N layers, for a quick check).
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import llama_cpp, options, same_gguf
from benchmarks.engine import NO_PREFIX_CACHE, make_prompts, median_of_interleaved, run_ours
from benchmarks.peft_baseline import make_random_adapters, run_peft
from benchmarks.random_model import random_llama
from lora_runtime import Engine, EngineConfig
from lora_runtime.config import SchedulerConfig
from lora_runtime.embedded import default_cache_dir, ensure_embedded_model

logger = logging.getLogger("benchmarks.peers")

TARGETS = "all-linear"
# The goals: (ratio name, comparison, threshold). Ratios are ours over the peer on CPU time;
# the LoRA overhead is ours base over ours W, minus one.
GOALS = (
    ("ours_vs_llama_cpp_w", ">=", 3.0),
    ("ours_vs_llama_cpp_base", ">=", 1.5),
    ("ours_vs_peft_w", ">=", 2.5),
    ("lora_overhead", "<=", 0.15),
)


@dataclass(frozen=True, slots=True)
class Workload:
    prompts: list[list[int]]
    adapter_paths: list[Path]  # PEFT directories
    adapter_of: list[int]  # request index -> index into adapter_paths
    new_tokens: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_threads(parser)
    options.add_workload(parser)
    parser.add_argument("--adapters", type=int, default=8, help="random adapters the requests are spread over")
    parser.add_argument("--llama-dtypes", default="f32,bf16", help="GGUF types to run llama.cpp in")
    parser.add_argument("--peft-dtypes", default="float32,bfloat16", help="torch dtypes to run PEFT in")
    options.add_repeats(parser)
    parser.add_argument("--skip-peft", action="store_true")
    parser.add_argument("--skip-llama", action="store_true")
    options.add_random_llama(parser)
    return options.parse_random_llama(parser, argv)


def cpu_model_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _dtype_name(dtype: torch.dtype) -> str:
    """The dtype the engine resolved its default to (the config may say only "auto")."""
    return str(dtype).removeprefix("torch.")


def _log(name: str, figures: dict) -> None:
    logger.info("%s: %.1f tokens/CPU-s, %.1f tokens/s wall (%d tokens, %.1f CPU-s, %.1f s wall)", name,
                figures["tokens_per_cpu_s"], figures["tokens_per_s"], figures["tokens"], figures["cpu_s"],
                figures["wall_s"])


def measure_ours(engine: Engine, workload: Workload, repeats: int) -> dict:
    """W and base on the engine as configured by default (its dtype is the one we ship), each the
    median of `repeats` interleaved runs, as `benchmarks.engine` reports it."""
    adapters = [str(workload.adapter_paths[i]) for i in workload.adapter_of]
    report = median_of_interleaved({
        "W": lambda: run_ours(engine, workload.prompts, workload.new_tokens, adapters),
        "base": lambda: run_ours(engine, workload.prompts, workload.new_tokens),
    }, repeats)
    dtype = _dtype_name(engine.model.dtype)
    _log(f"ours ({dtype}), W", report["W"])
    _log(f"ours ({dtype}), base", report["base"])
    return report


def measure_llama_cpp(model_dir: Path, workload: Workload, outtypes: list[str], threads: int) -> dict:
    """Per GGUF type, `measure_llama_cpp_file` on llama.cpp's file of that type, with the adapters in
    that type (in bf16 beside a quantized model)."""
    root = llama_cpp.llama_cpp_root()
    binary = llama_cpp.ensure_server(root)
    report = {}
    for outtype in outtypes:
        start = time.perf_counter()
        model = llama_cpp.model_file(root, model_dir, outtype)
        lora_type = outtype if outtype in llama_cpp.CONVERTER_TYPES else "bf16"
        loras = [llama_cpp.convert_adapter(root, path, model_dir, lora_type) for path in workload.adapter_paths]
        report[outtype] = {"convert_s": time.perf_counter() - start,
                           **measure_llama_cpp_file(binary, model, loras, workload, threads)}
    return report


def measure_llama_cpp_file(binary: Path, model: Path, loras: list[Path], workload: Workload, threads: int) -> dict:
    """W on a server holding every adapter, base and base_1 (the first request alone) on one started
    without adapters (so no request can pay for an adapter). A server that dies is recorded under its
    workload with its reason and last log lines, and the other workloads still run."""
    first = Workload(workload.prompts[:1], workload.adapter_paths, workload.adapter_of[:1], workload.new_tokens)
    runs = {"W": (loras, workload, workload.adapter_of), "base": ([], workload, [None] * len(workload.prompts)),
            "base_1": ([], first, [None])}
    report = {}
    for name, (served_loras, served, adapter_of) in runs.items():
        try:
            report[name] = _serve(binary, model, served_loras, served, adapter_of, threads)
            _log(f"llama.cpp ({model.name}), {name}", report[name])
        except llama_cpp.PeerDied as death:
            logger.warning("llama.cpp (%s), %s: %s; its last lines:\n%s", model.name, name, death.reason, death.log_tail)
            report[name] = {"died": death.reason, "log_tail": death.log_tail}
    return report


def _serve(binary: Path, model: Path, loras: list[Path], workload: Workload, adapter_of: list[int | None],
           threads: int) -> dict:
    port = llama_cpp.free_port()
    slot_tokens = max(len(p) for p in workload.prompts) + workload.new_tokens
    command = llama_cpp.server_command(binary, model, loras, port, len(workload.prompts), slot_tokens, threads)
    bodies = [llama_cpp.completion_body(prompt, workload.new_tokens, adapter_idx, len(loras))
              for prompt, adapter_idx in zip(workload.prompts, adapter_of)]
    with llama_cpp.LlamaServer(command, port) as server:
        return llama_cpp.run_burst(server, bodies)


def measure_peft(model_dir: Path, workload: Workload, dtypes: list[str], pad_id: int) -> dict:
    report = {}
    for name in dtypes:
        report[name] = run_peft(model_dir, workload.adapter_paths, workload.prompts, workload.adapter_of,
                                workload.new_tokens, getattr(torch, name), pad_id)
        _log(f"PEFT mixed-adapter generate ({name}), W", report[name])
    return report


def best_dtype(runs: dict[str, dict], workload: str | None = None) -> str | None:
    """The dtype of the highest tokens per CPU-second (of `workload` where runs are split by workload),
    among the runs measured (a server that died has no rate)."""
    rates = {name: (figures[workload] if workload else figures).get("tokens_per_cpu_s") for name, figures in runs.items()}
    measured = {name: rate for name, rate in rates.items() if rate is not None}
    return max(measured, key=measured.__getitem__) if measured else None


def compute_ratios(ours_w: float, ours_base: float, llama_w: float | None, llama_base: float | None,
                   peft_w: float | None) -> dict[str, float | None]:
    """Ratios of tokens per CPU-second; None where the peer was not measured."""
    def ratio(ours: float, peer: float | None) -> float | None:
        return None if peer is None else ours / peer

    return {"ours_vs_llama_cpp_w": ratio(ours_w, llama_w), "ours_vs_llama_cpp_base": ratio(ours_base, llama_base),
            "ours_vs_peft_w": ratio(ours_w, peft_w), "lora_overhead": ours_base / ours_w - 1}


def check_goals(ratios: dict[str, float | None]) -> dict[str, dict]:
    """Each goal's threshold, the measured value and whether it is met (None where not measured)."""
    goals = {}
    for name, comparison, threshold in GOALS:
        value = ratios[name]
        met = None if value is None else (value >= threshold if comparison == ">=" else value <= threshold)
        goals[name] = {"comparison": comparison, "threshold": threshold, "value": value, "met": met}
    return goals


def _summarise(report: dict) -> None:
    """Adds the best dtypes, ratios and goals to `report` and logs them."""
    def rate(figures: dict | None) -> float | None:
        return None if figures is None else figures["tokens_per_cpu_s"]

    llama, peft = report.get("llama_cpp", {}), report.get("peft", {})
    best = {"llama_cpp_w": best_dtype(llama, "W"), "llama_cpp_base": best_dtype(llama, "base"),
            "peft_w": best_dtype(peft)}
    report["best_dtypes"] = best
    report["ratios"] = ratios = compute_ratios(
        rate(report["ours"]["W"]), rate(report["ours"]["base"]),
        rate(llama.get(best["llama_cpp_w"], {}).get("W")), rate(llama.get(best["llama_cpp_base"], {}).get("base")),
        rate(peft.get(best["peft_w"])))
    report["goals"] = goals = check_goals(ratios)
    for name, goal in goals.items():
        if goal["value"] is None:
            logger.info("%s: not measured", name)
            continue
        logger.info("%s = %s (goal %s %s: %s)", name, _shown(name, goal["value"]), goal["comparison"],
                    _shown(name, goal["threshold"]), "met" if goal["met"] else "NOT met")


def _shown(name: str, value: float) -> str:
    return f"{100 * value:+.1f}%" if name == "lora_overhead" else f"{value:.2f}x"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the figures
    torch.set_num_threads(args.threads)
    model_dir = random_llama(args.layers) if args.random_llama_1b else ensure_embedded_model()
    engine = Engine.from_config(EngineConfig(model=str(model_dir),
                                             scheduler=SchedulerConfig(max_num_seqs=args.num_requests),
                                             kv_cache=NO_PREFIX_CACHE, num_threads=args.threads))
    adapters_dir = default_cache_dir() / "bench-adapters" / (model_dir.name if args.random_llama_1b else "")
    paths = make_random_adapters(model_dir, adapters_dir, args.adapters, TARGETS)
    workload = Workload(make_prompts(engine.tokenizer, args.num_requests), paths,
                        [i % args.adapters for i in range(args.num_requests)], args.new_tokens)
    report: dict = {"model": str(model_dir), "cpu_model": cpu_model_name(), "threads": args.threads, "num_requests": args.num_requests,
                    "new_tokens": args.new_tokens, "num_adapters": args.adapters, "targets": TARGETS,
                    "ours_dtype": _dtype_name(engine.model.dtype), "ours_config_dtype": str(engine.config.dtype)}
    report["ours"] = measure_ours(engine, workload, args.repeats)
    pad_id = engine.tokenizer.eos_token_id
    del engine  # the same-file runs build an engine per file
    if not args.skip_llama:
        outtypes = args.llama_dtypes.split(",")
        report["llama_cpp"] = measure_llama_cpp(model_dir, workload, outtypes, args.threads)
        report["ours_gguf"] = same_gguf.measure_ours_files(model_dir, workload, outtypes, args.threads, args.repeats)
        report["file_ratios"] = same_gguf.file_ratios(report["ours_gguf"], report["llama_cpp"])
        report["file_goals"] = same_gguf.check_file_goals(report["file_ratios"])
    if not args.skip_peft:
        report["peft"] = measure_peft(model_dir, workload, args.peft_dtypes.split(","), pad_id)
    _summarise(report)
    if "file_ratios" in report:
        same_gguf.log_file_summary(report["file_ratios"], report["file_goals"])
        logger.info("same file, one thread:\n%s", same_gguf.file_table(
            report["ours_gguf"], report["llama_cpp"], report["file_ratios"], args.num_requests, args.adapters))
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
