"""One backend per device, chosen once (`kernels.backend_for`), and each op's plan that backend's own."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_ops
from kernels.attention.plans import CompiledAttentionPlan, TorchAttentionPlan, TritonAttentionPlan
from kernels.linear import NO_READS


def test_a_device_gets_one_backend_chosen_once() -> None:
    backend = kernels.backend_for("cpu")
    assert kernels.backend_for(torch.device("cpu")) is backend
    assert backend.name == ("cpu" if cpu_ops.ops() is not None else "torch")
    assert kernels.backend_for("meta").name == "torch"


def test_each_backend_plans_only_for_itself(triton_backend) -> None:
    step = kernels.StepSequences([0, 1, 4], [9, 3], [[2], [0]], 16)
    plans = {name: kernels.backend_for("cpu", name).plan_attention(step)
             for name in ("torch", "triton") + (("cpu",) if cpu_ops.ops() is not None else ())}
    assert isinstance(plans["torch"], TorchAttentionPlan) and isinstance(plans["triton"], TritonAttentionPlan)
    if "cpu" in plans:
        assert isinstance(plans["cpu"], CompiledAttentionPlan)


def test_only_the_compiled_backend_asks_its_matmuls_to_fetch_what_follows(triton_backend) -> None:
    """The compiled matmuls request the KV blocks and adapter pages the next op reads; the library
    matmuls of the other backends take no reads, and are given none."""
    step = kernels.StepSequences([0, 1, 4], [9, 3], [[2, 5, 0], [1]], 4)
    k_cache, v_cache = torch.zeros(6, 4, 3, 8), torch.zeros(6, 4, 3, 8)
    for name in ("torch", "triton"):
        backend = kernels.backend_for("cpu", name)
        assert backend.attention_reads(k_cache, v_cache, backend.plan_attention(step)) == NO_READS
    if cpu_ops.ops() is not None:
        backend = kernels.backend_for("cpu", "cpu")
        reads = backend.attention_reads(k_cache, v_cache, backend.plan_attention(step))
        assert reads.pools == (k_cache, v_cache) and [p.tolist() for p in reads.pages] == [[2, 5, 0, 1]] * 2


def test_the_triton_backend_on_cpu_needs_the_interpreter(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.backend_for("cpu", "triton").__class__(torch.device("cpu"))


def test_unknown_backends_are_refused() -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.backend_for("cpu", "cuda-graphs")
