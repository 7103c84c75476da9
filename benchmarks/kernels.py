"""Kernel benchmark: multi-adapter LoRA against two naive baselines, paged attention, and (on CPUs
with AMX or AVX512-BF16) the compiled bf16 matmuls of the projections against oneDNN.

    python -m benchmarks.kernels [--threads 1] [--dtype float32] [--quick] [--form avx2] [--device cuda]

Every op runs on the device's backend (`kernels.backend_for`; on CPU the compiled ops in the best
form this CPU runs, or the one `--form` names). LoRA: our `add_lora` against (a) a per-adapter Python loop (mask, gather, two matmuls,
scatter) and (b) per-token gather of the weights + bmm, over hidden sizes, ranks, batch sizes and
adapter counts with uniform and skewed popularity, and its overhead as a fraction of the base
projection's matmul, measured as (base matmul then add_lora) / (base matmul alone) - 1, with
the minimum over interleaved rounds of each (see `make_timer`). Tokens are sorted by adapter, as the engine does,
and the adapters are held as the engine's pool holds them (each in its own pages, in the backend's layout). On CUDA the timings use
`triton.testing.do_bench`, on CPU with `time.perf_counter`. Prints a table and writes JSON
and a PNG plot to benchmarks/results/.

Projections: SmolLM2 shapes at 1-256 rows, each call on the next of 8 copies of the weight (the
copies exceed the L2 cache, as a decode step's 30 layers do), `kernels.linear.linear_packed` with
each kernel this CPU's form runs against the library: oneDNN's prepacked bf16 matmul (which the CPU
backend no longer keeps: each projection is held once, in its kernel's layout), F.linear (MKL's
sgemm) in float32.

Bandwidth: the device's copy rate is measured first (a 1 GiB copy on CUDA, 256 MiB on CPU; bytes
read plus bytes written per second), and each LoRA and attention row gives the bytes its call must
move (x and the adapters' pages read, y read and written; q read, out written, every context's keys
and values read) over its time, as a fraction of that rate: on a GPU these ops are memory-bound, so
the fraction is how close to the hardware they run. `--device` picks the device (default: CUDA where
there is one), `--backend` forces a backend (`triton` on CPU runs the kernels in the interpreter,
under TRITON_INTERPRET=1), `--tiny` runs one small case of each (a smoke run), `--out-dir` says where
the JSON and the plot go."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

import kernels
from kernels import cpu_ops
from kernels.linear import KIND_DTYPES, available_kinds, linear_packed, pack_linear_weight
from kernels.lora.layouts import PAGE_ROWS, ModuleShape, pages_for_rank
from kernels.lora.plans import LoraSlice, PageTable

from benchmarks import options
from benchmarks.results_writer import RESULTS_DIR, results_stem, write_results

LOG = logging.getLogger("benchmarks.kernels")
# (hidden_in, out): SmolLM2-135M's MLP up projection and a 7B-class square projection.
PROJECTIONS = [(576, 1536), (4096, 4096)]
RANKS = [8, 16, 64]
NUM_TOKENS = [1, 8, 64, 256]
NUM_ADAPTERS = [1, 8, 64]
POPULARITY = ["uniform", "skewed"]
# The per-token gather baseline copies each token's weights; skip it past this many bytes.
MAX_GATHER_BYTES = 256 * 2**20
GOAL = {"hidden_in": 576, "num_tokens": 64, "num_adapters": 8, "max_rank": 16, "max_overhead": 0.15}


@dataclass(frozen=True, slots=True)
class LoraCase:
    hidden_in: int
    out: int
    rank: int
    num_tokens: int
    num_adapters: int
    popularity: str


def lora_cases(quick: bool) -> list[LoraCase]:
    projections = PROJECTIONS[:1] if quick else PROJECTIONS
    ranks = [8, 16] if quick else RANKS
    return [
        LoraCase(hidden, out, rank, tokens, adapters, popularity)
        for hidden, out in projections
        for rank in ranks
        for tokens in NUM_TOKENS
        for adapters in NUM_ADAPTERS
        for popularity in POPULARITY
        if adapters <= max(tokens, 1) and not (popularity == "skewed" and adapters == 1)
    ]


Timings = dict[str, dict[str, float]]


def make_timer(device: torch.device, seconds: float, min_rounds: int = 5) -> Callable[[dict[str, Callable[[], object]]], Timings]:
    """Times several functions, interleaved round by round, -> {name: {"min": s, "median": s}}.

    On CUDA: triton.testing.do_bench per function. On CPU: perf_counter per call, >= `min_rounds` rounds and
    about `seconds` per case. The machine this was written on is shared, and other jobs only ever add time:
    the minimum is the stable figure, the median is kept to show the spread."""
    if device.type == "cuda":
        import triton.testing

        return lambda fns: {name: dict.fromkeys(("min", "median"), triton.testing.do_bench(fn) / 1e3) for name, fn in fns.items()}

    def cpu_timer(fns: dict[str, Callable[[], object]]) -> Timings:
        samples: dict[str, list[float]] = {name: [] for name in fns}
        deadline = time.perf_counter() + seconds
        while min(len(s) for s in samples.values()) < min_rounds or time.perf_counter() < deadline:
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - start)
        return {name: {"min": min(s[1:] or s), "median": statistics.median(s)} for name, s in samples.items()}

    return cpu_timer


def tiny_lora_cases() -> list[LoraCase]:
    return [LoraCase(64, 96, 16, 6, 2, "uniform")]


def measure_copy_rate(device: torch.device, timer) -> float:
    """Bytes read plus bytes written per second of one large device-to-device copy."""
    num_bytes = 2**30 if device.type == "cuda" else 2**28
    source = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    seconds = timer({"copy": lambda: target.copy_(source)})["copy"]["min"]
    return 2 * num_bytes / seconds


def lora_bytes(case: LoraCase, element_size: int, num_used_adapters: int) -> int:
    """What one add_lora call must move: x read, y read and written, each used adapter's pages read."""
    pages = num_used_adapters * pages_for_rank(case.rank) * PAGE_ROWS * (case.hidden_in + case.out)
    return element_size * (case.num_tokens * (case.hidden_in + 2 * case.out) + pages)


