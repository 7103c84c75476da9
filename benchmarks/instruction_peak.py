"""One core's multiply-add peak for the model's arithmetic, from a loop that does nothing else.

The roofline's matmul rate is what a matmul library reaches, which an engine with a better kernel
could exceed. A floor no implementation can beat needs the instruction's own peak. The probes are
compiled into the CPU ops, one per instruction-set form (kernels/csrc/peak.cpp): independent chains of
the widest multiply-add of the active form, enough of them to hide its latency:
- float32: `vfmadd` on 256-bit (AVX2 + FMA) or 512-bit (AVX-512) vectors;
- bfloat16: `vdpbf16ps` (AVX512-BF16), or `tdpbf16ps` tiles where the CPU has AMX.
Where the compiled ops are missing, or their form has no instruction for the dtype (the generic
form; bf16 without AVX512-BF16), the probe returns None and the roofline keeps the library's rate.

    python -m benchmarks.instruction_peak [--dtype float32|bfloat16]
"""
from __future__ import annotations

import argparse

from kernels import cpu_ops


def probe_kind(dtype: str) -> str | None:
    """The probe of the instruction that multiplies `dtype` in the active form, if it has one."""
    form = cpu_ops.active_form()
    if form is None or form == "generic":
        return None
    if dtype == "float32":
        return "f32_fma"
    if dtype == "bfloat16":
        return {"amx": "amx_bf16", "avx512_bf16": "bf16_dot"}.get(form)
    return None


def instruction_peak(dtype: str, tries: int = 3, iterations: int = 20_000_000) -> float | None:
    """Best of `tries` runs of the probe, in FLOP/s; None where no probe describes this CPU and dtype."""
    kind = probe_kind(dtype)
    if kind is None:
        return None
    ops = cpu_ops.ops()
    rounds = iterations if kind != "amx_bf16" else iterations // 64  # a tile product is 256 vector ones
    return max(ops.peak_flops(kind, rounds, 1.0 + attempt) for attempt in range(tries))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    peak = instruction_peak(args.dtype)
    where = f"{probe_kind(args.dtype)}, compiled CPU ops form {cpu_ops.active_form()}, one core"
    print(f"no {args.dtype} instruction peak to probe here" if peak is None else f"{peak / 1e9:.0f} GFLOP/s {args.dtype} ({where})")


if __name__ == "__main__":
    main()
