"""The compiled CPU ops (`kernels/csrc/`), built once per machine with PyTorch's C++ extension tooling
and cached in its extensions directory.

They exist because on CPU the step's small ops, not its matmuls, were the cost the matmul libraries
cannot remove: each PyTorch elementwise op makes a pass over memory and a Python round trip, and
attention over short paged contexts was dozens of tiny calls per layer. Measured figures are in
`kernels.tuning`. Where the ops cannot be built (no C++ compiler or ninja), every caller falls back to
the PyTorch path, with one warning.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path
from types import ModuleType

from kernels import tuning

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / name for name in ("amx_linear.cpp", "bf16_linear.cpp", "attention.cpp", "elementwise.cpp", "lora.cpp", "reductions.cpp", "bindings.cpp")]
# -fopenmp-simd: honour the `omp simd` loops (vectorised reductions) without OpenMP threading;
# -fno-math-errno: lets sqrt vectorise (it never sets errno here); 512-bit vectors where the CPU
# has them (GCC prefers 256 by default).
_CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp-simd", "-fno-math-errno"]


@functools.cache
def cpu_ops() -> ModuleType | None:
    """The compiled module, or None when it cannot be built here (callers fall back)."""
    from torch.utils.cpp_extension import load

    # ninja ships as a Python package in our environment: make its binary findable.
    scripts = str(Path(sys.executable).parent)
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    logger.info("loading the compiled CPU ops (built once per machine, then cached)")
    try:
        return load(name=_build_name(), sources=[str(s) for s in _SOURCES], extra_cflags=_CFLAGS, verbose=False)
    except Exception as error:  # no compiler, no ninja, a build error: the PyTorch paths serve
        logger.warning("compiled CPU ops unavailable (%s); using the PyTorch paths", error)
        return None


def _build_name() -> str:
    """PyTorch rebuilds when a source file or a flag changes, but not when a header does, nor when
    the cache directory is reused on another CPU (a home directory shared by different machines):
    `-march=native` code from an AMX machine dies of an illegal instruction on one without AMX.
    Naming the build after a digest of every file in csrc/ and of the CPU's features makes either
    a new build."""
    digest = hashlib.sha256()
    for path in sorted(_CSRC.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join(sorted(cpu_flags())).encode() + platform.machine().encode())
    return f"lora_serve_cpu_ops_{digest.hexdigest()[:12]}"


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (x86 `flags`, Arm `Features`); empty elsewhere."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def available_for(tensor) -> bool:
    """Whether the compiled ops serve this tensor: a CPU tensor, ops enabled and buildable."""
    return tensor.device.type == "cpu" and tuning.CPU_COMPILED_OPS and cpu_ops() is not None
