"""`benchmarks.threads`' command line: `--layers` cuts the random model of Llama-3.2-1B's shape only;
and the benchmarks that share that model start as modules (peers and threads once imported each other)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks import threads as threads_benchmark


def test_layers_is_taken_with_the_random_model() -> None:
    args = threads_benchmark.parse_args(["--random-llama-1b", "--layers", "2"])
    assert args.random_llama_1b and args.layers == 2


@pytest.mark.parametrize("argv", [["--layers", "2"], ["--random-llama-1b", "--layers", "0"]])
def test_layers_without_the_random_model_or_below_one_is_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        threads_benchmark.parse_args(argv)


@pytest.mark.parametrize("module", ["benchmarks.peers", "benchmarks.threads", "benchmarks.load_memory",
                                    "benchmarks.models"])
def test_the_benchmark_starts_as_a_module(module: str) -> None:
    completed = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "--help" in completed.stdout
