"""`benchmarks.threads`' command line: `--layers` cuts the random model of Llama-3.2-1B's shape only."""
from __future__ import annotations

import pytest

from benchmarks import threads as threads_benchmark


def test_layers_is_taken_with_the_random_model() -> None:
    args = threads_benchmark.parse_args(["--random-llama-1b", "--layers", "2"])
    assert args.random_llama_1b and args.layers == 2


@pytest.mark.parametrize("argv", [["--layers", "2"], ["--random-llama-1b", "--layers", "0"]])
def test_layers_without_the_random_model_or_below_one_is_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        threads_benchmark.parse_args(argv)
