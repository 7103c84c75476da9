"""`python -m benchmarks.threads` end to end on a tiny workload: each workload at 1 and 2 threads,
speed-ups over the one-thread run, the serial share of a step that the engine measured and the
Amdahl projections from it."""
from __future__ import annotations

import pytest

from benchmarks import threads as threads_benchmark

pytestmark = pytest.mark.slow


def test_threads_benchmark_reports_speedups_and_the_serial_share() -> None:
    report = threads_benchmark.main(["--threads", "2", "--num-requests", "2", "--new-tokens", "3", "--adapters", "1",
                                     "--repeats", "1"])
    assert report["threads"] == [1, 2]
    for name in ("base", "W"):
        summary = report["ours"][name]
        runs = summary["by_threads"]
        assert runs[1]["speedup"] == 1.0 and runs[1]["tokens"] == 2 * 3
        assert runs[2]["speedup"] == pytest.approx(runs[2]["tokens_per_s"] / runs[1]["tokens_per_s"])
        assert runs[1]["steps"] >= 3 and all(seconds > 0 for seconds in runs[1]["phase_s"].values())
        serial = summary["serial_fraction"]
        assert 0 < serial < 1 and summary["amdahl"][16] == pytest.approx(1 / (serial + (1 - serial) / 16))
        assert 0 <= summary["fitted_serial_fraction"] <= 1 and runs[2]["load_before"] >= 0
