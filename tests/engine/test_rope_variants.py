"""Every RoPE variant we serve against HF transformers' own `generate` (float32, atol 1e-4): LongRoPE
with partial rotary (Phi-3/4's configs: short and long factors, `original_max_position_embeddings`
32, the first 0.75 of each head rotated) and Llama with each other scaled variant, prompts under and
over the pretraining length and generations across it, prefilled in chunks, in one batch over a
paged cache, on each CPU backend; recomputed after a preemption; with a PEFT adapter on Phi-3's fused
modules; and the prefix cache, which keeps a long request's LongRoPE blocks apart from a short one's.

HF's Phi-3 `generate` recomputes its cache at the step where a sequence grows past the pretraining
length (short factors before, long after, for every token); so do we, and the tests check that this
differs from keeping the cache (`cached_forward_logits`)."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel
from transformers import AutoTokenizer, DynamicCache, LlamaConfig, Phi3Config

import kernels
from lora_runtime import Engine, EngineConfig, SamplingParams
from lora_runtime.config import SchedulerConfig
from lora_runtime.core import Request
from lora_runtime.embedded import ensure_embedded_model
from lora_runtime.kv_cache import KVCacheManager
from lora_runtime.loader import load_model
from lora_runtime.model_runner import ModelRunner
from lora_runtime.scheduler import Scheduler
from tests.adapters.peft_factory import peft_model, save_adapter
from tests.engine.factories import TINY_DIMS, save_random_model
from tests.engine.test_families_vs_hf import BACKENDS

ATOL = 1e-4
ORIGINAL = 32  # the pretraining length of the LongRoPE configs: prompts and generations cross it
LLAMA_ORIGINAL = 16


def phi3_longrope(scaled: bool = True) -> Phi3Config:
    """Phi-3-mini-128k's / Phi-4-mini's RoPE on a tiny model: 16-wide heads, 12 dims rotated (without
    `scaled`: the plain RoPE over those 12)."""
    scaling = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
               "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 12.0]}
    return Phi3Config(**{**TINY_DIMS, "max_position_embeddings": 128}, partial_rotary_factor=0.75,
                      original_max_position_embeddings=ORIGINAL, tie_word_embeddings=False, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2, rope_scaling=scaling if scaled else None)


LLAMA_ROPE = {
    "linear": {"factor": 4.0},
    "dynamic": {"factor": 2.0},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": LLAMA_ORIGINAL},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": LLAMA_ORIGINAL},
}


def llama_with_rope(rope_type: str) -> LlamaConfig:
    return LlamaConfig(**{**TINY_DIMS, "max_position_embeddings": 64}, tie_word_embeddings=False,
                       rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0, **LLAMA_ROPE[rope_type]})


def hf_generate(model, prompt: list[int], num_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy `generate` of `prompt` alone (EOS off): its tokens, and its logits `[len(prompt) - 1
    + num_new_tokens, vocab]`, the prompt's from the prefill forward, then each step's."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.generation_config.eos_token_id = None
    with torch.no_grad():
        prefill = model(input_ids=torch.tensor([prompt])).logits[0]
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=num_new_tokens, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat([prefill[:-1], torch.cat(out.logits)])


def cached_forward_logits(model, token_ids: list[int], num_prompt_tokens: int) -> torch.Tensor:
    """Logits `[len(token_ids), vocab]` of the prompt in one forward, then each later token alone over
    the cache, which is never recomputed: what a paged cache that kept its keys would give."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        rows = [model(torch.tensor([token_ids[:num_prompt_tokens]]), past_key_values=cache, use_cache=True).logits[0]]
        for token_id in token_ids[num_prompt_tokens:]:
            rows.append(model(torch.tensor([[token_id]]), past_key_values=cache, use_cache=True).logits[0])
    return torch.cat(rows)


