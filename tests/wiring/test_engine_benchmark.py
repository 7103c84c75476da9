"""`python -m benchmarks.engine` end to end on a tiny workload (the baselines skipped): the report
holds each configuration's median of interleaved runs and the LoRA overhead computed from them."""
from __future__ import annotations

import pytest

from benchmarks import engine as engine_benchmark

pytestmark = pytest.mark.slow


def test_engine_benchmark_reports_interleaved_medians() -> None:
    report = engine_benchmark.main(
        ["--num-requests", "2", "--new-tokens", "3", "--repeats", "3", "--adapters", "1", "--skip-baseline"]
    )
    for name in ("ours", "ours_adapters"):
        runs = report[name]["all_tokens_per_cpu_s"]
        assert len(runs) == 3 and report[name]["tokens"] == 2 * 3
        assert report[name]["tokens_per_cpu_s"] == sorted(runs)[1]  # the median run
    expected = report["ours"]["tokens_per_cpu_s"] / report["ours_adapters"]["tokens_per_cpu_s"] - 1
    assert report["lora_overhead"] == pytest.approx(expected)
