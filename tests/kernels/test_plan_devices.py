"""The Triton backend's per-step plans hold every tensor on the device the kernels run on (built once
per step, uploaded before the first layer, never moved inside the step). Checked on PyTorch's "meta"
device, which any CPU has."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from kernels import StepSequences
from kernels.attention.plans import TritonAttentionPlan
from kernels.lora.plans import PageTable, TritonLoraPlan

META = torch.device("meta")


def _tensors(plan) -> list[torch.Tensor]:
    values = [getattr(plan, field.name) for field in dataclasses.fields(plan)]
    values += [item for value in values if isinstance(value, Mapping) for item in value.values()]
    return [value for value in values if isinstance(value, torch.Tensor)]


def test_attention_plan_tensors_are_on_the_device() -> None:
    step = StepSequences([0, 1, 4], [5, 3], [[0], [1]], 16)
    tensors = _tensors(TritonAttentionPlan.build(step, META))
    assert len(tensors) == 5 and {t.device for t in tensors} == {META}


def test_lora_plan_tensors_are_on_the_device() -> None:
    tables = {"q_proj": PageTable((16, 0), ((2,), ())), "v_proj": PageTable((4, 20), ((0,), (1, 3)))}
    tensors = _tensors(TritonLoraPlan.build([0, -1, 1, 1], tables, META))
    assert len(tensors) == 5 + 2 * len(tables) and {t.device for t in tensors} == {META}
