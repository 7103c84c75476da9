"""The roofline's bandwidth probe (`peak_read`, kernels/csrc/peak.cpp) in every compiled form: a rate
near what torch's sum reads and below what any core could (loads the compiler dropped would show),
whatever the number of streams; and a clear refusal of what it cannot read whole."""
from __future__ import annotations

import time

import pytest
import torch

from benchmarks.roofline import READ_STREAMS
from kernels import cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops.ops() is None, reason="the compiled CPU ops are not installed")

# More than any core reads even from L1 (a few 64-byte loads a cycle at 6 GHz): a probe whose loads
# the compiler dropped would report it.
IMPOSSIBLE_BYTES_PER_S = 2e12


def _sum_rate(buffer: torch.Tensor, tries: int) -> float:
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * buffer.element_size() / best


@pytest.mark.parametrize("streams", READ_STREAMS)
def test_the_probe_reads_at_a_possible_rate_near_torchs_sum(compiled_form, streams) -> None:
    """64 MiB, past the L2 of the CPUs measured. The generic form's scalar loads read at about 0.6x
    torch's vectorised sum there (Intel Xeon); 0.25 leaves room for the other test worker."""
    ops = cpu_ops.ops()
    buffer = torch.ones(16 << 20, dtype=torch.float32)
    assert buffer.data_ptr() % 64 == 0
    rate = max(ops.peak_read(buffer, streams) for _ in range(3))
    assert 0.25 * _sum_rate(buffer, tries=3) <= rate < IMPOSSIBLE_BYTES_PER_S


def test_the_probe_refuses_what_it_cannot_read_whole(compiled_form) -> None:
    ops = cpu_ops.ops()
    buffer = torch.ones(1 << 16, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="1, 2, 4 or 8 streams"):
        ops.peak_read(buffer, 3)
    with pytest.raises(RuntimeError, match="align the buffer to 64 bytes"):
        ops.peak_read(buffer[1:], 1)
    with pytest.raises(RuntimeError, match="contiguous CPU tensor"):
        ops.peak_read(buffer.view(256, 256).t(), 1)
    with pytest.raises(RuntimeError, match="at least a line a stream"):
        ops.peak_read(buffer[:64], 8)
