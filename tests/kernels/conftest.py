"""Kernel-test settings and the backends the tests run each op on.

`cpu_backend` runs a test on the PyTorch backend and on the compiled CPU backend in every
instruction-set form (generic, AVX2, AVX-512, AVX512-BF16, AMX): each form this CPU runs is
exercised, each form it cannot run is skipped with the reason, and the run's summary lists both
(tests/conftest.py). `compiled_form` does the same for the compiled forms alone.

The Triton interpreter checks every int32 add/mul for overflow by redoing it in int64 (its
`sanitize_overflow` option, on by default and not settable per launch), which more than doubles the
interpreted kernels' time; our tests use small shapes where int32 index math cannot overflow, so it
is turned off here to keep the suite fast."""
import dataclasses

import pytest
from triton.runtime import interpreter

import kernels
from kernels import cpu_ops
from tests.device import ON_GPU, TEST_DEVICE

if not ON_GPU:  # (the interpreter's options are its own, and vary between Triton versions)
    interpreter.interpreter_builder.options = dataclasses.replace(
        interpreter.interpreter_builder.options, sanitize_overflow=False
    )


def use_form(request: pytest.FixtureRequest, form: str):
    """Switch the compiled ops to `form` for one test (skipped, with the reason, where it cannot run)."""
    reason = cpu_ops.unavailable_reason(form)
    if reason is not None:
        pytest.skip(reason)
    request.node.user_properties.append(("isa_form", form))
    return cpu_ops.using_form(form)


@pytest.fixture(params=cpu_ops.FORMS)
def compiled_form(request: pytest.FixtureRequest):
    with use_form(request, request.param):
        yield request.param


@pytest.fixture(params=("torch", *(f"cpu-{form}" for form in cpu_ops.FORMS)))
def cpu_backend(request: pytest.FixtureRequest):
    if request.param == "torch":
        yield kernels.backend_for("cpu", "torch")
        return
    with use_form(request, request.param.removeprefix("cpu-")):
        yield kernels.backend_for("cpu", "cpu")


@pytest.fixture
def triton_backend():
    """The Triton backend on the run's test device (tests/device.py)."""
    return kernels.backend_for(TEST_DEVICE, "triton")
