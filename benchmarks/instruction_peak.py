"""The bf16 multiply-add peak of one core, from a loop that does nothing else.

The roofline's matmul rate is what a matmul library reaches, which an engine with a better kernel
could exceed. A floor no implementation can beat needs the instruction's own peak: 24 independent
chains of AVX512-BF16 `vdpbf16ps` on registers (each 64 FLOPs over 16 float32 lanes), enough chains
to hide its latency (on the development CPU the rate stops growing at 16). CPUs with AMX multiply
bf16 on tiles, far faster than this instruction: there the probe says nothing and returns None, as it
does where the CPU lacks AVX512-BF16 or the probe cannot be compiled.
"""
from __future__ import annotations

import functools
import logging

from kernels.cpu_ops import cpu_flags

logger = logging.getLogger(__name__)

_CHAINS = 24
_SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdint>

// `seed` is a runtime value so the compiler can neither fold the chains nor merge them into one.
__attribute__((target("avx512f,avx512bf16"))) double bf16_dot_flops(int64_t iterations, double seed) {
  __m512 acc[CHAINS];
  for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(seed * (c + 1)));
  const __m512bh x = (__m512bh)_mm512_set1_ps(static_cast<float>(seed));
  const __m512bh y = (__m512bh)_mm512_set1_ps(static_cast<float>(1e-3 * seed));
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 24
    for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], x, y);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  __m512 sum = acc[0];
  for (int c = 1; c < CHAINS; ++c) sum = _mm512_add_ps(sum, acc[c]);
  volatile float sink = _mm512_reduce_add_ps(sum);  // the chains' results are used
  (void)sink;
  return static_cast<double>(iterations) * CHAINS * 64 / seconds;
}
"""


@functools.cache
def _probe():
    from torch.utils.cpp_extension import load_inline

    return load_inline(name=f"lora_serve_bf16_peak_{_CHAINS}", cpp_sources=_SOURCE.replace("CHAINS", str(_CHAINS)),
                       functions=["bf16_dot_flops"], extra_cflags=["-O2"], verbose=False)


def bf16_instruction_peak(tries: int = 3, iterations: int = 20_000_000) -> float | None:
    """Best of `tries` runs of the probe, in FLOP/s; None where it does not describe this CPU."""
    flags = cpu_flags()
    if "avx512_bf16" not in flags or "amx_bf16" in flags:
        return None
    try:
        probe = _probe()
    except Exception as error:  # no compiler: the roofline keeps the matmul library's rate alone
        logger.warning("bf16 instruction-peak probe unavailable (%s)", error)
        return None
    return max(probe.bf16_dot_flops(iterations, 1.0 + attempt) for attempt in range(tries))


if __name__ == "__main__":
    peak = bf16_instruction_peak()
    print("no AVX512-BF16 peak on this CPU" if peak is None else f"{peak / 1e9:.0f} GFLOP/s bf16 (vdpbf16ps, one core)")
