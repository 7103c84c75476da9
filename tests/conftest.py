"""Test-wide settings. TRITON_INTERPRET must be set before any Triton kernel module is imported,
so that Triton kernels run on CPU tensors in the interpreter (there is no GPU in CI); with
LORA_TEST_DEVICE=cuda (tests/device.py) it is cleared instead, and the kernels compile for the GPU."""
import os

from tests.device import DEVICE_VARIABLE, ON_GPU

if ON_GPU:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if ON_GPU and not torch.cuda.is_available():
    raise pytest.UsageError(f"{DEVICE_VARIABLE}=cuda, but torch sees no CUDA device")

# Under contention two threads made small ops ~300x slower (docs/semantics.md, "Tests on CPU"): one
# thread here, and in the engines the tests build and the servers they start (whose default is
# OMP_NUM_THREADS where set: lora_runtime/threads.py); tests of threads set their own.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    torch.manual_seed(0)


# Which instruction-set forms of the compiled CPU ops this run exercised (tests/kernels/conftest.py
# tags each test that ran in a form). Collected from the test reports, which pytest-xdist's workers
# send to the main process, where the summary is printed.
_FORMS_EXERCISED: set[str] = set()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.passed:
        _FORMS_EXERCISED.update(value for key, value in report.user_properties if key == "isa_form")


def pytest_terminal_summary(terminalreporter) -> None:
    from kernels import cpu_ops

    lines = [f"exercised: {', '.join(f for f in cpu_ops.FORMS if f in _FORMS_EXERCISED) or 'none'}"]
    for form in cpu_ops.FORMS:
        reason = cpu_ops.unavailable_reason(form)
        if form not in _FORMS_EXERCISED and reason is not None:
            lines.append(f"not exercised: {form} ({reason})")
    terminalreporter.write_sep("-", "compiled CPU op forms")
    for line in lines:
        terminalreporter.write_line(line)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail, before its fixtures start, a grouped test that `--dist loadgroup` did not group: tests
    of one xdist_group share a session fixture (a server, a Ray cluster) and assume they are its
    only users; spread over two workers, each starts its own and they load each other's machine."""
    if getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group") \
            and "@" not in item.nodeid:
        pytest.fail("pytest-xdist did not apply --dist loadgroup: this pytest and pytest-xdist do not "
                    "work together (see requirements.txt)", pytrace=False)
