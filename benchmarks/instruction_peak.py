"""One core's multiply-add peak for the model's arithmetic, from a loop that does nothing else.

The roofline's matmul rate is what a matmul library reaches, which an engine with a better kernel
could exceed. A floor no implementation can beat needs the instruction's own peak. The probes are
compiled into the CPU ops, one per instruction-set form (kernels/csrc/peak.cpp): independent chains of
the widest multiply-add of the active form, enough of them to hide its latency:
- float32: `vfmadd` on 256-bit (AVX2 + FMA) or 512-bit (AVX-512) vectors;
- bfloat16: the fastest of `vdpbf16ps` (AVX512-BF16), `tdpbf16ps` tiles (AMX) and `vfmadd` (a bf16
  widens exactly to float32: the AVX2 and AVX-512 forms' bf16 matmuls multiply that way, and so does
  the AVX512-BF16 form's where `vdpbf16ps` is the slower, kernels/tuning.py).
Where the compiled ops are missing, or their form has no such instruction (the generic form), the
probe returns None and the roofline keeps the library's rate.

    python -m benchmarks.instruction_peak [--dtype float32|bfloat16]
"""
from __future__ import annotations

import argparse

from kernels import cpu_ops

from benchmarks import options


def probe_kinds(dtype: str) -> list[str]:
    """The probes of the instructions that can multiply `dtype` in the active form."""
    form = cpu_ops.active_form()
    if form is None or form == "generic" or dtype not in ("float32", "bfloat16"):
        return []
    if dtype == "float32":
        return ["f32_fma"]
    return ["f32_fma"] + {"amx": ["bf16_dot", "amx_bf16"], "avx512_bf16": ["bf16_dot"]}.get(form, [])


def instruction_peaks(dtype: str, tries: int = 3, iterations: int = 20_000_000) -> dict[str, float]:
    """Each probe's best of `tries` runs, in FLOP/s, by probe name (empty where no probe describes
    this CPU and dtype)."""
    ops = cpu_ops.ops()
    peaks = {}
    for kind in probe_kinds(dtype):
        rounds = iterations if kind != "amx_bf16" else iterations // 64  # a tile product is 256 vector ones
        peaks[kind] = max(ops.peak_flops(kind, rounds, 1.0 + attempt) for attempt in range(tries))
    return peaks


def instruction_peak(dtype: str, tries: int = 3, iterations: int = 20_000_000) -> float | None:
    """The fastest probe's peak, in FLOP/s; None where no probe describes this CPU and dtype."""
    return max(instruction_peaks(dtype, tries, iterations).values(), default=None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_dtype(parser)
    args = parser.parse_args(argv)
    args.dtype = options.resolved_dtype(args.dtype)
    peaks = instruction_peaks(args.dtype)
    if not peaks:
        print(f"no {args.dtype} instruction peak to probe here")
    for kind, peak in peaks.items():
        print(f"{peak / 1e9:.0f} GFLOP/s {args.dtype} ({kind}, compiled CPU ops form {cpu_ops.active_form()}, one core)")


if __name__ == "__main__":
    main()
