"""The device the Triton kernel tests run on, read once for the whole run from `LORA_TEST_DEVICE`:

- unset or "cpu": CPU tensors, the kernels in Triton's interpreter (CI: there is no GPU);
- "cuda": CUDA tensors, the kernels compiled for the GPU, no interpreter (`scripts/gpu_check.sh`).

tests/conftest.py sets or clears TRITON_INTERPRET from it before any kernel module is imported."""
from __future__ import annotations

import os

DEVICE_VARIABLE = "LORA_TEST_DEVICE"
TEST_DEVICE = os.environ.get(DEVICE_VARIABLE, "cpu")
ON_GPU = TEST_DEVICE == "cuda"

if TEST_DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"{DEVICE_VARIABLE} must be 'cpu' or 'cuda', got {TEST_DEVICE!r}")
