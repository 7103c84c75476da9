"""Each family we serve beyond Llama (Qwen3, Granite, OLMo 2, SmolLM3, Phi-3, Gemma 2, Gemma 3 text),
a tiny random model from transformers' own config class with the family's features switched on
(tests/engine/factories.py: windows shorter than the prompts, soft caps, multipliers, NoPE layers,
fused checkpoints), against HF transformers' logits in float32 (atol 1e-4): prompts several times the
window, prefilled whole and in chunks, and decode steps, mixed in one batch over a paged cache with
scattered blocks, on each CPU backend."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops
from lora_runtime.core import Request, SamplingParams
from tests.engine.factories import FAMILY_CONFIGS
from tests.engine.test_model_vs_hf import ATOL, _build, _hf_logits

BACKENDS = [
    pytest.param("cpu", marks=pytest.mark.skipif(cpu_ops.ops() is None, reason="the compiled CPU ops are not installed")),
    "torch",
]


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_family_logits_and_greedy_tokens_match_hf(tmp_path, family: str, backend: str) -> None:
    hf_model, scheduler, runner = _build(tmp_path, family, 6, backend)
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 97, (n,), generator=generator).tolist() for n in (17, 3, 12)]
    requests = [Request(f"r{i}", prompt, SamplingParams(max_new_tokens=6, decoder_input_details=True))
                for i, prompt in enumerate(prompts)]
    for request in requests:
        scheduler.add_request(request)
    while min(len(r.output_token_ids) for r in requests) < 5:
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
    for request in requests:  # greedy: each token is HF's argmax after the tokens before it
        with torch.no_grad():
            logits = _hf_logits(hf_model, request.all_token_ids)
        expected = logits[request.num_prompt_tokens - 1 : -1].argmax(-1).tolist()
        assert request.output_token_ids == expected and len(expected) >= 5
