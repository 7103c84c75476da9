"""The compiled CPU ops (`kernels/csrc/`), built at install time for every instruction-set form and
chosen at import by what this CPU has (`cpuid`), as PyTorch and oneDNN choose their kernels.

They exist because on CPU the step's small ops, not its matmuls, were the cost the matmul libraries
cannot remove: each PyTorch elementwise op makes a pass over memory and a Python round trip, and
attention over short paged contexts was dozens of tiny calls per layer. `make install` (or
`pip install .`) builds them; nothing is compiled at serve time. Where they are missing (installed
without a compiler), older than the sources beside them, or refused by the CPU, the CPU backend is
the PyTorch one, with one warning saying why.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import logging
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from kernels import cpu_build, tuning

logger = logging.getLogger(__name__)

FORMS = tuple(cpu_build.FORMS)  # in the order of preference: the last one this CPU runs is used
_PACKAGE_DIR = Path(__file__).resolve().parent


@functools.cache
def ops() -> ModuleType | None:
    """The bindings with this CPU's best built form active, or None (callers take the PyTorch paths)."""
    try:
        module = importlib.import_module("kernels._cpu_ops")
    except ImportError as error:
        logger.warning("compiled CPU ops are not installed (%s): serving through the PyTorch paths; "
                       "`make install` builds them", error)
        return None
    loaded = _load_forms(module)
    if not loaded:
        logger.warning("no compiled CPU op form can run here (built: %s; this CPU runs: %s): serving "
                       "through the PyTorch paths", _built_forms(), module.supported_forms())
        return None
    module.use_form(loaded[-1])
    if not _is_current(module):
        logger.warning("compiled CPU ops are older than kernels/csrc or kernels/tuning.py: serving through "
                       "the PyTorch paths; `make install` rebuilds them")
        return None
    if not is_parallel(module):
        logger.warning("compiled CPU ops were built without OpenMP: each op runs on one thread whatever "
                       "torch.set_num_threads says; `make install` rebuilds them")
    form, why = _preferred_form(module, loaded)
    module.use_form(form)
    logger.info("compiled CPU ops: form %s (runnable here: %s)%s", form, ", ".join(loaded), why)
    return module


def _preferred_form(module: ModuleType, loaded: list[str]) -> tuple[str, str]:
    """The form to serve with, and why where it is not simply the last one loaded: the AVX512-BF16 form
    gives way to the AVX-512 one where this CPU's `vdpbf16ps` is slow (`prefers_bf16_dot`)."""
    best = loaded[-1]
    if best != "avx512_bf16" or "avx512" not in loaded:
        return best, ""
    module.use_form(best)  # both probes in the AVX512-BF16 form's library: zmm FMA against vdpbf16ps
    dot, fma = 0.0, 0.0
    for attempt in range(tuning.FORM_PROBE_TRIES):  # interleaved, so that a slow spell hits both
        dot = max(dot, module.peak_flops("bf16_dot", tuning.FORM_PROBE_ITERATIONS, 1.0 + attempt))
        fma = max(fma, module.peak_flops("f32_fma", tuning.FORM_PROBE_ITERATIONS, 1.0 + attempt))
    if prefers_bf16_dot(dot, fma):
        return best, ""
    return "avx512", (f"; vdpbf16ps {dot / 1e9:.0f} GFLOP/s against float32 FMA {fma / 1e9:.0f}: bf16 "
                      "widened to float32 is faster here")


def prefers_bf16_dot(dot_flops: float, fma_flops: float) -> bool:
    """Whether bf16 is multiplied faster by `vdpbf16ps` (at `dot_flops` per second) than widened to
    float32 and multiplied by FMA (at `fma_flops`); kernels/tuning.py has the measurements."""
    return dot_flops >= tuning.BF16_DOT_MIN_SHARE_OF_FMA * fma_flops


def _library_path(form: str) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = _PACKAGE_DIR / f"{cpu_build.library_name(form)}{suffix}"
        if path.is_file():
            return path
    return None


def _built_forms() -> list[str]:
    return [form for form in FORMS if _library_path(form) is not None]


def _load_forms(module: ModuleType) -> list[str]:
    """Load every built form this CPU supports; returns them in the order of preference."""
    loaded = []
    supported = set(module.supported_forms())
    for form in FORMS:
        path = _library_path(form)
        if path is None or form not in supported:
            continue
        try:
            module.load_form(str(path))
            loaded.append(form)
        except RuntimeError as error:  # a library from another build: the other forms still serve
            logger.warning("compiled CPU op form %s cannot be loaded: %s", form, error)
    return loaded


def _is_current(module: ModuleType) -> bool:
    """False when the sources beside the package (a development checkout) are newer than the build."""
    if not cpu_build.CSRC.is_dir():
        return True  # an installed wheel: no sources to compare with
    return module.source_digest() == cpu_build.source_digest(tuning.CPU_KERNEL_CONSTANTS)


def is_parallel(module: ModuleType) -> bool:
    """Whether the bindings split their ops over PyTorch's threads (built with OpenMP; a build from
    before they were lacks the query and ran serially)."""
    return bool(getattr(module, "is_parallel", lambda: False)())


def runnable_forms() -> list[str]:
    """The forms built and supported by this CPU, in the order of preference."""
    module = ops()
    if module is None:
        return []
    supported = set(module.supported_forms())
    return [form for form in _built_forms() if form in supported]


def unavailable_reason(form: str) -> str | None:
    """Why `form` cannot run here (None when it can)."""
    module = ops()
    if module is None:
        return "the compiled CPU ops are unavailable"
    if form not in module.supported_forms():
        return f"this CPU cannot run the {form} form"
    if _library_path(form) is None:
        return f"the {form} form was not built (the compiler lacks its flags)"
    return None


def bf16_matmul() -> str | None:
    """How the active form's compiled matmuls multiply bf16 where that beats float32 on this CPU:
    "vdpbf16ps" (AVX512-BF16 and AMX forms: twice FMA's FLOPs per instruction) or "widened to
    float32" (the AVX-512 form: bf16 weights widened to float32 for `vfmadd`, the same arithmetic as
    float32 on half the bytes); None elsewhere. The widened AVX-512 form ran the engine's workloads
    faster in bf16 than in float32; the AVX2 form's widened matmul, and PyTorch's widened paths
    without the compiled ops, ran slower, so float32 stays there (figures in docs/benchmarks.md,
    "Why the tuning constants are what they are")."""
    return {"amx": "vdpbf16ps", "avx512_bf16": "vdpbf16ps", "avx512": "widened to float32"}.get(active_form() or "")


def active_form() -> str | None:
    module = ops()
    return module.active_form() if module is not None else None


@contextlib.contextmanager
def using_form(form: str) -> Iterator[ModuleType]:
    """Run the compiled ops in `form` for the duration (tests and benchmarks compare the forms)."""
    module = ops()
    reason = unavailable_reason(form)
    if module is None or reason is not None:
        raise RuntimeError(reason)
    previous = module.active_form()
    module.use_form(form)
    try:
        yield module
    finally:
        module.use_form(previous)


@contextlib.contextmanager
def without_vnni() -> Iterator[ModuleType]:
    """Multiply quantized weights without VNNI's int8 dot products for the duration, as on a CPU
    without them (tests and benchmarks compare the two paths of a form)."""
    module = ops()
    if module is None:
        raise RuntimeError(unavailable_reason("generic"))
    previous = module.use_vnni(False)
    try:
        yield module
    finally:
        module.use_vnni(previous)
