"""Each family we serve beyond Llama (Qwen3, Granite, OLMo 2, SmolLM3, Phi-3, Gemma 2, Gemma 3 text),
a tiny random model from transformers' own config class with the family's features switched on
(tests/engine/factories.py: windows shorter than the prompts, soft caps, multipliers, NoPE layers,
fused checkpoints), against HF transformers' logits in float32 (atol 1e-4): prompts several times the
window, prefilled whole and in chunks, and decode steps, mixed in one batch over a paged cache with
scattered blocks, on each CPU backend."""
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
from tests.engine.factories import FAMILY_CONFIGS, WINDOW, save_tiny_model
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


@pytest.mark.parametrize("family", ["mistral-window", "phi3"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_blocks_outside_every_window_are_released_and_long_contexts_served(tmp_path, family: str, backend: str) -> None:
    """Models whose every layer has a window: prompts and generations several times the window, in
    chunks of 4 tokens, match HF's logits while each request holds only the blocks its window reads;
    the released blocks are counted."""
    hf_model = save_tiny_model(family, tmp_path)
    model = load_model(tmp_path, "float32", "cpu", kernels.backend_for("cpu", backend))
    window = model.features.max_window
    assert window in (WINDOW, WINDOW + 1)
    kv = KVCacheManager(num_blocks=40, block_size_tokens=4, window=window)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=4), kv)
    runner = ModelRunner(model, kv, 40, "cpu")
    generator = torch.Generator().manual_seed(3)
    requests = [Request(f"r{i}", torch.randint(3, 97, (n,), generator=generator).tolist(), SamplingParams())
                for i, n in enumerate((23, 9))]
    for request in requests:
        scheduler.add_request(request)
    most_held = 0
    while min(len(r.output_token_ids) for r in requests) < 14:
        output = scheduler.schedule()
        result = runner.execute(output)
        scheduler.update_after_step(output)
        for request, row in zip(result.rows.sample_requests, result.rows.sample_rows):
            expected = _hf_logits(hf_model, request.all_token_ids)[-1]
            torch.testing.assert_close(result.logits[row], expected, atol=ATOL, rtol=0)
            request.output_token_ids.append(int(result.logits[row].argmax()))
        most_held = max(most_held, kv.num_blocks - kv.num_free_blocks)
    # Each holds the blocks of its window and of one chunk (4): at most ceil((window - 1 + 4) / 4) + 1.
    assert most_held <= 2 * (-(-(window + 3) // 4) + 1)
    lengths = [r.num_computed_tokens for r in requests]
    expected_released = sum(max(0, n - window + 1) // 4 for n in lengths)
    assert kv.num_released_outside_window == expected_released >= 8


def test_a_sharded_checkpoint_loads_tensor_by_tensor_across_its_files(tmp_path) -> None:
    """A checkpoint saved in shards with an index (as real ones are) serves the same logits as HF."""
    from transformers import AutoModelForCausalLM

    from tests.engine.factories import tiny_config

    torch.manual_seed(2)
    hf_model = AutoModelForCausalLM.from_config(tiny_config("gemma3_text"), dtype=torch.float32).eval()
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    model = load_model(tmp_path, "float32", "cpu", kernels.backend_for("cpu", "torch"))
    kv = KVCacheManager(num_blocks=8, block_size_tokens=4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv)
    runner = ModelRunner(model, kv, 8, "cpu")
    request = Request("r", list(range(3, 16)), SamplingParams(decoder_input_details=True))
    scheduler.add_request(request)
    result = runner.execute(scheduler.schedule())
    _, first_position, first_row, num_rows = result.rows.prompt_rows[0]
    expected = _hf_logits(hf_model, request.all_token_ids)[first_position : first_position + num_rows]
    torch.testing.assert_close(result.logits[first_row : first_row + num_rows], expected, atol=ATOL, rtol=0)
