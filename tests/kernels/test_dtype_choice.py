"""`dtype="auto"` on CPU follows the compiled form serving: bf16 where its matmuls multiply bf16 at
float32's rate or better (the AVX-512 forms), float32 where bf16 would be the slower one."""
from __future__ import annotations

import pytest

from kernels import cpu_ops
from lora_runtime.dtypes import resolve_dtype
from tests.kernels.conftest import use_form

EXPECTED = {"generic": "float32", "avx2": "float32", "avx512": "bfloat16", "avx512_bf16": "bfloat16", "amx": "bfloat16"}


def test_auto_picks_by_the_form_serving(compiled_form: str) -> None:
    dtype, why = resolve_dtype("auto", "cpu")
    assert dtype == EXPECTED[compiled_form]
    assert why.startswith("auto: ") and (compiled_form in why or dtype == "float32")


def test_the_avx512_form_multiplies_bf16_widened(request: pytest.FixtureRequest) -> None:
    with use_form(request, "avx512"):
        assert cpu_ops.bf16_matmul() == "widened to float32"
        assert "widened" in resolve_dtype("auto", "cpu")[1]


def test_an_explicit_dtype_wins_and_a_wrong_one_is_named() -> None:
    assert resolve_dtype("float32", "cpu") == ("float32", "as configured")
    assert resolve_dtype("bfloat16", "cpu") == ("bfloat16", "as configured")
    with pytest.raises(ValueError, match="'fp8'"):
        resolve_dtype("fp8", "cpu")
