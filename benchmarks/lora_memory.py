"""How much of the LoRA op's cost is reading adapter pages: each projection's op reading the same
pages call after call against the same op reading another layer's pages each call, the rate at which
it reads them then, and its arithmetic rate with the pages in cache.

    python -m benchmarks.lora_memory [--threads 1] [--dtype bfloat16] [--quick]

Three batches on the embedded model's projections (qkv, o, gate_up, down of SmolLM2-135M), ranks 8,
16, 32 and 64 in turn on every projection, as the engine's adapter pool holds them (each adapter in
its own pages, scattered):
- "W decode": 64 tokens, 8 adapters of 8 tokens each (workload W of `benchmarks.engine`);
- "W prefill": 2560 tokens, 8 adapters of 320 (W's 64 prompts of ~40 tokens, sorted by adapter);
- "one token each": 128 tokens, each its own adapter (`benchmarks.adapters` at 1024 registered).
"same pages": every call reads one set of pages, as cached as the machine's caches allow (W's
0.6-2 MB a call stay in a core's L2 or the shared L3 on the CPUs this was written on; the second
batch's 9-32 MB do not). "next layer's": each call reads the next of `page_sets` sets, together at
least twice a 32 MB last-level cache, as a decode step's 30 layers read theirs. The rate is the
bytes the op needs (each adapter's own rank) over the next-layer time, printed beside a plain
streaming read (`benchmarks.roofline.measure_read_rate`); the arithmetic rate is the op's multiply-adds
(each token at its adapter's rank) over the same-pages time.
The base projection is not run: these are the op's own costs (the op requests each segment's pages
while the segment before computes). Each figure is the minimum over interleaved rounds (`benchmarks.kernels.make_timer`:
the machine is shared, other jobs only add time). Last line: JSON.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
from dataclasses import dataclass

import torch

import kernels
from benchmarks import options
from benchmarks.kernels import make_timer
from benchmarks.roofline import measure_read_rate
from kernels.lora.layouts import ModuleShape, pages_for_rank
from kernels.lora.plans import LoraSlice, PageTable

LOG = logging.getLogger("benchmarks.lora_memory")
RANKS = (8, 16, 32, 64)
# SmolLM2-135M's fused projections: input width, output width of each slice.
PROJECTIONS = {"qkv": (576, (576, 192, 192)), "o": (576, (576,)), "gate_up": (576, (1536, 1536)), "down": (1536, (576,))}


@dataclass(frozen=True)
class Batch:
    name: str
    num_tokens: int
    num_adapters: int
    page_sets: int  # the next-layer calls cycle through them: >= 64 MB of pages for each projection


BATCHES = (Batch("W decode", 64, 8, 120), Batch("W prefill", 2560, 8, 8), Batch("one token each", 128, 128, 8))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_threads(parser)
    options.add_dtype(parser)
    parser.add_argument("--seconds", type=float, default=0.5, help="timing budget per case (at least 5 interleaved rounds)")
    options.add_quick(parser, "5 rounds, 2 page sets, gate_up only")
    return parser.parse_args(argv)


def bench_projection(backend, dtype: torch.dtype, batch: Batch, projection: str, page_sets: int, timer,
                     seed: int = 0) -> dict:
    """{"same_pages_s", "next_layer_s", "bytes", "flops"}: one call's time each way, the bytes it needs
    and its floating-point operations."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    hidden_in, widths = PROJECTIONS[projection]
    shapes = [ModuleShape(hidden_in, width) for width in widths]
    layout = backend.lora_layout(dtype, shapes)
    ranks = [RANKS[i % len(RANKS)] for i in range(batch.num_adapters)]
    num_pages = sum(pages_for_rank(r) for r in ranks)
    order = rng.sample(range(num_pages), num_pages)  # the pool's pages in no particular order
    taken = iter(order)
    pages = [tuple(next(taken) for _ in range(pages_for_rank(r))) for r in ranks]
    pools = [layout.allocate(page_sets, num_pages, shape, backend.device) for shape in shapes]
    for a, b in pools:
        a.normal_(generator=gen)
        b.normal_(generator=gen)
    starts = [sum(widths[:i]) for i in range(len(widths) + 1)]
    per_layer = [[LoraSlice(f"m{i}", a[layer], b[layer], starts[i], starts[i + 1]) for i, (a, b) in enumerate(pools)]
                 for layer in range(page_sets)]
    entries = sorted(i % batch.num_adapters for i in range(batch.num_tokens))
    tables = {f"m{i}": PageTable(tuple(ranks), tuple(pages)) for i in range(len(widths))}
    plan = backend.plan_lora(layout, entries, tables)
    x = torch.randn(batch.num_tokens, hidden_in, generator=gen).to(dtype)
    y = torch.zeros(batch.num_tokens, starts[-1], dtype=dtype)
    runs = {"same_pages": lambda: [backend.add_lora(y, x, per_layer[0], plan) for _ in range(page_sets)],
            "next_layer": lambda: [backend.add_lora(y, x, per_layer[layer], plan) for layer in range(page_sets)]}
    best = {name: figures["min"] / page_sets for name, figures in timer(runs).items()}
    width = hidden_in * len(widths) + starts[-1]  # A's and B's elements per rank row
    flops = sum(2 * ranks[entry] * width for entry in entries)
    return {"same_pages_s": best["same_pages"], "next_layer_s": best["next_layer"],
            "bytes": sum(ranks) * width * dtype.itemsize, "flops": flops}


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.dtype = options.resolved_dtype(args.dtype)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    backend = kernels.backend_for(torch.device("cpu"))
    timer = make_timer(torch.device("cpu"), 0.0 if args.quick else args.seconds)
    projections = ["gate_up"] if args.quick else list(PROJECTIONS)
    LOG.info("backend %s, %s, %d thread(s)", backend.label, args.dtype, args.threads)
    rows = []
    for batch in BATCHES:
        for projection in projections:
            figures = bench_projection(backend, dtype, batch, projection, 2 if args.quick else batch.page_sets, timer)
            rows.append({"batch": batch.name, "projection": projection, **figures,
                         "read_gb_per_s": figures["bytes"] / figures["next_layer_s"] / 1e9,
                         "gflop_per_s": figures["flops"] / figures["same_pages_s"] / 1e9})
            LOG.info("%-15s %-8s same pages %8.1f us (%4.0f GFLOP/s)   next layer's %8.1f us (%.2fx)   %5.1f MB at %5.1f GB/s",
                     batch.name, projection, 1e6 * figures["same_pages_s"], rows[-1]["gflop_per_s"],
                     1e6 * figures["next_layer_s"], figures["next_layer_s"] / figures["same_pages_s"],
                     figures["bytes"] / 1e6, rows[-1]["read_gb_per_s"])  # fmt: skip
    stream = measure_read_rate()
    LOG.info("streaming read of 512 MiB: %.1f GB/s", stream / 1e9)
    report = {"threads": args.threads, "dtype": args.dtype, "backend": backend.label, "rows": rows,
              "streaming_read_gb_per_s": stream / 1e9}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
