"""The model's dtype: an explicit one, or "auto", bf16 where the device multiplies it natively and
float32 elsewhere.

Measured on an AVX2-only AMD Zen 3 (one thread, the engine benchmark's 64 requests): bf16 ran at
18.7 tokens per CPU-second against 113 in float32, since without bf16 instructions every bf16
product is widened in software; on AVX512-BF16 and AMX CPUs bf16 is the faster one (half the bytes
to read, and `vdpbf16ps` / tiles do twice the multiply-adds of fp32 FMA)."""
from __future__ import annotations

import torch

from kernels import cpu_ops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(requested: str, device: str) -> tuple[str, str]:
    """(the dtype to load the model in, why), for `requested` "auto" or a name of `DTYPES`."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {requested!r}")
        return requested, "as configured"
    kind = torch.device(device).type
    if kind == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bfloat16", "auto: this GPU multiplies bf16 natively"
        return "float16", "auto: this GPU has no bf16 arithmetic"
    if kind == "cpu":
        if cpu_ops.native_bf16():
            return "bfloat16", f"auto: this CPU multiplies bf16 natively (compiled CPU ops: {cpu_ops.active_form()})"
        return "float32", "auto: this CPU has no bf16 multiply instructions (no AVX512-BF16 or AMX)"
    return "float32", f"auto: float32 on {kind}"
