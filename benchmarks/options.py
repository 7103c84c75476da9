"""The options every benchmark shares, each defined once with one default: `--threads`, `--dtype`,
`--repeats`, `--num-requests`, `--new-tokens` and `--quick` (whose cut each benchmark describes).
A benchmark adds the ones it takes; its own options stay in its module."""
from __future__ import annotations

import argparse

DEFAULT_THREADS = 1  # one core: the figures compare forms and engines, not the machine's width
DEFAULT_DTYPE = "auto"  # as the server resolves it (lora_runtime.dtypes.resolve_dtype)
DEFAULT_REPEATS = 3  # interleaved runs; the median is kept
DEFAULT_NUM_REQUESTS = 64
DEFAULT_NEW_TOKENS = 64
DTYPE_CHOICES = ("auto", "float32", "bfloat16")


def add_threads(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                        help=f"compute threads (default {DEFAULT_THREADS})")


def add_dtype(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=DEFAULT_DTYPE,
                        help=f"the model's or the ops' dtype (default {DEFAULT_DTYPE}: bf16 where this CPU's "
                             "compiled matmuls multiply it at float32's rate or better, else float32)")


def add_repeats(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                        help=f"interleaved runs per configuration; the median is kept (default {DEFAULT_REPEATS})")


def add_workload(parser: argparse.ArgumentParser) -> None:
    """`--num-requests` and `--new-tokens`: how many requests, and how many tokens each generates."""
    parser.add_argument("--num-requests", type=int, default=DEFAULT_NUM_REQUESTS,
                        help=f"requests (default {DEFAULT_NUM_REQUESTS})")
    parser.add_argument("--new-tokens", type=int, default=DEFAULT_NEW_TOKENS,
                        help=f"tokens each request generates (default {DEFAULT_NEW_TOKENS})")


def add_quick(parser: argparse.ArgumentParser, cut: str) -> None:
    """`--quick`: a small run for tests and smoke checks; `cut` says what it runs."""
    parser.add_argument("--quick", action="store_true", help=f"a small run: {cut}")


def add_random_llama(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--random-llama-1b", action="store_true",
                        help="a random-weight model of Llama-3.2-1B's shape instead of the embedded model (slow)")
    parser.add_argument("--layers", type=int, default=None,
                        help="with --random-llama-1b: that many layers instead of its 16 (a quick check)")


def parse_random_llama(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The parsed arguments, `--layers` refused without `--random-llama-1b` or below one."""
    args = parser.parse_args(argv)
    if args.layers is not None and (not args.random_llama_1b or args.layers < 1):
        parser.error("--layers takes a positive count, with --random-llama-1b")
    return args


def resolved_dtype(requested: str, device: str = "cpu") -> str:
    """`--dtype` as the engine would load it ("auto" resolved for this machine)."""
    from lora_runtime.dtypes import resolve_dtype  # torch: only the benchmarks that resolve pay for it

    return resolve_dtype(requested, device)[0]