def _serve(model_dir, backend: str, prompts: list[list[int]], num_new_tokens: int, num_blocks: int = 64):
    """Our greedy generation of every prompt together, in chunks of at most 16 tokens a step, over
    `num_blocks` blocks of 4 tokens; returns the requests, our logits row at each position of each
    (prompt rows and sampled rows; the last computed where a preemption recomputed one), and the
    scheduler."""
    model = load_model(model_dir, "float32", "cpu", kernels.backend_for("cpu", backend))
    kv = KVCacheManager(num_blocks=num_blocks, block_size_tokens=4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16), kv, recompute_length=model.recompute_length)
    runner = ModelRunner(model, kv, num_blocks, "cpu")
    params = SamplingParams(max_new_tokens=num_new_tokens, decoder_input_details=True)
    requests = [Request(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]
    for request in requests:
        scheduler.add_request(request)
    rows: dict[str, dict[int, torch.Tensor]] = {r.request_id: {} for r in requests}
    while scheduler.num_unfinished:
        output = scheduler.schedule()
        result = runner.execute(output)
        scheduler.update_after_step(output)
        for request, first_position, first_row, num_rows in result.rows.prompt_rows:
            for i in range(num_rows):
                rows[request.request_id][first_position + i] = result.logits[first_row + i]
        for request, row in zip(result.rows.sample_requests, result.rows.sample_rows):
            rows[request.request_id][request.num_tokens - 1] = result.logits[row]
            request.output_token_ids.append(int(result.logits[row].argmax()))
            if len(request.output_token_ids) == num_new_tokens:
                scheduler.finish(request)
    return requests, rows, scheduler


def _assert_matches_hf_generation(hf_model, requests, rows, num_new_tokens: int) -> None:
    for request in requests:
        tokens, expected = hf_generate(hf_model, request.prompt_token_ids, num_new_tokens)
        assert request.output_token_ids == tokens
        positions = sorted(rows[request.request_id])
        assert positions == list(range(request.num_tokens - 1))
        ours = torch.stack([rows[request.request_id][p] for p in positions])
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)


def _prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("backend", BACKENDS)
def test_phi3_longrope_with_partial_rotary_matches_hf_generation(tmp_path, backend: str) -> None:
    """Prompts of 40 and 33 (over 32: long factors throughout, prefilled in chunks), 20, 31 and 32
    (short, their generations crossing 32, where their caches are recomputed with the long factors)
    and 5 (short throughout), in one batch."""
    hf_model = save_random_model(phi3_longrope(), tmp_path)
    requests, rows, _ = _serve(tmp_path, backend, _prompts((40, 20, 31, 32, 33, 5), seed=4), num_new_tokens=14)
    _assert_matches_hf_generation(hf_model, requests, rows, 14)
    crossing = requests[1]
    kept = cached_forward_logits(hf_model, crossing.all_token_ids, crossing.num_prompt_tokens)
    ours = torch.stack([rows[crossing.request_id][p] for p in range(ORIGINAL, crossing.num_tokens - 1)])
    assert (ours - kept[ORIGINAL : crossing.num_tokens - 1]).abs().max() > 10 * ATOL  # the recompute matters


