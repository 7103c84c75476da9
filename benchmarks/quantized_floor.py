"""`benchmarks.quantized --random-llama-1b`: the random-weight model of Llama-3.2-1B's shape (cut to
`--layers`) served three ways, bf16 (its Hugging Face directory), Q8_0 and Q4_K_M (GGUF files of that
checkpoint made once by llama.cpp's vendored converter and `llama-quantize`: `llama_cpp.model_file`),
against the floor of reading each one's weights from memory.

Each configuration runs in a spawned process of its own (its peak RSS is its own), all three alive at
once and driven over pipes, so their runs interleave (`median_of_interleaved`). Every run is measured
twice, with one new token (the prefill and its first token) and with `--new-tokens`; the difference
is the decode steps alone. At one request a decode step is bound by the bytes of weights it reads: the
projections and the LM head as the loaded model holds them (`decode_weight_bytes`), over one thread's
read bandwidth over a buffer several times the L3 (`READ_BUFFER_BYTES`), measured before each number
of requests' runs and after them, the best kept (the machine's load varies; the floor stays
optimistic). Peak RSS is set against the file plus the configured KV cache and adapter pools (the
engine's memory budget), beside the resident memory after the load (anonymous and file-mapped).
"""
from __future__ import annotations

import logging
import multiprocessing
from pathlib import Path

from benchmarks import llama_cpp
from benchmarks.engine import NO_PREFIX_CACHE, make_prompts, median_of_interleaved, run_ours
from benchmarks.load_memory import held_bytes
from benchmarks.random_model import random_llama
from benchmarks.roofline import measure_read_rate
from benchmarks.same_gguf import GOALS
from benchmarks.timing import Timer, peak_rss_mib

logger = logging.getLogger("benchmarks.quantized_floor")

MIB = 2**20
BASELINE = "bf16"
QUANTIZED_TYPES = ("q8_0", "q4_k_m")  # llama-quantize's names
READ_BUFFER_BYTES = 1024 * MIB  # over three times this VM's 300 MiB L3: every pass is read from memory
# Small pools, configured: the run loads no adapter, and the goal sets peak RSS against what is configured.
ADAPTER_POOL_BYTES = 32 * MIB
KV_SLACK_TOKENS = 64  # the longest prompt (make_prompts: up to 60 tokens) and a block of rounding
RSS_GOAL = 1.15  # peak RSS within 15% of the file plus the configured KV cache and adapter pools
PROJECTIONS = ("qkv", "o", "gate_up", "down")


def decode_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every layer's projections and the LM head, as held."""
    layers = sum(held_bytes(getattr(layer, name)) for layer in model.weights.layers for name in PROJECTIONS)
    return layers + held_bytes(model.weights.lm_head)


def model_paths(model_dir: Path) -> dict[str, Path]:
    """bf16: the directory; each quantized type: its GGUF file, made once."""
    root = llama_cpp.llama_cpp_root()
    return {BASELINE: model_dir} | {name: llama_cpp.model_file(root, model_dir, name) for name in QUANTIZED_TYPES}


def file_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors")) if path.is_dir() else path.stat().st_size