def attention_bytes(q: torch.Tensor, k_cache: torch.Tensor, seq_lens: list[int]) -> int:
    """What one paged-attention call must move: q read, the output written, every context's K and V read."""
    kv_per_token = k_cache.shape[2] * k_cache.shape[3]
    return q.element_size() * (2 * q.numel() + 2 * sum(seq_lens) * kv_per_token)


def token_slots(case: LoraCase, gen: torch.Generator) -> torch.Tensor:
    if case.popularity == "uniform":
        slots = torch.randint(0, case.num_adapters, (case.num_tokens,), generator=gen)
    else:  # skewed: half the tokens on adapter 0, the rest spread over the others
        slots = torch.randint(1, case.num_adapters, (case.num_tokens,), generator=gen)
        slots[torch.rand(case.num_tokens, generator=gen) < 0.5] = 0
    return slots.sort().values


def adapter_loop(y, x, lora_a, lora_b, slots) -> None:
    """Baseline (a): one masked gather / matmul / scatter per adapter in the pool."""
    for slot in range(lora_a.shape[0]):
        rows = torch.nonzero(slots == slot).flatten()
        if rows.numel():
            delta = (x.index_select(0, rows).to(lora_a.dtype) @ lora_a[slot].T) @ lora_b[slot].T
            y.index_add_(0, rows, delta.to(y.dtype))


def gather_bmm(y, x, lora_a, lora_b, slots) -> None:
    """Baseline (b): gather every token's weights, two batched matmuls."""
    shrunk = torch.bmm(lora_a.index_select(0, slots), x.to(lora_a.dtype).unsqueeze(-1))  # [T, R, 1]
    delta = torch.bmm(lora_b.index_select(0, slots), shrunk).squeeze(-1)  # [T, out]
    y.add_(delta.to(y.dtype))


