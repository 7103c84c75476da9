"""The engine's step phases: a phase opened inside another counts for itself alone, and the
sampler's reduction over the vocabulary, which runs on every compute thread, is not serial work."""
from __future__ import annotations

import pytest

from lora_runtime import SamplingParams, step_timing
from lora_runtime.step_timing import PHASES, SERIAL_PHASES, StepTimes


class ManualClock:
    """perf_counter's stand-in: time moves only when the test moves it, so the sums are exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_nested_phase_counts_for_itself_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = ManualClock()
    monkeypatch.setattr(step_timing.time, "perf_counter", clock)
    times = StepTimes()
    with times.phase("sample"):
        clock.now += 1.0
        with times.phase("sample_reduce"):
            clock.now += 4.0
        clock.now += 2.0
    with times.phase("update"):
        clock.now += 3.0
    assert times.seconds["sample"] == 3.0 and times.seconds["sample_reduce"] == 4.0
    assert times.seconds["update"] == 3.0 and sum(times.seconds.values()) == clock.now
    assert times.serial_seconds == 6.0 and times.serial_fraction == 0.6


def test_the_samplers_reduction_is_timed_apart_from_the_serial_phases(engine) -> None:
    before = engine.step_times.snapshot()
    engine.generate(["Count to five:"], SamplingParams(max_new_tokens=3, ignore_eos_token=True))
    times = engine.step_times.since(before)
    assert "sample_reduce" in PHASES and "sample_reduce" not in SERIAL_PHASES
    assert times.steps >= 3 and times.seconds["sample_reduce"] > 0 and times.seconds["sample"] > 0
