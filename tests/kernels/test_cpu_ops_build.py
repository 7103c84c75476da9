"""The compiled CPU ops as installed: one library per instruction-set form, each compiled with its own
flags, chosen by what the CPU reports, built from the sources and tuning constants beside them; and
the PyTorch fallback, with one warning, where they are missing, stale or broken."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_build, cpu_ops, tuning

pytestmark = pytest.mark.skipif(cpu_ops.ops() is None, reason="the compiled CPU ops are not installed")


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    pytest.skip("no x86 flags in /proc/cpuinfo")


def test_supported_forms_agree_with_the_kernels_view_of_the_cpu() -> None:
    """cpuid, read by the bindings, against the flags Linux reports."""
    flags = _cpu_flags()
    expected = {"generic"}
    if {"avx2", "fma", "f16c", "bmi1", "bmi2"} <= flags:
        expected.add("avx2")
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags:
            expected.add("avx512")
            if "avx512_bf16" in flags:
                expected.add("avx512_bf16")
                if {"amx_tile", "amx_bf16"} <= flags:
                    expected.add("amx")
    assert set(cpu_ops.ops().supported_forms()) == expected
    best = [form for form in cpu_ops.FORMS if form in expected][-1]
    if cpu_ops.active_form() != best:  # only where the probes find this CPU's vdpbf16ps slow
        assert (best, cpu_ops.active_form()) == ("avx512_bf16", "avx512")
        with cpu_ops.using_form("avx512_bf16") as ops:
            dot = max(ops.peak_flops("bf16_dot", 2_000_000, 1.0 + attempt) for attempt in range(3))
            fma = max(ops.peak_flops("f32_fma", 2_000_000, 1.0 + attempt) for attempt in range(3))
        assert not cpu_ops.prefers_bf16_dot(dot, fma)


def test_the_avx512_bf16_form_serves_only_where_vdpbf16ps_outruns_fma() -> None:
    """The probes' rates on the CPUs measured (kernels/tuning.py): AMD Zen 5 runs `vdpbf16ps` at
    twice the FLOPs of FMA, an Intel Xeon whose hypervisor hides AMX at half."""
    assert cpu_ops.prefers_bf16_dot(568e9, 271e9)
    assert not cpu_ops.prefers_bf16_dot(86e9, 175e9)


def test_each_form_reports_the_tuning_constants_and_sources_it_was_built_from(compiled_form) -> None:
    ops = cpu_ops.ops()
    assert ops.active_form() == compiled_form
    assert ops.constants() == tuning.CPU_KERNEL_CONSTANTS
    assert ops.source_digest() == cpu_build.source_digest(tuning.CPU_KERNEL_CONSTANTS)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to disassemble with")
def test_forms_below_avx512_hold_no_avx512_instructions() -> None:
    """Code of one form never leaks into another's library (the forms compile the same sources)."""
    def zmm_instructions(form: str) -> int:
        listing = subprocess.run(["objdump", "-d", str(cpu_ops._library_path(form))], capture_output=True, text=True, check=True)
        return listing.stdout.count("%zmm")

    built = cpu_ops._built_forms()
    for form in ("generic", "avx2"):
        if form in built:
            assert zmm_instructions(form) == 0, form
    if "avx512" in built:
        assert zmm_instructions("avx512") > 0


def test_a_stale_build_is_refused_with_one_warning(monkeypatch, caplog) -> None:
    """Sources edited after the build (a checkout without `make install`): the PyTorch paths serve."""
    monkeypatch.setattr(cpu_build, "source_digest", lambda constants: "0" * 16)
    serving = cpu_ops.active_form()
    with caplog.at_level(logging.WARNING, logger="kernels.cpu_ops"):
        assert cpu_ops.ops.__wrapped__() is None
    assert [r.getMessage() for r in caplog.records if "older than kernels/csrc" in r.getMessage()] != []
    cpu_ops.ops().use_form(serving)


def test_a_broken_form_library_is_skipped_and_the_others_serve(tmp_path, monkeypatch, caplog) -> None:
    broken = tmp_path / "broken.so"
    broken.write_bytes(b"not a shared library")
    real = cpu_ops._library_path
    monkeypatch.setattr(cpu_ops, "_library_path", lambda form: broken if form == "avx2" else real(form))
    with caplog.at_level(logging.WARNING, logger="kernels.cpu_ops"):
        loaded = cpu_ops._load_forms(cpu_ops.ops())
    assert "avx2" not in loaded and "generic" in loaded
    assert any("form avx2 cannot be loaded" in r.getMessage() for r in caplog.records)


def test_without_the_extension_the_cpu_backend_is_pytorch_with_one_warning() -> None:
    """An install without a compiler: `kernels._cpu_ops` cannot be imported."""
    script = (
        "import logging, sys, torch\n"
        "logging.basicConfig(level=logging.WARNING, format='%(name)s %(message)s')\n"
        "sys.modules['kernels._cpu_ops'] = None  # what Python does for a module that cannot be imported\n"
        "import kernels\n"
        "backend = kernels.backend_for('cpu')\n"
        "x = torch.randn(3, 8)\n"
        "out = backend.rms_norm(x, torch.ones(8), 1e-6)\n"
        "assert kernels.backend_for('cpu') is backend\n"
        "print(backend.name, tuple(out.shape))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "torch (3, 8)"
    assert result.stderr.count("compiled CPU ops are not installed") == 1


def test_a_start_builds_nothing_and_waits_on_no_lock(tmp_path) -> None:
    """The compiled ops come built with the package: a start compiles nothing and takes no lock in
    PyTorch's extensions directory, so a lock left there by an interrupted build elsewhere (or by
    another virtual environment) cannot hold it up. (Before, the ops were built there on the first
    start, and a stale lock made every later start wait forever.)"""
    extensions = tmp_path / "torch_extensions"
    stale = extensions / "lora_serve_cpu_ops_0123456789ab"
    stale.mkdir(parents=True)
    (stale / "lock").touch()
    script = ("import kernels, torch; backend = kernels.backend_for('cpu'); "
              "backend.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6); print(backend.label)")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60, env=env)
    assert result.stdout.strip() == f"cpu/{cpu_ops.active_form()}"
    assert sorted(path.name for path in extensions.rglob("*")) == ["lock", stale.name]  # untouched