def bench_lora_case(case: LoraCase, dtype: torch.dtype, backend: kernels.Backend, timer, copy_rate: float) -> dict:
    device = backend.device
    gen = torch.Generator().manual_seed(0)
    slots = token_slots(case, gen).to(device)
    x = torch.randn(case.num_tokens, case.hidden_in, generator=gen).to(device, dtype)
    weight = torch.randn(case.out, case.hidden_in, generator=gen).to(device, dtype) / case.hidden_in**0.5
    # The adapters as the engine's pool holds them: each in its own pages (scattered over the pool,
    # in reverse order), in the backend's layout for the model's dtype; the scaling folded into B.
    shape = ModuleShape(case.hidden_in, case.out)
    layout = backend.lora_layout(dtype, [shape])
    per_adapter = pages_for_rank(case.rank)
    num_pages = case.num_adapters * per_adapter
    a_pages, b_pages = layout.allocate(1, num_pages, shape, device)
    page_lists = [tuple(num_pages - 1 - (e * per_adapter + i) for i in range(per_adapter)) for e in range(case.num_adapters)]
    for pages in page_lists:
        layout.write(a_pages, b_pages, pages, torch.randn(1, case.rank, case.hidden_in, generator=gen),
                     0.5 * torch.randn(1, case.out, case.rank, generator=gen))
    dense = [layout.read(a_pages, b_pages, pages, case.rank) for pages in page_lists]
    dense_a = torch.cat([a for a, _ in dense]).to(dtype)
    dense_b = torch.cat([b for _, b in dense]).to(dtype)
    y = torch.zeros(case.num_tokens, case.out, device=device, dtype=dtype)
    slot_list = slots.tolist()
    tables = {"proj": PageTable((case.rank,) * case.num_adapters, tuple(page_lists))}
    lora_slices = [LoraSlice("proj", a_pages[0], b_pages[0], 0, case.out)]
    plan = backend.plan_lora(layout, slot_list, tables)
    linear = backend.linear(weight)
    fns = {
        "base": lambda: linear(x),
        "ours": lambda: backend.add_lora(y, x, lora_slices, plan),
        # Right after the base matmul, as in the model: its weights push the adapters' out of cache.
        "base_then_ours": lambda: backend.add_lora(linear(x), x, lora_slices, plan),
        "adapter_loop": lambda: adapter_loop(y, x, dense_a, dense_b, slots),
        "plan_build": lambda: backend.plan_lora(layout, slot_list, tables),
    }
    gather_bytes = case.num_tokens * case.rank * (case.hidden_in + case.out) * x.element_size()
    if gather_bytes <= MAX_GATHER_BYTES:
        fns["gather_bmm"] = lambda: gather_bmm(y, x, dense_a, dense_b, slots)
    timings = timer(fns)
    row = dataclasses.asdict(case) | {"timings": timings}
    row.update({f"{name}_s": t["min"] for name, t in timings.items()})
    row.setdefault("gather_bmm_s", None)
    row["overhead"] = row["base_then_ours_s"] / row["base_s"] - 1.0
    row["lora_over_base"] = row["ours_s"] / row["base_s"]
    row["bytes_moved"] = lora_bytes(case, x.element_size(), len(set(slot_list)))
    row["of_copy_rate"] = row["bytes_moved"] / row["ours_s"] / copy_rate
    return row


def attention_cases(tiny: bool) -> list[tuple[str, list[int], list[int]]]:
    """(name, new tokens per sequence, context lengths): the engine's common step, 64 decode sequences
    of 20-150 tokens, with and without two prefill chunks (`tiny`: 4 sequences of 5-32, short prefills)."""
    gen = torch.Generator().manual_seed(0)
    num_decode, lens, prefills = (4, (5, 33), ([4, 2], [8, 12])) if tiny else (64, (20, 151), ([256, 128], [256, 400]))
    decode_lens = torch.randint(*lens, (num_decode,), generator=gen).tolist()
    return [(f"decode{num_decode}", [1] * num_decode, decode_lens),
            (f"decode{num_decode}+prefill2", [1] * num_decode + prefills[0], decode_lens + prefills[1])]


