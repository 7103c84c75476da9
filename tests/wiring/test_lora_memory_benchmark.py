"""`python -m benchmarks.lora_memory --quick` end to end, and the bytes it charges each call, worked
by hand: gate_up reads A (576 wide) of both slices and B (1536 + 1536 wide) at each adapter's rank."""
from __future__ import annotations

import json

from benchmarks import lora_memory


def test_quick_run_measures_every_batch(capsys):
    report = lora_memory.main(["--quick"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report
    rows = {row["batch"]: row for row in report["rows"]}
    assert set(rows) == {"W decode", "one token each"}
    # W: ranks 8, 16, 32, 64 twice = 240 rank rows; one token each: 128 adapters, 32 cycles = 3840.
    assert rows["W decode"]["bytes"] == 240 * (2 * 576 + 2 * 1536) * 2
    assert rows["one token each"]["bytes"] == 3840 * (2 * 576 + 2 * 1536) * 2
    for row in report["rows"]:
        assert row["same_pages_s"] > 0 and row["next_layer_s"] > 0
        assert row["read_gb_per_s"] == row["bytes"] / row["next_layer_s"] / 1e9
    assert report["streaming_read_gb_per_s"] > 0
