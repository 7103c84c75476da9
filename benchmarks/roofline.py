"""The least time any engine could take for the engine benchmark's workload on this machine.

A bf16 decode step must read every projection weight (and the tied embedding as the LM head) once,
and every sequence's cached keys and values once; a prefill must do its matmul FLOPs. The floor
charges each decode step max(bytes / read bandwidth, FLOPs / matmul peak) and the prefill the same
over all prompt tokens, with both rates measured in this process (the best of a few tries, so the
floor is optimistic). Everything else an engine does (norms, attention arithmetic, sampling, Python)
is left out: no implementation of the same model and batch can beat the floor's tokens per second.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from lora_runtime.models.llama import LlamaModel


@dataclass(frozen=True, slots=True)
class MachineRates:
    read_bytes_per_s: float  # streaming read of a buffer far larger than the caches
    matmul_flops_per_s: float  # a bf16 matmul of prefill shape


@dataclass(frozen=True, slots=True)
class ModelCosts:
    matmul_params: int  # elements of every projection weight and the LM head
    weight_bytes: int  # what one step reads of those weights
    kv_bytes_per_token: int  # keys and values of one token over all layers


def _best_seconds(run, tries: int) -> float:
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure_rates(hidden: int, intermediate: int, tries: int = 5) -> MachineRates:
    """Read bandwidth from summing 512 MiB; matmul peak from [2048, hidden] @ [hidden, intermediate] in bf16."""
    buffer = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    read_s = _best_seconds(buffer.sum, tries)
    x = torch.randn(2048, hidden, dtype=torch.bfloat16)
    w = torch.randn(hidden, intermediate, dtype=torch.bfloat16)
    matmul_s = _best_seconds(lambda: torch.mm(x, w), tries)
    return MachineRates(read_bytes_per_s=buffer.numel() * 4 / read_s,
                        matmul_flops_per_s=2 * x.shape[0] * hidden * intermediate / matmul_s)


def model_costs(model: LlamaModel) -> ModelCosts:
    shape = model.shape
    hidden, q_size, kv_size = shape.hidden_size, shape.q_size, shape.kv_size
    per_layer = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * shape.intermediate_size * hidden
    matmul_params = shape.num_layers * per_layer + shape.vocab_size * hidden
    element_bytes = model.weights.embed_tokens.element_size()
    return ModelCosts(
        matmul_params=matmul_params,
        weight_bytes=matmul_params * element_bytes,
        kv_bytes_per_token=2 * shape.num_layers * kv_size * element_bytes,
    )


def floor_seconds(costs: ModelCosts, rates: MachineRates, prompt_lens: list[int], new_tokens: int) -> float:
    """All prompts prefilled (their last position gives each sequence its first token), then
    `new_tokens - 1` decode steps of every sequence at once."""
    def step_s(bytes_read: float, tokens: int) -> float:
        return max(bytes_read / rates.read_bytes_per_s, 2 * costs.matmul_params * tokens / rates.matmul_flops_per_s)

    total = step_s(costs.weight_bytes, sum(prompt_lens))
    for step in range(1, new_tokens):
        context_tokens = sum(prompt_lens) + step * len(prompt_lens)  # cached before the step, plus the new ones
        total += step_s(costs.weight_bytes + context_tokens * costs.kv_bytes_per_token, len(prompt_lens))
    return total


def workload_floor(model: LlamaModel, prompt_lens: list[int], new_tokens: int) -> dict:
    """The floor of this workload on this machine, with the rates and costs it was computed from."""
    shape = model.shape
    rates = measure_rates(shape.hidden_size, shape.intermediate_size)
    costs = model_costs(model)
    seconds = floor_seconds(costs, rates, prompt_lens, new_tokens)
    return {"tokens_per_s": len(prompt_lens) * new_tokens / seconds, "seconds": seconds,
            "read_gb_per_s": rates.read_bytes_per_s / 1e9, "matmul_gflop_per_s": rates.matmul_flops_per_s / 1e9,
            "weight_mb_per_step": costs.weight_bytes / 1e6}
