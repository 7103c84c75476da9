"""Automatic prefix caching on a chat workload: time to first token and throughput with the KV prefix
cache off and on, in the same run, on the embedded model.

    python -m benchmarks.prefix [--threads 1] [--dtype float32] [--num-requests 256] [--concurrency 8]
        [--new-tokens 16] [--system-tokens 400] [--repeats 1] [--seed 0] [--results-dir DIR] [--quick]

Four "adapters": the base model and the demo adapters (demo_adapters/french, json, shout, local PEFT
directories). Each has its own system prompt of ~`system-tokens` tokens: a made-up retailer's policy,
whose opening preamble (~150 tokens) is the same for all four, so that a cache blind to the adapter
would hand one adapter's KV blocks to another. Request i is a chat (`apply_chat_template`: [system,
user]) whose user message is a 20-60 token question (`benchmarks.engine.make_prompts`, seeded); its
adapter comes from a seeded shuffle of the four, reshuffled every four requests. Greedy,
`new-tokens` tokens each, EOS ignored.

Closed loop: `concurrency` requests in flight in one `Engine` (`add_request` + `step`), a new one
submitted as each finishes, until `num-requests` are done. The same request list runs with the cache
off, then on (`KVCacheConfig.enable_prefix_caching`), `repeats` times interleaved, each run on a fresh
engine (an empty cache; the same requests again would otherwise hit their whole prompts) built on
the same loaded weights, after a warm-up that loads every adapter. Per mode, the run of median
throughput (`benchmarks.engine.median_of_interleaved`) is reported: time to first token
(`times.first_token - times.arrival`) p50 and p95, generated tokens per CPU-second and per wall
second, and the fraction of prompt tokens served from the cache; then the ratios against the
issue's goals (TTFT 3x lower, throughput 1.5x higher). Wrong-adapter hits: every run's greedy tokens
must equal the first cache-off run's, request by request; the count of (run, request) pairs that
differ is printed, and must be 0. Writes JSON to benchmarks/results/ (or `--results-dir`), then
fails if that count is not 0. That check needs float32, the default here: a hit moves where a
prompt's prefill chunks end, and in bf16 where they end alone changes some greedy tokens (measured
with the cache off: chunk work 256 against 48 changed 25 of 64 requests in bf16, none in float32).
In bf16 (`--dtype bfloat16` or `auto` on a CPU that multiplies it) the count is printed, not checked.
The default 256 requests keep the first wave's cold requests (two per adapter) out of the p95.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import random
import statistics
from pathlib import Path

import torch

from benchmarks import options
from benchmarks.engine import make_prompts, median_of_interleaved
from benchmarks.peers import cpu_model_name
from benchmarks.results_writer import RESULTS_DIR, results_stem, write_results
from benchmarks.timing import Timer, peak_rss_mib
from lora_runtime import Engine, EngineConfig, SamplingParams
from lora_runtime.config import SchedulerConfig
from lora_runtime.core import RequestOutput
from lora_runtime.embedded import ensure_embedded_model

logger = logging.getLogger("benchmarks.prefix")
DEMO_ADAPTERS = Path(__file__).parents[1] / "demo_adapters"
# Adapter name -> the audience its system prompt's section addresses; "base" runs without an adapter.
AUDIENCES = {
    "base": "customers who write in English",
    "french": "customers who write in French",
    "json": "partners who call the order API and expect JSON",
    "shout": "the warehouse team, who read answers on a loud floor",
}
# The goals: TTFT off / on and throughput on / off, each at least this; and how the log names them.
GOALS = {"ttft_p50": 3.0, "ttft_p95": 3.0, "tokens_per_cpu_s": 1.5}
RATIO_LABELS = {"ttft_p50": "TTFT p50, off / on", "ttft_p95": "TTFT p95, off / on",
                "tokens_per_cpu_s": "tokens per CPU-s, on / off", "tokens_per_s": "tokens per wall s, on / off"}
MODES = {"off": False, "on": True}

PREAMBLE = (
    "You are the assistant of Northwind Outfitters, a made-up retailer of outdoor gear with shops in twelve "
    "cities and an online store. Answer customers politely and briefly, in plain sentences. Never invent order "
    "numbers, prices or delivery dates: when you do not know one, say so and point the customer to the order "
    "page. Do not give medical, legal or financial advice. Keep every answer under one hundred words unless the "
    "customer asks for more detail. The policy below is the only source you may quote; if a question falls "
    "outside it, say that a colleague will follow up by email within two working days. Treat every customer's "
    "personal data as confidential, and never repeat a payment card number, even in part."
)
ITEMS = ("tent", "sleeping bag", "rain jacket", "pair of hiking boots", "camping stove", "water filter",
         "headlamp", "backpack", "trekking pole", "canoe paddle")
PLACES = ("in a shop", "online", "during a sale", "as a gift", "with a member discount", "from the outlet")
ACTIONS = ("returned for a full refund", "exchanged for another size", "repaired free of charge",
           "traded in for store credit", "replaced")
CONDITIONS = ("it is unused", "the receipt is kept", "the tags are still attached",
              "the fault is reported with photos", "the customer is a member", "it was damaged in transit")


@dataclasses.dataclass(frozen=True, slots=True)
class ChatRequest:
    adapter_name: str
    inputs: str  # a JSON list of messages, for apply_chat_template


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_threads(parser)
    options.add_dtype(parser)
    options.add_workload(parser)
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (closed loop)")
    parser.add_argument("--system-tokens", type=int, default=400, help="tokens of each adapter's system prompt")
    options.add_repeats(parser)
    parser.add_argument("--seed", type=int, default=0, help="seeds the questions and the adapter order")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    options.add_quick(parser, "8 requests, 4 in flight, 4 new tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.concurrency, args.new_tokens = 8, 4, 4
    return args


def system_prompt(tokenizer, adapter_name: str, num_tokens: int) -> str:
    """The preamble, then numbered rules drawn by a generator seeded with the name, until `num_tokens`."""
    rng = random.Random(adapter_name)
    text = f"{PREAMBLE} This part of the policy is for {AUDIENCES[adapter_name]}."
    rule = 1
    while len(tokenizer(text)["input_ids"]) < num_tokens:
        text += (f" Rule {rule}: a {rng.choice(ITEMS)} bought {rng.choice(PLACES)} may be {rng.choice(ACTIONS)} "
                 f"within {rng.randint(7, 90)} days if {rng.choice(CONDITIONS)}.")
        rule += 1
    return text


def make_workload(tokenizer, args: argparse.Namespace) -> tuple[list[ChatRequest], dict]:
    """The requests, and the token counts of their parts (what the log and the JSON show)."""
    systems = {name: system_prompt(tokenizer, name, args.system_tokens) for name in AUDIENCES}
    questions = [tokenizer.decode(ids, skip_special_tokens=True)
                 for ids in make_prompts(tokenizer, args.num_requests, seed=args.seed)]
    rng, order = random.Random(args.seed), []
    while len(order) < args.num_requests:
        order += rng.sample(list(AUDIENCES), len(AUDIENCES))
    requests = [ChatRequest(name, json.dumps([{"role": "system", "content": systems[name]},
                                              {"role": "user", "content": question}]))
                for name, question in zip(order, questions)]
    question_tokens = [len(tokenizer(q)["input_ids"]) for q in questions]
    sizes = {"system_prompt_tokens": {name: len(tokenizer(text)["input_ids"]) for name, text in systems.items()},
             "shared_preamble_tokens": len(tokenizer(PREAMBLE)["input_ids"]),
             "question_tokens": {"min": min(question_tokens), "max": max(question_tokens)}}
    return requests, sizes


def adapter_of(name: str) -> str | None:
    return None if name == "base" else str(DEMO_ADAPTERS / name)


def run_closed_loop(engine: Engine, requests: list[ChatRequest], params: SamplingParams,
                    concurrency: int) -> tuple[Timer, list[RequestOutput]]:
    """Every request to its end, `concurrency` in flight; the final outputs in request order."""
    finished: dict[int, RequestOutput] = {}
    in_flight: dict[str, int] = {}  # request id -> index in `requests`
    with Timer() as timer:
        while len(finished) < len(requests):
            while len(finished) + len(in_flight) < len(requests) and len(in_flight) < concurrency:
                index = len(finished) + len(in_flight)
                request = requests[index]
                in_flight[engine.add_request(request.inputs, params, engine.parse_adapter(adapter_of(request.adapter_name)))] = index
            for output in engine.step():
                if output.finished:
                    finished[in_flight.pop(output.request_id)] = output
    outputs = [finished[index] for index in range(len(requests))]
    assert all(o.error is None for o in outputs), [o.error for o in outputs if o.error]
    return timer, outputs


def fresh_engine(loaded: Engine, prefix_caching: bool) -> Engine:
    """An engine with an empty KV cache on `loaded`'s weights, its adapters loaded and written to the
    device pool by a short warm-up whose prompts share no block with the workload's."""
    kv_cache = dataclasses.replace(loaded.config.kv_cache, enable_prefix_caching=prefix_caching)
    engine = Engine(dataclasses.replace(loaded.config, kv_cache=kv_cache), loaded.model, loaded.tokenizer, loaded.model_name)
    warm_up = make_prompts(engine.tokenizer, len(AUDIENCES), seed=-1)
    engine.generate(warm_up, SamplingParams(max_new_tokens=2), adapters=[adapter_of(name) for name in AUDIENCES])
    return engine


