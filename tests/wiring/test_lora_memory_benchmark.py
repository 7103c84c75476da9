"""`python -m benchmarks.lora_memory --quick` end to end, and the bytes it charges each call, worked
by hand: gate_up reads A (576 wide) of both slices and B (1536 + 1536 wide) at each adapter's rank,
and multiplies each token's row by them."""
from __future__ import annotations

import json

from benchmarks import lora_memory


def test_quick_run_measures_every_batch(capsys):
    report = lora_memory.main(["--quick"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report
    rows = {row["batch"]: row for row in report["rows"]}
    assert set(rows) == {"W decode", "W prefill", "one token each"}
    # W: ranks 8, 16, 32, 64 twice = 240 rank rows; one token each: 128 adapters, 32 cycles = 3840.
    width = 2 * 576 + 2 * 1536
    assert rows["W decode"]["bytes"] == rows["W prefill"]["bytes"] == 240 * width * 2
    assert rows["one token each"]["bytes"] == 3840 * width * 2
    # W's adapters take 8 and 320 tokens each; one token each: one token per adapter.
    assert rows["W decode"]["flops"] == 2 * 8 * 240 * width
    assert rows["W prefill"]["flops"] == 2 * 320 * 240 * width
    assert rows["one token each"]["flops"] == 2 * 3840 * width
    for row in report["rows"]:
        assert row["same_pages_s"] > 0 and row["next_layer_s"] > 0
        assert row["read_gb_per_s"] == row["bytes"] / row["next_layer_s"] / 1e9
        assert row["gflop_per_s"] == row["flops"] / row["same_pages_s"] / 1e9
    assert report["streaming_read_gb_per_s"] > 0
