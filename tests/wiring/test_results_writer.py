"""`benchmarks.results_writer`, the one place benchmarks write their reports: the JSON read back
equals the report, the plot is drawn beside it, and a run's name says what it measured and how."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.results_writer import results_stem, write_results


def test_a_report_is_written_with_its_plot_beside_it(tmp_path: Path) -> None:
    plotted: list[Path] = []
    report = {"environment": {"dtype": "bfloat16"}, "rows": [{"ratio": 1.5}]}
    path = write_results(report, tmp_path / "made", "prefix_bfloat16_1t", plotted.append)
    assert path == tmp_path / "made" / "prefix_bfloat16_1t.json"
    assert json.loads(path.read_text()) == report
    assert plotted == [tmp_path / "made" / "prefix_bfloat16_1t.png"]


def test_a_report_without_a_plot_is_the_json_alone(tmp_path: Path) -> None:
    write_results({"a": 1}, tmp_path, "kernels_cpu_float32_1t_tiny")
    assert [p.name for p in tmp_path.iterdir()] == ["kernels_cpu_float32_1t_tiny.json"]


def test_a_quick_run_is_named_apart_from_a_full_one() -> None:
    assert results_stem("adapters", "bfloat16", "2t") == "adapters_bfloat16_2t"
    assert results_stem("adapters", "bfloat16", "2t", quick=True) == "adapters_bfloat16_2t_quick"