def engine_config(path: Path, max_requests: int, new_tokens: int):
    from lora_runtime import EngineConfig
    from lora_runtime.config import AdapterConfig, KVCacheConfig, SchedulerConfig

    block = NO_PREFIX_CACHE.block_size_tokens
    num_blocks = max_requests * -(-(KV_SLACK_TOKENS + new_tokens) // block)
    return EngineConfig(model=str(path), dtype="bfloat16", num_threads=1,
                        kv_cache=KVCacheConfig(enable_prefix_caching=False, num_blocks=num_blocks),
                        scheduler=SchedulerConfig(max_num_seqs=max_requests),
                        adapters=AdapterConfig(device_pool_bytes=ADAPTER_POOL_BYTES, host_cache_bytes=ADAPTER_POOL_BYTES))


def memory_status_mib(keys: tuple[str, ...] = ("VmRSS", "RssAnon", "RssFile", "VmHWM")) -> dict[str, float]:
    """This process's lines of /proc/self/status named `keys`, in MiB."""
    lines = (line.split() for line in Path("/proc/self/status").read_text().splitlines())
    return {fields[0].rstrip(":"): int(fields[1]) / 1024 for fields in lines if fields and fields[0].rstrip(":") in keys}


def _serve(connection, config) -> None:
    """The child: loads the engine, says what it holds, then runs what the parent sends until "exit"."""
    from lora_runtime import Engine

    engine = Engine.from_config(config)
    budget = engine.memory_budget
    connection.send({"decode_weight_bytes": decode_weight_bytes(engine.model),
                     "kv_cache_bytes": budget.kv_cache_bytes, "adapter_pool_bytes": budget.adapter_pool_bytes,
                     "budget_total_bytes": budget.total_bytes, "after_load_mib": memory_status_mib()})
    while (command := connection.recv())[0] != "exit":
        if command[0] == "run":
            connection.send(run_ours(engine, command[1], command[2]))
        else:  # "peak_rss"
            connection.send(peak_rss_mib() * MIB)


class EngineProcess:
    """One configuration's engine in a spawned process, driven over a pipe."""

    def __init__(self, name: str, config) -> None:
        context = multiprocessing.get_context("spawn")
        self.name = name
        self._connection, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, config), daemon=True)
        self._process.start()
        child.close()
        self.held = self._receive()

    def call(self, *command):
        self._connection.send(command)
        return self._receive()

    def _receive(self):
        try:
            return self._connection.recv()
        except EOFError:
            self._process.join()
            raise RuntimeError(f"the {self.name} engine's process died (exit code {self._process.exitcode})") from None

    def close(self) -> float:
        """Its peak RSS in bytes; the process ends."""
        peak = self.call("peak_rss")
        self._connection.send(("exit",))
        self._process.join()
        return peak


def burst(engine: EngineProcess, prompts: list[list[int]], new_tokens: int) -> dict:
    """Every prompt at once: the whole run's tokens per CPU-second, and the decode steps alone (the run
    less a run of one new token: the same prefill), per CPU-second and in seconds per step."""
    first = engine.call("run", prompts, 1)
    whole = engine.call("run", prompts, new_tokens)
    decode_s = whole["cpu_s"] - first["cpu_s"]
    return {"tokens_per_cpu_s": whole["tokens_per_cpu_s"], "decode_tokens_per_cpu_s": len(prompts) * (new_tokens - 1) / decode_s,
            "decode_s_per_step": decode_s / (new_tokens - 1)}


def floor_lines(seconds_per_token: dict[str, float], weight_bytes: dict[str, int], read_bytes_per_s: float) -> dict[str, dict]:
    """Per configuration at one request: its measured seconds per token, the floor (its weight bytes
    over the read bandwidth), measured / floor, its speed over bf16's and the floor's over bf16's floor
    (the most the bytes allow)."""
    base_floor = weight_bytes[BASELINE] / read_bytes_per_s
    lines = {}
    for name, seconds in seconds_per_token.items():
        floor = weight_bytes[name] / read_bytes_per_s
        lines[name] = {"s_per_token": seconds, "floor_s_per_token": floor, "over_floor": seconds / floor,
                       "vs_bf16": seconds_per_token[BASELINE] / seconds, "floor_vs_bf16": base_floor / floor}
    return lines


def rss_line(peak_bytes: float, path_bytes: int, held: dict) -> dict:
    configured = path_bytes + held["kv_cache_bytes"] + held["adapter_pool_bytes"]
    return {"peak_rss_mib": peak_bytes / MIB, "file_mib": path_bytes / MIB, "kv_cache_mib": held["kv_cache_bytes"] / MIB,
            "adapter_pools_mib": held["adapter_pool_bytes"] / MIB, "over_file_kv_pools": peak_bytes / configured,
            "over_budget": peak_bytes / held["budget_total_bytes"], "after_load_mib": held["after_load_mib"]}


