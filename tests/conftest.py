"""Test-wide settings. TRITON_INTERPRET must be set before any Triton kernel module is imported,
so that Triton kernels run on CPU tensors in the interpreter (there is no GPU in CI)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Under contention two threads made small ops ~300x slower (SEMANTICS.md, "Tests on CPU").
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    torch.manual_seed(0)
