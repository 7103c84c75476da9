"""Builds the compiled CPU ops at install time (`pip install .`, `make install`); all other metadata
is in pyproject.toml.

Two kinds of extension (kernels/cpu_build.py describes them): `kernels._cpu_ops`, the Python
bindings, compiled once against PyTorch's headers; and one plain shared library per instruction-set
form, `kernels._cpu_isa_<form>`, each compiled from the same kernel sources with its own flags, loaded
by the bindings at run time for the best form the CPU has. A form the compiler cannot build is left
out with a warning; if nothing builds (no compiler), the package still installs and serves through
the PyTorch paths.
"""
from __future__ import annotations

import os
import platform
import runpy
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
BUILD = runpy.run_path(str(ROOT / "kernels" / "cpu_build.py"))
CONSTANTS = runpy.run_path(str(ROOT / "kernels" / "tuning.py"))["CPU_KERNEL_CONSTANTS"]
CSRC = "kernels/csrc"


def _form_extensions() -> list[Extension]:
    is_x86 = platform.machine().lower() in ("x86_64", "amd64")
    forms = [form for form in BUILD["FORMS"] if is_x86 or form not in BUILD["X86_ONLY"]]
    digest = BUILD["source_digest"](CONSTANTS)
    return [
        Extension(
            f"kernels.{BUILD['library_name'](form)}",
            sources=[f"{CSRC}/{name}" for name in BUILD["FORM_SOURCES"]],
            include_dirs=[CSRC],
            define_macros=[("LORA_SERVE_FORM", f'"{form}"'), ("LORA_SERVE_SOURCE_DIGEST", f'"{digest}"')],
            extra_compile_args=BUILD["COMMON_FLAGS"] + BUILD["FORMS"][form],
            language="c++",
            optional=True,
        )
        for form in forms
    ]


def _bindings_extension() -> Extension:
    from torch.utils.cpp_extension import CppExtension

    import torch

    return CppExtension(
        "kernels._cpu_ops",
        sources=[f"{CSRC}/{name}" for name in BUILD["BINDINGS_SOURCES"]],
        include_dirs=[CSRC],
        define_macros=[("TORCH_EXTENSION_NAME", "_cpu_ops"), ("TORCH_API_INCLUDE_EXTENSION_H", None),
                       ("_GLIBCXX_USE_CXX11_ABI", str(int(torch._C._GLIBCXX_USE_CXX11_ABI)))],
        extra_compile_args=["-std=c++20", "-O2", "-g0"] + BUILD["BINDINGS_THREADING_FLAGS"],
        extra_link_args=BUILD["BINDINGS_THREADING_FLAGS"],
        optional=True,
    )


class BuildCpuOps(build_ext):
    """Writes the tuning header, gives each form its own copy of the sources, then builds the
    extensions concurrently.

    setuptools names an object file after its source's path, so forms compiled from the same files
    would overwrite each other's objects (and link another form's code): each form compiles one-line
    sources of its own, under build_temp/forms/<form>/, that include the shared ones."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def run(self) -> None:
        generated = Path(self.build_temp) / "generated"
        generated.mkdir(parents=True, exist_ok=True)
        header = generated / "lora_serve_tuning.h"
        text = BUILD["tuning_header"](CONSTANTS)
        if not header.is_file() or header.read_text() != text:  # unchanged: no rebuild for it
            header.write_text(text)
        for extension in self.extensions:
            extension.include_dirs.append(str(generated))
            extension.depends = [str(path) for path in (ROOT / CSRC).iterdir()] + [str(header)]
            if extension.name != "kernels._cpu_ops":
                extension.sources = self._own_sources(extension)
        super().run()

    def _own_sources(self, extension: Extension) -> list[str]:
        directory = Path(self.build_temp) / "forms" / extension.name.rsplit(".", 1)[1]
        directory.mkdir(parents=True, exist_ok=True)
        own = []
        for source in extension.sources:
            wrapper = directory / Path(source).name
            text = f'#include "{(ROOT / source).as_posix()}"\n'
            if not wrapper.is_file() or wrapper.read_text() != text:
                wrapper.write_text(text)
            own.append(str(wrapper))
        return own


setup(ext_modules=_form_extensions() + [_bindings_extension()], cmdclass={"build_ext": BuildCpuOps})
