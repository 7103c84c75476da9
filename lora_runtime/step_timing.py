"""Where an engine step's wall time goes, phase by phase, summed over the engine's life: the model's
forward pass, whose ops split over the compute threads, and the serial work around it (scheduling,
building the step's plan and tensors, sampling, and the updates of each request's tokens and text,
detokenization and stop criteria), which one thread does however many cores the machine has. By
Amdahl's law the serial share bounds what more cores can give: `benchmarks.threads` reports it.

Light enough to run always: two clock reads per phase, a handful of phases a step."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import TracebackType

PHASES = ("schedule", "prepare", "forward", "sample", "sample_reduce", "update")
PARALLEL_PHASES = ("forward", "sample_reduce")
SERIAL_PHASES = tuple(phase for phase in PHASES if phase not in PARALLEL_PHASES)


@dataclass(slots=True)
class StepTimes:
    """Seconds spent in each phase (PHASES) over `steps` steps that ran the model."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    steps: int = 0
    # The phases entered and not yet left, innermost last.
    _open: list[_Phase] = field(default_factory=list, init=False, repr=False, compare=False)

    def phase(self, name: str) -> _Phase:
        """`with times.phase("sample"): ...` adds the block's wall time to that phase."""
        return _Phase(self, name)

    @property
    def serial_seconds(self) -> float:
        return sum(self.seconds[phase] for phase in SERIAL_PHASES)

    @property
    def serial_fraction(self) -> float:
        """The serial phases' share of the steps' time (0 before any step)."""
        total = sum(self.seconds.values())
        return self.serial_seconds / total if total > 0 else 0.0

    def snapshot(self) -> StepTimes:
        return StepTimes(dict(self.seconds), self.steps)

    def since(self, earlier: StepTimes) -> StepTimes:
        """The phases' time between `earlier` (a snapshot) and now."""
        return StepTimes({phase: self.seconds[phase] - earlier.seconds[phase] for phase in PHASES},
                         self.steps - earlier.steps)


class _Phase:
    __slots__ = ("_times", "_name", "_start", "_inner_s")

    def __init__(self, times: StepTimes, name: str) -> None:
        self._times, self._name, self._start, self._inner_s = times, name, 0.0, 0.0

    def __enter__(self) -> None:
        self._times._open.append(self)
        self._start = time.perf_counter()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        elapsed = time.perf_counter() - self._start
        times = self._times
        times.seconds[self._name] += elapsed - self._inner_s
        assert times._open.pop() is self, "phases nest: the innermost one ends first"
        if times._open:
            times._open[-1]._inner_s += elapsed