def bench_attention(dtype: torch.dtype, backend: kernels.Backend, timer, copy_rate: float, tiny: bool = False) -> list[dict]:
    """Each of `attention_cases` with SmolLM2-135M heads (9 query / 3 KV, head_dim 64), block 16."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, q_lens, seq_lens in attention_cases(tiny):
        q, k_cache, v_cache, step = _paged_batch(q_lens, seq_lens, dtype, backend.device, gen)
        plan = backend.plan_attention(step)
        timings = timer({"attention": lambda: backend.paged_attention(q, k_cache, v_cache, plan, 0.125),
                         "build": lambda: backend.plan_attention(step)})
        layer, build = timings["attention"]["min"], timings["build"]["min"]
        moved = attention_bytes(q, k_cache, seq_lens)
        rows.append({"case": name, "per_layer_s": layer, "plan_build_s": build, "per_step_30_layers_s": 30 * layer + build,
                     "bytes_moved": moved, "of_copy_rate": moved / layer / copy_rate})
    return rows


def bench_projections(timer) -> list[dict]:
    """Each compiled matmul of the active form (`kernels.linear.available_kinds`) against the library
    the backend would call otherwise: oneDNN prepacked for the bf16 ones, F.linear (MKL's sgemm) for
    the float32 one; per call, weights cycled over 8 copies; [] where there is none."""
    rows = []
    for in_features, out_features in [(576, 3072), (1536, 576), (576, 49152)]:
        for kind in available_kinds():
            dtype = KIND_DTYPES[kind]
            weights = [torch.randn(out_features, in_features, dtype=dtype) for _ in range(8)]
            library = _library_matmul(weights)
            packed = [pack_linear_weight(w, kind) for w in weights]
            for num_rows in (1, 16, 64, 96, 128, 256):
                x = torch.randn(num_rows, in_features, dtype=dtype)
                timings = timer({"compiled": lambda: [linear_packed(x, p) for p in packed], "library": lambda: library(x)})
                rows.append({"kind": kind, "in": in_features, "out": out_features, "rows": num_rows,
                             "compiled_s": timings["compiled"]["min"] / 8, "library_s": timings["library"]["min"] / 8})
    return rows


def _library_matmul(weights: list[torch.Tensor]) -> Callable[[torch.Tensor], object]:
    if weights[0].dtype == torch.float32:
        return lambda x: [torch.nn.functional.linear(x, w) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    return lambda x: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in onednn]


def _paged_batch(q_lens, seq_lens, dtype, device, gen):
    block_size, kv_heads, head_dim = 16, 3, 64
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(sum(blocks_per_seq), generator=gen)
    tables, used = [], 0
    for count in blocks_per_seq:
        tables.append(order[used : used + count].tolist())
        used += count
    cache_shape = (sum(blocks_per_seq), block_size, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    q = torch.randn(sum(q_lens), 9, head_dim, generator=gen).to(device, dtype)
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    return q, k_cache, v_cache, kernels.StepSequences(starts, seq_lens, tables, block_size)


def log_lora_table(rows: list[dict]) -> None:
    LOG.info("%6s %5s %4s %6s %4s %8s | %9s %9s %9s %9s | %8s %8s %7s", "hidden", "out", "rank", "tokens", "adap",
             "popular", "base us", "ours us", "loop us", "gather us", "lora/base", "overhead", "of copy")  # fmt: skip
    for r in rows:
        gather = f"{r['gather_bmm_s'] * 1e6:9.0f}" if r["gather_bmm_s"] is not None else f"{'-':>9}"
        LOG.info("%6d %5d %4d %6d %4d %8s | %9.0f %9.0f %9.0f %s | %8.1f%% %7.1f%% %6.1f%%", r["hidden_in"], r["out"],
                 r["rank"], r["num_tokens"], r["num_adapters"], r["popularity"], r["base_s"] * 1e6, r["ours_s"] * 1e6,
                 r["adapter_loop_s"] * 1e6, gather, 100 * r["lora_over_base"], 100 * r["overhead"],
                 100 * r["of_copy_rate"])  # fmt: skip


def goal_rows(rows: list[dict]) -> list[dict]:
    return [
        r for r in rows
        if r["hidden_in"] == GOAL["hidden_in"] and r["num_tokens"] == GOAL["num_tokens"]
        and r["num_adapters"] == GOAL["num_adapters"] and r["rank"] <= GOAL["max_rank"]
    ]  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    selected = [r for r in rows if r["hidden_in"] == 576 and r["rank"] == 16 and r["popularity"] == "uniform"]
    for adapters in NUM_ADAPTERS:
        series = [r for r in selected if r["num_adapters"] == adapters]
        tokens = [r["num_tokens"] for r in series]
        axes[0].plot(tokens, [100 * r["overhead"] for r in series], marker="o", label=f"{adapters} adapters")
        for key, style in (("ours_s", "-"), ("adapter_loop_s", "--"), ("gather_bmm_s", ":")):
            points = [(r["num_tokens"], r[key] * 1e6) for r in series if r[key] is not None]
            axes[1].plot(*zip(*points), style, marker=".", label=f"{key[:-2]}, {adapters} adapters")
    axes[0].axhline(100 * GOAL["max_overhead"], color="grey", linestyle="--", label="goal")
    axes[0].set(xscale="log", xlabel="tokens", ylabel="LoRA time / base matmul (%)", title="576 -> 1536, rank 16")
    axes[1].set(xscale="log", yscale="log", xlabel="tokens", ylabel="us per call", title="ours vs baselines")
    axes[0].legend()
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_threads(parser)
    options.add_dtype(parser)
    options.add_quick(parser, "576-wide projection and ranks 8, 16 only")
    parser.add_argument("--seconds", type=float, default=0.5, help="CPU timing budget per case")
    parser.add_argument("--form", default=None, help="compiled CPU ops form (default: the best this CPU runs)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is one)")
    parser.add_argument("--backend", default=None, choices=kernels.BACKEND_NAMES, help="default: the device's")
    parser.add_argument("--tiny", action="store_true", help="one small case of each op (a smoke run)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR, help="where the JSON and the plot go")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.dtype = options.resolved_dtype(args.dtype, device.type)
    if args.form:
        with cpu_ops.using_form(args.form):
            run(args, device)
    else:
        run(args, device)


def run(args: argparse.Namespace, device: torch.device) -> None:
    dtype = getattr(torch, args.dtype)
    backend = kernels.backend_for(device, args.backend)
    timer = make_timer(device, args.seconds, min_rounds=2 if args.tiny else 5)
    copy_rate = measure_copy_rate(device, timer)
    LOG.info("backend %s, %s, %d thread(s); device copy rate %.0f GB/s (read + written)", backend.label, args.dtype,
             args.threads, copy_rate / 1e9)
    cases = tiny_lora_cases() if args.tiny else lora_cases(args.quick)
    rows = [bench_lora_case(case, dtype, backend, timer, copy_rate) for case in cases]
    log_lora_table(rows)
    for r in goal_rows(rows):
        verdict = "meets" if r["overhead"] <= GOAL["max_overhead"] else "misses"
        LOG.info("goal (<= 15%%): rank %d %s: %.1f%% -> %s", r["rank"], r["popularity"], 100 * r["overhead"], verdict)
    attention = bench_attention(dtype, backend, timer, copy_rate, args.tiny)
    for r in attention:
        LOG.info("paged attention %-18s %8.0f us/layer  plan %6.0f us  30 layers %6.1f ms  %.0f%% of the copy rate",
                 r["case"], r["per_layer_s"] * 1e6, r["plan_build_s"] * 1e6, r["per_step_30_layers_s"] * 1e3,
                 100 * r["of_copy_rate"])  # fmt: skip
    projections = bench_projections(timer) if backend.name == "cpu" and not args.tiny else []
    for r in projections:
        LOG.info("projection %4d -> %5d, %3d rows: %s %7.0f us  library %7.0f us  (%.2fx)", r["in"], r["out"],
                 r["rows"], r["kind"], r["compiled_s"] * 1e6, r["library_s"] * 1e6, r["library_s"] / r["compiled_s"])  # fmt: skip
    stem = results_stem("kernels", device.type, args.dtype, f"{args.threads}t", quick=args.quick) + ("_tiny" if args.tiny else "")
    environment = {"torch": torch.__version__, "threads": args.threads, "dtype": args.dtype, "backend": backend.label,
                   "device": device.type, "cpu": platform.processor() or platform.machine(),
                   "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                   "copy_bytes_per_s": copy_rate}  # fmt: skip
    payload = {"environment": environment, "lora": rows, "attention": attention, "projections": projections}
    # A tiny run is not plotted: the plot draws the 576-wide cases, which a tiny run has none of.
    write_results(payload, args.out_dir, stem, None if args.tiny else lambda path: plot(rows, path))


if __name__ == "__main__":
    main()
