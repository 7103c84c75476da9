"""Ours and llama.cpp on the same GGUF file, for `benchmarks.peers --llama-dtypes q8_0,q4_k_m,bf16`:
each type's file made once (`llama_cpp.model_file`: the vendored converter, then `llama-quantize`),
served by our engine as it is (`EngineConfig(model="file.gguf")`) and by `llama-server`, at one request
and at `--num-requests` requests (base, and W over the adapters). Ratios of tokens per CPU-second:
ours over llama.cpp per file and workload, and ours at each type over ours at bf16."""
from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Callable

from benchmarks import llama_cpp
from benchmarks.engine import NO_PREFIX_CACHE, median_of_interleaved, run_ours
from lora_runtime import Engine, EngineConfig
from lora_runtime.config import SchedulerConfig
from lora_runtime.errors import ValidationError

logger = logging.getLogger("benchmarks.same_gguf")

# Workload names: W and base at every request at once, and base_1, the first request alone (the case
# bound by weight bytes).
WORKLOADS = ("W", "base", "base_1")
# The goals on the same file: (workload, type, over what, threshold); "llama.cpp" compares with
# llama.cpp's run of the file, "bf16" with ours on the bf16 file. (Q8_0 >= 1.3x bf16 at 32+ requests
# holds on CPUs with VNNI only.)
GOALS = (
    ("base_1", "q8_0", "llama.cpp", 1.2), ("base_1", "q4_k_m", "llama.cpp", 1.2), ("base_1", "q4_k_m", "bf16", 2.5),
    ("base", "q8_0", "llama.cpp", 1.5), ("base", "q4_k_m", "llama.cpp", 1.5), ("W", "q8_0", "llama.cpp", 4.0),
    ("W", "q4_k_m", "llama.cpp", 4.0), ("base", "q8_0", "bf16", 1.3),
)


def measure_ours_files(model_dir: Path, workload, outtypes: list[str], threads: int, repeats: int) -> dict:
    """Per type: our engine on llama.cpp's file of that type, every workload the median of `repeats`
    interleaved runs. One engine alive at a time (a 1B model's engines would not all fit)."""
    root = llama_cpp.llama_cpp_root()
    report = {}
    for outtype in outtypes:
        path = llama_cpp.model_file(root, model_dir, outtype)
        config = EngineConfig(model=str(path), scheduler=SchedulerConfig(max_num_seqs=len(workload.prompts)),
                              kv_cache=NO_PREFIX_CACHE, num_threads=threads)
        try:
            engine = Engine.from_config(config)
        except ValidationError as error:  # e.g. Q4_K_M of 576-wide rows: llama.cpp falls back to Q5_0
            logger.warning("ours refuses %s: %s", path.name, error)
            report[outtype] = {"refused": str(error)}
            continue
        report[outtype] = median_of_interleaved(ours_runs(engine, workload), repeats)
        report[outtype]["file_bytes"] = path.stat().st_size
        for name in WORKLOADS:
            _log(f"ours on {path.name}, {name}", report[outtype][name])
        del engine
        gc.collect()
    return report


def ours_runs(engine: Engine, workload) -> dict[str, Callable[[], dict]]:
    adapters = [str(workload.adapter_paths[i]) for i in workload.adapter_of]
    prompts, new_tokens = workload.prompts, workload.new_tokens
    return {"W": lambda: run_ours(engine, prompts, new_tokens, adapters),
            "base": lambda: run_ours(engine, prompts, new_tokens),
            "base_1": lambda: run_ours(engine, prompts[:1], new_tokens)}


def file_ratios(ours: dict[str, dict], llama: dict[str, dict]) -> dict[str, dict[str, dict[str, float]]]:
    """ratios[type][workload] = {"llama.cpp": ours / llama.cpp, "bf16": ours / ours at bf16}, each
    where both were measured (not where our engine refused the file or llama.cpp's server died)."""
    ratios: dict = {}
    for outtype, figures in ours.items():
        if "refused" in figures:
            continue
        for name in WORKLOADS:
            against = {"llama.cpp": llama.get(outtype, {}).get(name), "bf16": ours.get("bf16", {}).get(name)}
            ratios.setdefault(outtype, {})[name] = {
                peer: figures[name]["tokens_per_cpu_s"] / theirs["tokens_per_cpu_s"]
                for peer, theirs in against.items() if theirs is not None and "tokens_per_cpu_s" in theirs}
    return ratios


def check_file_goals(ratios: dict) -> list[dict]:
    """The issue's goals on the same file, each with its measured value (None where not measured)."""
    goals = []
    for name, outtype, peer, threshold in GOALS:
        value = ratios.get(outtype, {}).get(name, {}).get(peer)
        goals.append({"workload": name, "type": outtype, "over": peer, "threshold": threshold, "value": value,
                      "met": None if value is None else value >= threshold})
    return goals


def log_file_summary(ratios: dict, goals: list[dict]) -> None:
    for outtype, by_workload in ratios.items():
        for name, by_peer in by_workload.items():
            shown = ", ".join(f"{value:.2f}x {peer}" for peer, value in by_peer.items())
            logger.info("ours on the %s file, %s: %s", outtype, name, shown or "no peer measured")
    for goal in goals:
        if goal["value"] is not None:
            logger.info("goal %s %s >= %.1fx %s: %.2fx (%s)", goal["type"], goal["workload"], goal["threshold"],
                        goal["over"], goal["value"], "met" if goal["met"] else "NOT met")


def file_table(ours: dict, llama: dict, ratios: dict, num_requests: int, num_adapters: int) -> str:
    """A Markdown table, a row per type and workload: tokens per CPU-second of ours and of llama.cpp on
    the file, and the ratios; a run that did not happen says why (refused, or how the server died)."""
    labels = {"base_1": "1 request", "base": f"{num_requests} requests",
              "W": f"{num_requests} requests, {num_adapters} adapters"}
    lines = ["| file | workload | ours tokens/CPU-s | llama.cpp tokens/CPU-s | ours / llama.cpp | ours / ours bf16 |",
             "|---|---|---|---|---|---|"]
    for outtype in dict.fromkeys([*ours, *llama]):
        for name, label in labels.items():
            by_peer = ratios.get(outtype, {}).get(name, {})
            lines.append(f"| {outtype} | {label} | {_rate_cell(ours.get(outtype), name)} | "
                         f"{_rate_cell(llama.get(outtype), name)} | {_ratio_cell(by_peer.get('llama.cpp'))} | "
                         f"{_ratio_cell(by_peer.get('bf16'))} |")
    return "\n".join(lines)


def _rate_cell(figures: dict | None, name: str) -> str:
    if figures is None:
        return "not run"
    if "refused" in figures:
        return "refused the file"
    run = figures[name]
    return f"died: {run['died']}" if "died" in run else f"{run['tokens_per_cpu_s']:.1f}"


def _ratio_cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _log(name: str, figures: dict) -> None:
    logger.info("%s: %.1f tokens/CPU-s, %.1f tokens/s wall", name, figures["tokens_per_cpu_s"], figures["tokens_per_s"])