@pytest.mark.parametrize("rope_type", sorted(LLAMA_ROPE))
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_scaled_rope_variant_matches_hf_generation(tmp_path, rope_type: str, backend: str) -> None:
    """Llama with each other scaled variant (pretraining length 16 where the variant has one): prompts
    of 24 and 9, 10 tokens generated (the second crossing 16), in one batch."""
    hf_model = save_random_model(llama_with_rope(rope_type), tmp_path)
    requests, rows, _ = _serve(tmp_path, backend, _prompts((24, 9), seed=6), num_new_tokens=10)
    _assert_matches_hf_generation(hf_model, requests, rows, 10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_phi3_partial_rotary_without_scaling_matches_hf_generation(tmp_path, backend: str) -> None:
    hf_model = save_random_model(phi3_longrope(scaled=False), tmp_path)
    requests, rows, _ = _serve(tmp_path, backend, _prompts((19, 6), seed=5), num_new_tokens=8)
    _assert_matches_hf_generation(hf_model, requests, rows, 8)


def test_longrope_requests_recomputed_after_preemption_keep_hf_generations_rotations(tmp_path) -> None:
    """Too few blocks for both: requests are preempted, one after its generation crossed 32 (its cache
    all long), and recomputed, prompt and generated tokens together, with the same factors."""
    hf_model = save_random_model(phi3_longrope(), tmp_path)
    requests, rows, scheduler = _serve(tmp_path, "torch", _prompts((26, 22), seed=7), num_new_tokens=16,
                                       num_blocks=19)
    assert scheduler.num_preemptions > 0
    _assert_matches_hf_generation(hf_model, requests, rows, 16)


def _engine_with_tokenizer(model_dir, hf_config):
    hf_model = save_random_model(hf_config, model_dir)
    AutoTokenizer.from_pretrained(ensure_embedded_model()).save_pretrained(model_dir)
    return hf_model, Engine.from_config(EngineConfig(model=str(model_dir), dtype="float32"))


def test_phi3_longrope_with_an_adapter_on_its_fused_modules_matches_peft(tmp_path) -> None:
    """A random PEFT adapter on qkv_proj, o_proj, gate_up_proj and down_proj; prompts under and over
    32 with generations crossing it, beside a base-model request: PEFT's cached generation's logprobs
    and greedy tokens."""
    hf_base, engine = _engine_with_tokenizer(tmp_path / "phi3", phi3_longrope())
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    adapter_dir = save_adapter(peft_model(hf_base, config, seed=5), tmp_path / "adapter")
    peft = PeftModel.from_pretrained(hf_base, str(adapter_dir)).eval()
    assignment = [str(adapter_dir), None, str(adapter_dir)]
    params = SamplingParams(max_new_tokens=14, decoder_input_details=True, details=True, ignore_eos_token=True)
    outputs = engine.generate(_prompts((40, 24, 22), seed=8), params, adapters=assignment)
    for output, adapter in zip(outputs, assignment):
        num_prompt = len(output.prompt_token_ids)
        if adapter is None:
            with peft.disable_adapter():
                tokens, logits = hf_generate(peft, output.prompt_token_ids, 14)
        else:
            tokens, logits = hf_generate(peft, output.prompt_token_ids, 14)
        logprobs = torch.log_softmax(logits, dim=-1)
        assert output.token_ids == tokens
        expected = [logprobs[num_prompt - 1 + i, t].item() for i, t in enumerate(output.token_ids)]
        assert [t.logprob for t in output.tokens] == pytest.approx(expected, abs=ATOL)
        expected_prompt = [logprobs[i, t].item() for i, t in enumerate(output.prompt_token_ids[1:])]
        assert [p.logprob for p in output.prefill][1:] == pytest.approx(expected_prompt, abs=ATOL)
    assert len(outputs[1].prompt_token_ids) + 14 > ORIGINAL + 1


def test_a_long_prompt_does_not_reuse_a_short_prompts_longrope_blocks(tmp_path) -> None:
    """A 40-token prompt (long factors throughout) after a 20-token prompt it starts with (short
    factors, its full block of 16 cached): none of the short one's blocks serve it; a second 40-token
    prompt with the same start reuses the first's. Both generate HF's tokens with its logprobs."""
    hf_model, engine = _engine_with_tokenizer(tmp_path / "phi3", phi3_longrope())
    short, rest, other = _prompts((20, 20, 20), seed=9)
    params = SamplingParams(max_new_tokens=3, details=True, ignore_eos_token=True)
    assert engine.generate([short], params)[0].num_cached_tokens == 0
    first = engine.generate([short + rest], params)[0]
    second = engine.generate([short + other], params)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 16
    for output in (first, second):
        tokens, logits = hf_generate(hf_model, output.prompt_token_ids, 3)
        logprobs = torch.log_softmax(logits, dim=-1)
        assert output.token_ids == tokens
        num_prompt = len(output.prompt_token_ids)
        expected = [logprobs[num_prompt - 1 + i, t].item() for i, t in enumerate(output.token_ids)]
        assert [t.logprob for t in output.tokens] == pytest.approx(expected, abs=ATOL)
