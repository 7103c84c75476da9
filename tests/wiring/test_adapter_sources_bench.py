"""`benchmarks.adapter_sources.cold_load_latencies` on a tiny PEFT adapter: every source loads it
through its real loopback server, and all four load the same weights as reading the directory."""
from __future__ import annotations

import math
from pathlib import Path

from peft import LoraConfig

from benchmarks.adapter_sources import SOURCES, cold_load_latencies, weights_sha256
from lora_runtime.adapters.peft_format import load_peft_adapter
from lora_runtime.engine_info import AdapterLimits
from tests.adapters.peft_factory import peft_model, save_adapter, tiny_llama, tiny_shape


def test_every_source_cold_loads_the_same_weights(tmp_path: Path) -> None:
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    adapter_dir = save_adapter(peft_model(tiny_llama(), config, seed=1), tmp_path / "adapter")
    shape, limits = tiny_shape(), AdapterLimits()

    report = cold_load_latencies(adapter_dir, shape, limits, repeats=1)

    assert set(report) == set(SOURCES)
    expected = weights_sha256(load_peft_adapter(adapter_dir, shape, limits))
    files_bytes = sum(p.stat().st_size for p in adapter_dir.iterdir() if p.name.startswith("adapter_"))
    for name, figures in report.items():
        assert len(figures["tries"]) == 1 and figures["median_s"] == figures["min_s"] == figures["tries"][0]
        assert math.isfinite(figures["median_s"]) and figures["median_s"] > 0, name
        assert 0 <= figures["fetch_median_s"] <= figures["median_s"], name
        assert figures["parse_median_s"] > 0, name
        assert figures["bytes"] == files_bytes, name
        assert figures["weights_sha256"] == expected, name
