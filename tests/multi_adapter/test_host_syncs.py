"""What a step reads back from the device: on CUDA each read (`.item()`, `.tolist()`, `.cpu()`,
`bool(t)`, ...) waits for every kernel queued before it, so a read inside the step would stall the
launches behind it. A greedy step may read exactly once, the sampled tokens (with their logprobs),
after the forward pass; the forward pass itself reads nothing.

Counted on CPU tensors with the Triton backend (in the interpreter), as the engine would run on CUDA:
every call of those methods made from our own code (lora_runtime/, kernels/) is recorded with its
line, so a read added anywhere on the step's path shows up by name."""
from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lora_runtime import SamplingParams
from lora_runtime.models.llama import LlamaModel
from tests.multi_adapter.conftest import make_engine

# Tensor methods that copy device memory to the host, waiting for the device to finish first.
DEVICE_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
OUR_CODE = tuple(str(Path(__file__).resolve().parents[2] / package) for package in ("lora_runtime", "kernels"))
PROMPTS = [[5, 17, 33, 9, 60, 2 + i, 77][: 4 + i % 4] for i in range(6)]
ASSIGNMENT = ["q_v_r8", None, "all_linear_r4", "rslora_r16", "q_v_r8", "patterns"]


class ReadLog:
    """Where our code read device memory back, split into reads inside `LlamaModel.forward` and the rest."""

    def __init__(self) -> None:
        self.in_forward: Counter[str] = Counter()
        self.outside: Counter[str] = Counter()
        self.forward_depth = 0

    def record(self, method: str) -> None:
        caller = sys._getframe(2)
        if caller.f_code.co_filename.startswith(OUR_CODE):
            where = f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno} {method}"
            (self.in_forward if self.forward_depth else self.outside)[where] += 1


@contextlib.contextmanager
def logged_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[ReadLog]:
    log = ReadLog()
    for method in DEVICE_READS:
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method, _recording(original, method, log))
    forward = LlamaModel.forward

    def logged_forward(self, *args, **kwargs):
        log.forward_depth += 1
        try:
            return forward(self, *args, **kwargs)
        finally:
            log.forward_depth -= 1

    monkeypatch.setattr(LlamaModel, "forward", logged_forward)
    yield log
    monkeypatch.undo()


def _recording(original, method: str, log: ReadLog):
    def recording(self, *args, **kwargs):
        log.record(method)
        return original(self, *args, **kwargs)

    return recording


def test_a_greedy_step_reads_the_device_once(monkeypatch, tiny_dir, adapter_dirs) -> None:
    """Mixed adapters and base-model requests, prefill then decode steps: one read per step."""
    engine = make_engine(tiny_dir, backend="triton")
    adapters = [None if name is None else str(adapter_dirs[name]) for name in ASSIGNMENT]
    for prompt, adapter in zip(PROMPTS, adapters):
        engine.add_request(prompt, SamplingParams(max_new_tokens=4, ignore_eos_token=True), engine.parse_adapter(adapter))
    while engine.scheduler.waiting:  # admitted once their adapters have loaded
        engine.step()
    steps = []
    while engine.has_unfinished_requests():
        with logged_reads(monkeypatch) as log:
            engine.step()
        steps.append(log)
    assert len(steps) >= 3
    for log in steps:
        assert not log.in_forward, f"the forward pass read the device: {dict(log.in_forward)}"
        assert sum(log.outside.values()) == 1, f"a step read the device more than once: {dict(log.outside)}"