def run_random_llama(layers: int | None, counts: list[int], new_tokens: int, repeats: int) -> dict:
    from transformers import AutoTokenizer

    with Timer() as clock:
        model_dir = random_llama(layers)
        paths = model_paths(model_dir)
        prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir), max(counts))
        engines = {name: EngineProcess(name, engine_config(path, max(counts), new_tokens)) for name, path in paths.items()}
        report = {"model": model_dir.name, "new_tokens": new_tokens}
        read_rates = []
        for count in counts:
            read_rates.append(measure_read_rate(tries=3, buffer_bytes=READ_BUFFER_BYTES))
            runs = {name: (lambda e=engine: burst(e, prompts[:count], new_tokens)) for name, engine in engines.items()}
            report[f"{count}_requests"] = median_of_interleaved(runs, repeats, rate="decode_tokens_per_cpu_s")
        read_rates.append(measure_read_rate(tries=3, buffer_bytes=READ_BUFFER_BYTES))
        read_bytes_per_s = max(read_rates)
        report |= {"read_gb_per_s": read_bytes_per_s / 1e9, "all_read_gb_per_s": [rate / 1e9 for rate in read_rates]}
        weight_bytes = {name: engine.held["decode_weight_bytes"] for name, engine in engines.items()}
        if 1 in counts:
            seconds = {name: run["decode_s_per_step"] for name, run in report["1_requests"].items()}
            report["floor"] = floor_lines(seconds, weight_bytes, read_bytes_per_s)
        report["rss"] = {name: rss_line(engine.close(), file_bytes(paths[name]), engine.held) for name, engine in engines.items()}
    report["weight_mb_per_step"] = {name: size / 1e6 for name, size in weight_bytes.items()}
    report["goals"] = goals(report, counts)
    report["wall_s"] = clock.wall
    log_report(report, counts)
    return report


def goals(report: dict, counts: list[int]) -> list[dict]:
    """The issue's goals against bf16 (same_gguf.GOALS: at one request, and at the most requests when
    32 or more) and the peak RSS goal, each with its value."""
    found = []
    for workload, name, over, threshold in GOALS:
        count = 1 if workload == "base_1" else max(counts)
        runs = report.get(f"{count}_requests")
        if over == BASELINE and runs and (count == 1 or count >= 32):
            value = runs[name]["decode_tokens_per_cpu_s"] / runs[BASELINE]["decode_tokens_per_cpu_s"]
            found.append({"goal": f"{name} at {count} requests >= {threshold}x bf16", "value": value, "met": value >= threshold})
    for name, line in report["rss"].items():
        value = line["over_file_kv_pools"]
        found.append({"goal": f"{name} peak RSS <= {RSS_GOAL}x file + KV + pools", "value": value, "met": value <= RSS_GOAL})
    return found


def log_report(report: dict, counts: list[int]) -> None:
    logger.info("%s: one thread reads %.1f GB/s (best over %d MiB; measured %s); %d new tokens; %.0f s in all",
                report["model"], report["read_gb_per_s"], READ_BUFFER_BYTES // MIB,
                ", ".join(f"{rate:.1f}" for rate in report["all_read_gb_per_s"]), report["new_tokens"], report["wall_s"])
    for name, line in report.get("floor", {}).items():
        logger.info("%-7s 1 request: %.1f ms/token, floor %.1f ms (%.0f MB/step), %.2fx the floor; %.2fx bf16 "
                    "(the bytes allow %.2fx)", name, 1e3 * line["s_per_token"], 1e3 * line["floor_s_per_token"],
                    report["weight_mb_per_step"][name], line["over_floor"], line["vs_bf16"], line["floor_vs_bf16"])
    for count in (c for c in counts if c != 1):
        runs = report[f"{count}_requests"]
        for name, run in runs.items():
            logger.info("%-7s %d requests: %.1f tokens/CPU-s (decode steps alone %.1f), %.2fx bf16 (decode %.2fx)",
                        name, count, run["tokens_per_cpu_s"], run["decode_tokens_per_cpu_s"],
                        run["tokens_per_cpu_s"] / runs[BASELINE]["tokens_per_cpu_s"],
                        run["decode_tokens_per_cpu_s"] / runs[BASELINE]["decode_tokens_per_cpu_s"])
    for name, line in report["rss"].items():
        logger.info("%-7s peak RSS %.0f MiB = %.2fx (file %.0f + KV cache %.0f + adapter pools %.0f MiB); %.2fx the "
                    "engine's budget", name, line["peak_rss_mib"], line["over_file_kv_pools"], line["file_mib"],
                    line["kv_cache_mib"], line["adapter_pools_mib"], line["over_budget"])
        logger.info("%-7s after the load: %s MiB", name, ", ".join(f"{key} {mib:.0f}" for key, mib in line["after_load_mib"].items()))
    for goal in report["goals"]:
        logger.info("goal %s: %.2f (%s)", goal["goal"], goal["value"], "met" if goal["met"] else "NOT met")