def measure(loaded: Engine, requests: list[ChatRequest], args: argparse.Namespace, prefix_caching: bool,
            token_ids_of_runs: list[list[list[int]]]) -> dict:
    """One run on a fresh engine: its figures; its tokens are appended to `token_ids_of_runs`."""
    gc.collect()  # the previous run's engine, outside this run's clock
    engine = fresh_engine(loaded, prefix_caching)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos_token=True, apply_chat_template=True)
    timer, outputs = run_closed_loop(engine, requests, params, args.concurrency)
    token_ids_of_runs.append([o.token_ids for o in outputs])
    ttft = [o.times.first_token - o.times.arrival for o in outputs]
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_cached = sum(o.num_cached_tokens for o in outputs)
    return timer.report(sum(len(o.token_ids) for o in outputs)) | {
        "ttft_p50_s": statistics.median(ttft), "ttft_p95_s": percentile(ttft, 95),
        "prompt_tokens": num_prompt, "cached_tokens": num_cached, "cached_fraction": num_cached / num_prompt,
        "prompt_tokens_min": min(len(o.prompt_token_ids) for o in outputs),
        "prompt_tokens_max": max(len(o.prompt_token_ids) for o in outputs),
    }


def percentile(values: list[float], q: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def count_token_mismatches(token_ids_of_runs: list[list[list[int]]]) -> int:
    """(run, request) pairs whose greedy tokens differ from the first run's (cache off)."""
    reference = token_ids_of_runs[0]
    return sum(ids != ref for run in token_ids_of_runs[1:] for ids, ref in zip(run, reference))


def compare(off: dict, on: dict) -> tuple[dict, dict]:
    """The ratios (how many times lower TTFT is with the cache, how many times higher throughput), and
    whether each meets its goal."""
    ratios = {"ttft_p50": off["ttft_p50_s"] / on["ttft_p50_s"], "ttft_p95": off["ttft_p95_s"] / on["ttft_p95_s"],
              "tokens_per_cpu_s": on["tokens_per_cpu_s"] / off["tokens_per_cpu_s"],
              "tokens_per_s": on["tokens_per_s"] / off["tokens_per_s"]}
    return ratios, {name: ratios[name] >= goal for name, goal in GOALS.items()}


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    # The embedded model's Hugging Face directory in `--dtype` (the default model is its GGUF).
    loaded = Engine.from_config(EngineConfig(model=str(ensure_embedded_model()), dtype=args.dtype,
                                             scheduler=SchedulerConfig(max_num_seqs=args.concurrency),
                                             num_threads=args.threads))
    requests, sizes = make_workload(loaded.tokenizer, args)
    token_ids_of_runs: list[list[list[int]]] = []
    runs = {mode: lambda on=on: measure(loaded, requests, args, on, token_ids_of_runs) for mode, on in MODES.items()}
    results = median_of_interleaved(runs, args.repeats)
    ratios, goals_met = compare(results["off"], results["on"])
    report = {
        "environment": {"cpu": cpu_model_name(), "threads": args.threads, "dtype": loaded.dtype_name,
                        "kernel_backend": loaded.kernel_backend, "torch": torch.__version__},
        "workload": {"num_requests": args.num_requests, "concurrency": args.concurrency, "new_tokens": args.new_tokens,
                     "adapters": list(AUDIENCES), "repeats": args.repeats, "seed": args.seed, **sizes},
        **results, "ratios": ratios, "goals": GOALS, "goals_met": goals_met,
        "token_mismatches": count_token_mismatches(token_ids_of_runs),
        "peak_rss_mib": peak_rss_mib(),
    }
    log_report(report)
    stem = results_stem("prefix", report["environment"]["dtype"], f"{args.threads}t", quick=args.quick)
    write_results(report, args.results_dir, stem)
    if loaded.dtype_name == "float32":  # in bf16 chunk boundaries alone change tokens (module docstring)
        assert report["token_mismatches"] == 0, "greedy tokens differ with the cache on: wrong-adapter hits?"
    return report


def log_report(report: dict) -> None:
    env, work = report["environment"], report["workload"]
    logger.info("%s, %d thread(s), %s, %s backend", env["cpu"], env["threads"], env["dtype"], env["kernel_backend"])
    logger.info("%d chat requests, %d in flight, %d new tokens each, over %s; system prompts of %s tokens "
                "(the first %d shared by all), questions of %d-%d tokens, prompts of %d-%d tokens",
                work["num_requests"], work["concurrency"], work["new_tokens"], ", ".join(work["adapters"]),
                "/".join(str(n) for n in work["system_prompt_tokens"].values()), work["shared_preamble_tokens"],
                work["question_tokens"]["min"], work["question_tokens"]["max"],
                report["off"]["prompt_tokens_min"], report["off"]["prompt_tokens_max"])
    for mode in MODES:
        figures = report[mode]
        logger.info("cache %-3s: TTFT p50 %.3f s, p95 %.3f s; %.1f tokens/CPU-s, %.1f tokens/s wall; %.0f%% of prompt "
                    "tokens from the cache", mode, figures["ttft_p50_s"], figures["ttft_p95_s"],
                    figures["tokens_per_cpu_s"], figures["tokens_per_s"], 100 * figures["cached_fraction"])
    ratios, met = report["ratios"], report["goals_met"]
    for name, label in RATIO_LABELS.items():
        goal = report["goals"].get(name)
        verdict = f" (goal {goal:g}x: {'met' if met[name] else 'NOT met'})" if goal else ""
        logger.info("%s: %.2fx%s", label, ratios[name], verdict)
    if report["environment"]["dtype"] == "float32":
        logger.info("wrong-adapter hits: %d (run, request) pairs whose greedy tokens differ from the first cache-off "
                    "run's (must be 0)", report["token_mismatches"])
    else:
        logger.info("%d (run, request) pairs' greedy tokens differ from the first cache-off run's: not a wrong-adapter "
                    "check in %s, where chunk boundaries alone change tokens (run it in float32)",
                    report["token_mismatches"], report["environment"]["dtype"])
    logger.info("peak RSS %.0f MiB", report["peak_rss_mib"])




if __name__ == "__main__":
    main()
