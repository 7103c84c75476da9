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
    logger.info("compiled CPU ops: form %s (runnable here: %s)", loaded[-1], ", ".join(loaded))
    return module


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


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX) and the compiled ops can use it;
    without the compiled ops bf16 takes PyTorch's widened paths, slower than float32."""
    return any(form in ("avx512_bf16", "amx") for form in runnable_forms())


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
