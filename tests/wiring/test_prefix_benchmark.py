"""`python -m benchmarks.prefix --quick` end to end: the same chat requests with the prefix cache off
and on, the second request of each adapter served its system prompt from the cache, the same greedy
tokens both ways, the ratios taken from the two runs, and the JSON it writes."""
from __future__ import annotations

import json

import pytest

from benchmarks import prefix as prefix_benchmark

pytestmark = pytest.mark.slow


def test_prefix_benchmark_quick_run(tmp_path) -> None:
    # float32: in bf16, where a prompt's prefill chunks end changes some greedy tokens, and the cache
    # moves where they end; in float32 it changed none of the default workload's.
    report = prefix_benchmark.main(["--quick", "--dtype", "float32", "--results-dir", str(tmp_path)])
    off, on = report["off"], report["on"]
    for figures in (off, on):
        assert figures["tokens"] == 8 * 4
        assert 0 < figures["ttft_p50_s"] <= figures["ttft_p95_s"]
    assert off["cached_tokens"] == 0
    assert 0 < on["cached_fraction"] < 1, "requests 5-8 reuse the system prompt of requests 1-4, one per adapter"
    assert report["token_mismatches"] == 0
    assert report["ratios"]["tokens_per_cpu_s"] == pytest.approx(on["tokens_per_cpu_s"] / off["tokens_per_cpu_s"])
    assert report["ratios"]["ttft_p50"] == pytest.approx(off["ttft_p50_s"] / on["ttft_p50_s"])
    assert set(report["workload"]["system_prompt_tokens"]) == {"base", "french", "json", "shout"}
    written = json.loads((tmp_path / "prefix_float32_1t_quick.json").read_text())
    assert written["ratios"] == report["ratios"] and written["goals_met"] == report["goals_met"]
