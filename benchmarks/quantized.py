"""Quantized base models against bf16, one thread, measured in the same run.

    python -m benchmarks.quantized [--num-requests 1,32] [--new-tokens 32] [--repeats 3] [--kernels]
                                   [--random-llama-1b [--layers N]]

The embedded model three ways: its Hugging Face directory in bf16 (the engine's default), its shipped
GGUF (Q4_1 projections, a Q8_0 embedding) and that file re-quantized to Q8_0 (`requantize_gguf`: the
gguf package quantizes Q8_0, Q4_0 and Q4_1 only), both served as they are
(`EngineConfig(model="x.gguf")`). Each configuration runs `--repeats` times, interleaved, and its
median run is kept; tokens per CPU-second and the ratio against bf16 are printed for each number of
concurrent requests, the last line one JSON object.

`--kernels`: the compiled matmuls over quantized blocks (int8 dot products with and without VNNI, the
weights widened to bf16 inside the tiles, and the AMX-INT8 tiles where present) against the bf16
compiled matmul, on one projection of Llama-3.2-1B's MLP shape (8192 x 2048) at 1-64 rows, weights
cycled from memory: the measurement behind the row thresholds `tuning.QUANTIZED_INT8_MAX_ROWS`,
`QUANTIZED_AMX_ROWS_Q8_0` and `QUANTIZED_AMX_ROWS_UNPACKED`.

`--random-llama-1b` (`--layers N` cuts it): the random-weight model of Llama-3.2-1B's shape, whose
weights outgrow the caches, in bf16 and as Q8_0 and Q4_K_M GGUF files made by llama.cpp's tools, each
against the floor of reading its weights at one request, at `--num-requests`, and its peak RSS
against the file plus the configured KV cache and adapter pools (`benchmarks.quantized_floor`).
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, dequantize, quantize

from benchmarks import options
from benchmarks.engine import NO_PREFIX_CACHE, make_prompts, median_of_interleaved, run_ours
from benchmarks.quantized_floor import run_random_llama
from kernels import cpu_ops, tuning
from kernels.linear import linear_packed, pack_linear_weight
from kernels.quantized import BLOCK_TYPES, QuantizedTensor
from lora_runtime import Engine, EngineConfig
from lora_runtime.embedded import default_cache_dir, ensure_embedded_model, gguf_path

logger = logging.getLogger("benchmarks.quantized")
_QUANTIZED = {GGMLQuantizationType[name] for name in BLOCK_TYPES}
_HEADER_KEYS = ("GGUF.", "general.architecture")  # written by GGUFWriter itself


def requantize_gguf(source: Path, destination: Path, type_name: str) -> Path:
    """`source` with every quantized tensor dequantized and quantized again as `type_name` (its
    metadata and other tensors as they are); kept once written."""
    if destination.exists():
        return destination
    reader = GGUFReader(source)
    architecture = reader.fields["general.architecture"].contents()
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_suffix(".partial")
    writer = GGUFWriter(partial, architecture)
    for field in reader.fields.values():
        if not field.name.startswith(_HEADER_KEYS):
            sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
    target = GGMLQuantizationType[type_name]
    for tensor in reader.tensors:
        if tensor.tensor_type in _QUANTIZED:
            values = dequantize(tensor.data, tensor.tensor_type)
            writer.add_tensor(tensor.name, quantize(values, target), raw_dtype=target)
        else:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(destination)
    return destination


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", default="1,32", help="comma-separated concurrent request counts")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kernels", action="store_true", help="the matmul alone, at 1-64 rows")
    options.add_random_llama(parser)
    args = options.parse_random_llama(parser, argv)
    if args.random_llama_1b and args.new_tokens < 2:
        parser.error("--new-tokens takes 2 or more with --random-llama-1b (decode steps are timed)")
    return args


def models() -> dict[str, EngineConfig]:
    shipped = gguf_path()
    q8_0 = requantize_gguf(shipped, default_cache_dir() / "bench-quantized" / "smollm2-135m-instruct.Q8_0.gguf", "Q8_0")
    common = {"dtype": "bfloat16", "kv_cache": NO_PREFIX_CACHE, "num_threads": 1}
    return {"bf16": EngineConfig(model=str(ensure_embedded_model()), **common),
            "q4_1": EngineConfig(model=str(shipped), **common),
            "q8_0": EngineConfig(model=str(q8_0), **common)}


def run_engines(args: argparse.Namespace) -> dict:
    engines = {name: Engine.from_config(config) for name, config in models().items()}
    tokenizer = engines["bf16"].tokenizer
    report = {}
    for count in _counts(args):
        prompts = make_prompts(tokenizer, count)
        runs = {name: (lambda e=engine: run_ours(e, prompts, args.new_tokens)) for name, engine in engines.items()}
        figures = median_of_interleaved(runs, args.repeats)
        base = figures["bf16"]["tokens_per_cpu_s"]
        for name, figure in figures.items():
            figure["vs_bf16"] = figure["tokens_per_cpu_s"] / base
            logger.info("%d requests, %s: %.1f tokens/CPU-s (%.2fx bf16; runs %s)", count, name,
                        figure["tokens_per_cpu_s"], figure["vs_bf16"],
                        ", ".join(f"{r:.1f}" for r in figure["all_tokens_per_cpu_s"]))
        report[f"{count}_requests"] = figures
    return report


def _counts(args: argparse.Namespace) -> list[int]:
    return [int(count) for count in args.num_requests.split(",")]


def _time_per_call(run, copies: int, repeats: int = 12) -> float:
    """The least CPU seconds of `repeats` calls of run(copy), the copies taken in turn (so that the
    weights come from memory, as a model's layers do, not from the cache the previous call filled).
    The least, not the mean: on a shared machine a call slowed by a neighbour says nothing of the kernel."""
    run(0)
    least = float("inf")
    for repeat in range(repeats):
        start = time.process_time()
        run(repeat % copies)
        least = min(least, time.process_time() - start)
    return least


def _weight_copies(out_features: int, in_features: int, copies: int) -> dict:
    """`copies` copies of one random projection: packed bf16 for the compiled matmul, and Q8_0 and
    Q4_K blocks of the same shape."""
    dense = torch.randn(out_features, in_features) * 0.02
    q8_0 = torch.from_numpy(quantize(dense.numpy(), GGMLQuantizationType.Q8_0))
    q4_k = BLOCK_TYPES["Q4_K"]  # gguf cannot quantize K-quants: random valid blocks of the same size
    q4_k_bytes = np.random.default_rng(0).integers(
        0, 16, (out_features, in_features // q4_k.block_elements * q4_k.block_bytes), dtype=np.uint8)
    weights = {"bf16": [pack_linear_weight(dense.bfloat16()) for _ in range(copies)]}
    for name, blocks in (("Q8_0", q8_0), ("Q4_K", torch.from_numpy(q4_k_bytes))):
        weights[name] = [QuantizedTensor(BLOCK_TYPES[name], blocks.clone(), in_features) for _ in range(copies)]
    return weights


def run_kernels(out_features: int = 8192, in_features: int = 2048, copies: int = 12) -> dict:
    """ms per call of one projection at 1-64 rows, its weights cycled over `copies` copies (bf16 copies
    beyond the last-level cache): the bf16 compiled matmul, and each compiled path over Q8_0 and Q4_K
    blocks (int8 dot products with and without VNNI, the widened tiles, the AMX-INT8 tiles where this
    CPU and form have them), called directly whatever the row thresholds of kernels/tuning.py say."""
    ops = cpu_ops.ops()
    weights = _weight_copies(out_features, in_features, copies)
    report = {}
    for rows in (1, 4, 8, 16, 32, 64):
        x = torch.randn(rows, in_features).bfloat16()
        out = torch.empty(rows, out_features, dtype=torch.bfloat16)
        figures = {"bf16": _time_per_call(lambda i: linear_packed(x, weights["bf16"][i]), copies)}
        for name in ("Q8_0", "Q4_K"):
            paths = {"int8": ops.quantized_linear, "widened": ops.quantized_linear_widened}
            if ops.has_quantized_amx():
                paths["amx_int8"] = ops.quantized_linear_amx
            for path, kernel in paths.items():
                figures[f"{name}_{path}"] = _time_per_call(
                    lambda i: kernel(out, x, weights[name][i].data, weights[name][i].block_type.ggml_type), copies)
            with cpu_ops.without_vnni():
                figures[f"{name}_int8_no_vnni"] = _time_per_call(
                    lambda i: ops.quantized_linear(out, x, weights[name][i].data, weights[name][i].block_type.ggml_type),
                    copies)
        report[rows] = {name: seconds * 1e3 for name, seconds in figures.items()}
        logger.info("%d rows: %s (ms per call; int8 up to %d rows; AMX-INT8 Q8_0 %s, other types %s)", rows,
                    ", ".join(f"{n} {seconds * 1e3:.2f} ({figures['bf16'] / seconds:.2f}x bf16)" for n, seconds in figures.items()),
                    tuning.QUANTIZED_INT8_MAX_ROWS, tuning.QUANTIZED_AMX_ROWS_Q8_0, tuning.QUANTIZED_AMX_ROWS_UNPACKED)
    return report


def main(argv=None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    torch.set_num_threads(1)
    logger.info("compiled CPU ops: form %s, int8 dot products: %s", cpu_ops.active_form(), cpu_ops.ops().quantized_int8_dot())
    if args.kernels:
        report = run_kernels()
    elif args.random_llama_1b:
        report = run_random_llama(args.layers, _counts(args), args.new_tokens, args.repeats)
    else:
        report = run_engines(args)
    print(json.dumps(report, default=str))
    return report


if __name__ == "__main__":
    main()
