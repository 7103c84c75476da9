"""The floor arithmetic of `benchmarks.roofline`, on round numbers worked by hand."""
from __future__ import annotations

import pytest

from benchmarks.roofline import MachineRates, ModelCosts, floor_seconds


def test_floor_charges_each_step_its_slower_resource() -> None:
    costs = ModelCosts(matmul_params=1_000, weight_bytes=2_000, kv_bytes_per_token=10)
    rates = MachineRates(read_bytes_per_s=1_000.0, matmul_flops_per_s=100_000.0)
    # Prefill of 30 + 50 tokens: 2 * 1000 * 80 = 160000 FLOPs (1.6 s) against 2000 bytes (2 s).
    # Decode step 1: 2000 + (80 + 2) * 10 = 2820 bytes (2.82 s) against 4000 FLOPs (0.04 s).
    # Decode step 2: 2000 + (80 + 4) * 10 = 2840 bytes (2.84 s).
    assert floor_seconds(costs, rates, [30, 50], new_tokens=3) == pytest.approx(2.0 + 2.82 + 2.84)


def test_floor_of_a_compute_bound_prefill() -> None:
    costs = ModelCosts(matmul_params=1_000, weight_bytes=10, kv_bytes_per_token=0)
    rates = MachineRates(read_bytes_per_s=1_000.0, matmul_flops_per_s=1_000.0)
    # 2 * 1000 * 64 FLOPs at 1000 FLOP/s: 128 s, far above 0.01 s of reading; one token, no decode.
    assert floor_seconds(costs, rates, [64], new_tokens=1) == pytest.approx(128.0)
