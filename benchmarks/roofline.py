"""The least time any engine could take for the engine benchmark's workload on this machine, in the
model's dtype.

A decode step must read every projection weight (and the tied embedding as the LM head) once,
and every sequence's cached keys and values once; a prefill must do its matmul FLOPs, the LM head's
only for each prompt's last position (the one row whose logits it needs). The floor charges each
step max(bytes / read bandwidth, FLOPs / matmul peak), with both rates measured in this process (the
best of a few tries, so the floor is optimistic). Everything else an engine does (norms, attention
arithmetic, sampling, Python) is left out.

Two matmul peaks: the rate a matmul library (oneDNN or MKL, through torch) reaches at prefill shape,
and, where `benchmarks.instruction_peak` can measure it, the multiply-add instruction's own peak
(FMA for float32, `vdpbf16ps` or AMX tiles for bf16). No implementation of the same model and
arithmetic can beat the floor at the instruction peak; the floor at the library's rate is what an
engine built on that library can hope for.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from benchmarks.instruction_peak import instruction_peak
from kernels import cpu_ops
from kernels.huge_pages import empty_on_huge_pages
from lora_runtime.models.llama import LlamaModel


@dataclass(frozen=True, slots=True)
class MachineRates:
    read_bytes_per_s: float  # streaming read of a buffer far larger than the caches
    matmul_flops_per_s: float  # a matmul of prefill shape in the model's dtype, or the instruction peak


@dataclass(frozen=True, slots=True)
class ModelCosts:
    layer_params: int  # elements of every layer's projection weights: applied to every token
    head_params: int  # elements of the LM head: applied to the rows that need logits
    weight_bytes: int  # what one decode step reads of all those weights
    kv_bytes_per_token: int  # keys and values of one token over all layers


def _best_seconds(run, tries: int) -> float:
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


READ_STREAMS = (1, 2, 4, 8)


def measure_read_rate(tries: int = 5, buffer_bytes: int = 512 * 1024 * 1024) -> float:
    """Bytes per second of one core's streaming read of `buffer_bytes` (on huge pages where the system
    has them), the best of `tries`: of torch's sum, and where the compiled CPU ops are installed, of
    their read probe (kernels/csrc/peak.cpp: the form's widest loads, 1-8 interleaved streams), which
    reads faster than the sum (Intel Xeon, AVX-512: 17.0 GB/s against 14.4)."""
    buffer = empty_on_huge_pages((buffer_bytes // 4,), torch.float32, "cpu").fill_(1.0)
    best_seconds = _best_seconds(buffer.sum, tries)
    ops = cpu_ops.ops()
    if ops is not None:
        probe_rate = max(ops.peak_read(buffer, streams) for streams in READ_STREAMS for _ in range(tries))
        best_seconds = min(best_seconds, buffer.numel() * 4 / probe_rate)
    return buffer.numel() * 4 / best_seconds


def measure_rates(hidden: int, intermediate: int, dtype: torch.dtype, tries: int = 5) -> MachineRates:
    """Read bandwidth (`measure_read_rate`); matmul peak from [2048, hidden] @ [hidden, intermediate] in `dtype`."""
    read_bytes_per_s = measure_read_rate(tries)
    x = torch.randn(2048, hidden, dtype=dtype)
    w = torch.randn(hidden, intermediate, dtype=dtype)
    matmul_s = _best_seconds(lambda: torch.mm(x, w), tries)
    return MachineRates(read_bytes_per_s=read_bytes_per_s, matmul_flops_per_s=2 * x.shape[0] * hidden * intermediate / matmul_s)


def model_costs(model: LlamaModel) -> ModelCosts:
    shape = model.shape
    hidden, q_size, kv_size = shape.hidden_size, shape.q_size, shape.kv_size
    per_layer = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * shape.intermediate_size * hidden
    layer_params, head_params = shape.num_layers * per_layer, shape.vocab_size * hidden
    element_bytes = model.dtype.itemsize
    return ModelCosts(
        layer_params=layer_params,
        head_params=head_params,
        weight_bytes=(layer_params + head_params) * element_bytes,
        kv_bytes_per_token=2 * shape.num_layers * kv_size * element_bytes,
    )


def floor_seconds(costs: ModelCosts, rates: MachineRates, prompt_lens: list[int], new_tokens: int,
                  serial_bytes: float = 0.0) -> float:
    """All prompts prefilled (their last position gives each sequence its first token), then
    `new_tokens - 1` decode steps of every sequence at once; each step also reads `serial_bytes`
    after its arithmetic instead of under it."""
    def step_s(bytes_read: float, tokens: int, logit_rows: int) -> float:
        flops = 2 * (costs.layer_params * tokens + costs.head_params * logit_rows)
        return max(bytes_read / rates.read_bytes_per_s, flops / rates.matmul_flops_per_s) + serial_bytes / rates.read_bytes_per_s

    num_seqs = len(prompt_lens)
    total = step_s(costs.weight_bytes, sum(prompt_lens), num_seqs)
    for step in range(1, new_tokens):
        context_tokens = sum(prompt_lens) + step * num_seqs  # cached before the step, plus the new ones
        total += step_s(costs.weight_bytes + context_tokens * costs.kv_bytes_per_token, num_seqs, num_seqs)
    return total


def workload_floor(model: LlamaModel, prompt_lens: list[int], new_tokens: int) -> dict:
    """The floor of this workload on this machine, with the rates and costs it was computed from;
    `instruction_tokens_per_s` is the floor at the instruction peak (None where it was not measured)."""
    shape = model.shape
    rates = measure_rates(shape.hidden_size, shape.intermediate_size, model.dtype)
    costs = model_costs(model)
    num_tokens = len(prompt_lens) * new_tokens
    seconds = floor_seconds(costs, rates, prompt_lens, new_tokens)
    floor = {"tokens_per_s": num_tokens / seconds, "seconds": seconds,
             "read_gb_per_s": rates.read_bytes_per_s / 1e9, "matmul_gflop_per_s": rates.matmul_flops_per_s / 1e9,
             "weight_mb_per_step": costs.weight_bytes / 1e6,
             "instruction_gflop_per_s": None, "instruction_tokens_per_s": None}
    peak = instruction_peak(str(model.dtype).removeprefix("torch."))
    if peak is not None:
        at_peak = replace(rates, matmul_flops_per_s=max(peak, rates.matmul_flops_per_s))
        floor["instruction_gflop_per_s"] = at_peak.matmul_flops_per_s / 1e9
        floor["instruction_tokens_per_s"] = num_tokens / floor_seconds(costs, at_peak, prompt_lens, new_tokens)
    return floor
