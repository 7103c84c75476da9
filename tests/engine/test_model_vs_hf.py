"""Our Llama-family model against HF transformers' logits (fp32, atol 1e-4), for prefill, chunked
prefill and decode steps over a paged cache with small scattered blocks, on each CPU backend: the
compiled CPU ops (in this CPU's best form) and the PyTorch backend that serves where they are missing."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_ops
from lora_runtime.config import SchedulerConfig
from lora_runtime.core import Request, SamplingParams
from lora_runtime.kv_cache import KVCacheManager
from lora_runtime.loader import load_model
from lora_runtime.model_runner import ModelRunner
from lora_runtime.scheduler import Scheduler
from tests.engine.factories import save_tiny_model

ATOL = 1e-4


def _hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0]  # [len, vocab]


def _build(tmp_path, model_type: str, max_tokens_per_step: int, backend: str):
    hf_model = save_tiny_model(model_type, tmp_path)
    model = load_model(tmp_path, "float32", "cpu", kernels.backend_for("cpu", backend))
    kv = KVCacheManager(num_blocks=40, block_size_tokens=4)
    # Take blocks out of order so block tables are scattered, not contiguous.
    kv.allocator.allocate(40)
    kv.allocator.release(list(range(39, -1, -3)) + [b for b in range(40) if (39 - b) % 3])
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=max_tokens_per_step), kv)
    return hf_model, scheduler, ModelRunner(model, kv, 40, "cpu")


@pytest.mark.parametrize("model_type", ["llama", "llama-tied", "qwen2", "mistral"])
@pytest.mark.parametrize("max_tokens_per_step", [64, 5])
@pytest.mark.parametrize("backend", [
    pytest.param("cpu", marks=pytest.mark.skipif(cpu_ops.ops() is None, reason="the compiled CPU ops are not installed")),
    "torch",
])
def test_prefill_and_decode_logits_match_hf(tmp_path, model_type: str, max_tokens_per_step: int, backend: str) -> None:
    hf_model, scheduler, runner = _build(tmp_path, model_type, max_tokens_per_step, backend)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 97, (n,), generator=generator).tolist() for n in (11, 3, 7)]
    requests = [
        Request(f"r{i}", prompt, SamplingParams(max_new_tokens=4, decoder_input_details=True))
        for i, prompt in enumerate(prompts)
    ]
    for request in requests:
        scheduler.add_request(request)
    num_decode_steps = 0
    while num_decode_steps < 3:
        output = scheduler.schedule()
        result = runner.execute(output)
        scheduler.update_after_step(output)
        reference = {r.request_id: _hf_logits(hf_model, r.all_token_ids) for r in requests}
        for request, first_position, first_row, num_rows in result.rows.prompt_rows:
            expected = reference[request.request_id][first_position : first_position + num_rows]
            torch.testing.assert_close(result.logits[first_row : first_row + num_rows], expected, atol=ATOL, rtol=0)
        for request, row in zip(result.rows.sample_requests, result.rows.sample_rows):
            torch.testing.assert_close(result.logits[row], reference[request.request_id][-1], atol=ATOL, rtol=0)
            request.output_token_ids.append(int(result.logits[row].argmax()))
        if all(item.num_new_tokens == 1 for item in output.scheduled):
            num_decode_steps += 1
