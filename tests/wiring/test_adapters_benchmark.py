"""`python -m benchmarks.adapters --quick` end to end: every configuration of the sweep is measured
against the base model of the same run, with its floor, the memory the adapters took, the cold-load
latency of every source, and the JSON and plot it writes."""
from __future__ import annotations

import json
import math

import pytest

from benchmarks import adapters as adapters_benchmark

pytestmark = pytest.mark.slow


def test_adapters_benchmark_quick_sweep(tmp_path) -> None:
    report = adapters_benchmark.main(["--quick", "--results-dir", str(tmp_path)])
    rows = {(r["popularity"], r["num_adapters"]): r for r in report["rows"]}
    assert set(rows) == {("uniform", 1), ("uniform", 4), ("power_law", 4)}
    base = report["base"]["tokens_per_cpu_s"]
    for (_, count), row in rows.items():
        assert row["tokens"] == 8 * 4
        assert row["ratio_to_base"] == pytest.approx(row["tokens_per_cpu_s"] / base)
        assert 1 <= row["distinct_adapters"] <= count and row["resident_adapters"] >= row["distinct_adapters"]
        assert 0 < row["floor_ratio"] < 1, "adapters only add bytes and FLOPs to the base model's floor"
        assert 0 < row["serial_floor_ratio"] <= row["floor_ratio"], "reads after the arithmetic cannot beat reads under it"
    assert rows[("uniform", 1)]["floor_ratio"] > rows[("uniform", 4)]["floor_ratio"] or rows[("uniform", 4)]["distinct_adapters"] == 1
    assert set(report["cold_load"]) == {"local", "pbase", "hub", "s3"}
    assert all(math.isfinite(f["median_s"]) and f["median_s"] > 0 for f in report["cold_load"].values())
    stem = f"adapters_{report['environment']['dtype']}_1t_quick"
    written = json.loads((tmp_path / f"{stem}.json").read_text())
    assert written["rows"] == json.loads(json.dumps(report["rows"]))
    assert (tmp_path / f"{stem}.png").stat().st_size > 0
