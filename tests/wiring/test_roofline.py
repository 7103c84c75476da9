"""The floor arithmetic of `benchmarks.roofline`, on round numbers worked by hand."""
from __future__ import annotations

import pytest

import torch

from benchmarks.instruction_peak import instruction_peaks
from benchmarks.roofline import MachineRates, ModelCosts, floor_seconds, measure_rates


def test_floor_charges_each_step_its_slower_resource() -> None:
    costs = ModelCosts(layer_params=1_000, head_params=0, weight_bytes=2_000, kv_bytes_per_token=10)
    rates = MachineRates(read_bytes_per_s=1_000.0, matmul_flops_per_s=100_000.0)
    # Prefill of 30 + 50 tokens: 2 * 1000 * 80 = 160000 FLOPs (1.6 s) against 2000 bytes (2 s).
    # Decode step 1: 2000 + (80 + 2) * 10 = 2820 bytes (2.82 s) against 4000 FLOPs (0.04 s).
    # Decode step 2: 2000 + (80 + 4) * 10 = 2840 bytes (2.84 s).
    assert floor_seconds(costs, rates, [30, 50], new_tokens=3) == pytest.approx(2.0 + 2.82 + 2.84)


def test_floor_charges_the_lm_head_only_for_rows_that_need_logits() -> None:
    costs = ModelCosts(layer_params=1_000, head_params=500, weight_bytes=10, kv_bytes_per_token=0)
    rates = MachineRates(read_bytes_per_s=1_000.0, matmul_flops_per_s=1_000.0)
    # Prefill of 64 + 16 tokens: layers 2 * 1000 * 80, the head 2 * 500 for each prompt's last row:
    # 162 s. One decode step of both sequences: 2 * (1000 + 500) * 2 = 6 s.
    assert floor_seconds(costs, rates, [64, 16], new_tokens=2) == pytest.approx(162.0 + 6.0)


def test_serial_bytes_are_read_after_each_steps_arithmetic() -> None:
    costs = ModelCosts(layer_params=1_000, head_params=0, weight_bytes=2_000, kv_bytes_per_token=10)
    rates = MachineRates(read_bytes_per_s=1_000.0, matmul_flops_per_s=100_000.0)
    # The first test's steps (2 s, 2.82 s, 2.84 s), each then reading 500 bytes more: 0.5 s a step,
    # where 500 more bytes read under the arithmetic would cost the same here (every step is bound by
    # its reads) but nothing in a step bound by its FLOPs.
    assert floor_seconds(costs, rates, [30, 50], new_tokens=3, serial_bytes=500) == pytest.approx(2.5 + 3.32 + 3.34)
    flops_bound = MachineRates(read_bytes_per_s=1_000.0, matmul_flops_per_s=10_000.0)
    # Prefill: 160000 FLOPs (16 s) against 2000 bytes; with 500 bytes more under them: still 16 s.
    hidden = ModelCosts(layer_params=1_000, head_params=0, weight_bytes=2_500, kv_bytes_per_token=0)
    assert floor_seconds(hidden, flops_bound, [30, 50], new_tokens=1) == pytest.approx(16.0)
    after = ModelCosts(layer_params=1_000, head_params=0, weight_bytes=2_000, kv_bytes_per_token=0)
    assert floor_seconds(after, flops_bound, [30, 50], new_tokens=1, serial_bytes=500) == pytest.approx(16.5)


# Per dtype, an upper bound no core reaches: 64 FLOPs x 4 vdpbf16ps a cycle (bf16), 32 FLOPs x 4
# FMAs a cycle (fp32), at 6 GHz; AMX tiles do 16x the bf16 instruction's work per cycle at most.
_IMPOSSIBLE = {"float32": 768e9, "bfloat16": 1536e9}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_instruction_peak_is_at_least_what_a_real_matmul_reaches(dtype: str) -> None:
    """A probe that left the instruction's latency exposed would report a fraction of what the
    matmul library reaches with the same instruction (one dependent chain of a 4-cycle instruction
    issued twice a cycle: 1/8); one whose chains the compiler merged would report many times the
    hardware's rate. The margin (0.75) is for the other test worker loading the machine during one
    measurement and not the other."""
    peaks = instruction_peaks(dtype, tries=5, iterations=4_000_000)
    if not peaks:
        pytest.skip(f"no {dtype} instruction peak to probe with this CPU's compiled ops")
    library = measure_rates(hidden=576, intermediate=1536, dtype=getattr(torch, dtype), tries=2).matmul_flops_per_s
    assert 0.75 * library <= max(peaks.values())
    for kind, peak in peaks.items():
        assert peak < _IMPOSSIBLE[dtype] * (16 if kind == "amx_bf16" else 1), kind
