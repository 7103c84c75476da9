"""`benchmarks.serving` against a live server: streamed and whole (`--whole`) requests count the
tokens the server generated, and the whole ones take the non-streamed route."""
from __future__ import annotations

import asyncio

import pytest

from benchmarks.serving import Target, adapter_picker, run_level

pytestmark = pytest.mark.xdist_group("test_serving_benchmark")


@pytest.mark.parametrize("whole", [False, True], ids=["streamed", "whole"])
def test_a_level_counts_every_generated_token(live, whole: bool) -> None:
    target = Target(live.base_url, live.tokens["demo"], "demo", live.model_name)
    labels = {"route": "generate" if whole else "generate_stream", "status": "200"}

    def served() -> float:
        return live.state.metrics.registry.get_sample_value("lora_requests_total", labels) or 0.0

    before = served()
    report = asyncio.run(run_level(target, 2, 4, 3, adapter_picker([], "uniform", 1.1, 0), whole))
    after = served()
    assert report.errors == {} and report.num_requests == 4
    assert report.output_tokens_per_s * report.wall_s == pytest.approx(4 * 3)
    assert after - before == 4  # the route the mode names
