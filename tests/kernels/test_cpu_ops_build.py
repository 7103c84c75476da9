"""The compiled ops' build is named after what it was compiled for: a cache directory reused on a
CPU with other features (a home directory shared by different machines) must not hand that CPU code
built with `-march=native` elsewhere."""
from __future__ import annotations

from kernels import cpu_ops


def test_build_name_changes_with_the_cpu_features(monkeypatch) -> None:
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: {"avx2", "avx512f", "amx_bf16", "amx_tile"})
    with_amx = cpu_ops._build_name()
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: {"avx2", "avx512f"})
    without_amx = cpu_ops._build_name()
    assert with_amx != without_amx
    assert cpu_ops._build_name() == without_amx  # the same machine keeps its build


def test_cpu_flags_are_read_from_this_machine() -> None:
    flags = cpu_ops.cpu_flags()
    try:
        cpuinfo = open("/proc/cpuinfo").read()
    except OSError:
        assert flags == set()
        return
    assert flags and all(flag in cpuinfo for flag in flags)
