"""Generation parameters through the whole engine on the embedded model (float32): seeds are batch
invariant, best_of computes the prompt once, ranks its candidates by mean logprob and gives candidate
i the seed + i, stop strings spanning
tokens, truncate, prompt logprobs against HF, watermark detected by transformers, schema outputs
valid under `jsonschema`."""
from __future__ import annotations

import json
import pickle

import jsonschema
import pytest
import torch

from lora_runtime import Engine, SamplingParams, ValidationError
from lora_runtime.sampling import detect_watermark
from tests.engine.factories import chat


def test_seeded_request_gives_the_same_tokens_alone_and_in_different_batches(engine) -> None:
    prompt = chat(engine, "Invent a name for a cat.")
    seeded = SamplingParams(max_new_tokens=12, do_sample=True, temperature=0.9, top_k=50, seed=42)
    alone = engine.generate([prompt], seeded)[0].token_ids
    others = [chat(engine, q) for q in ("Count to five.", "Name a colour.", "Say hello in German.")]
    in_batch = engine.generate([others[0], prompt, others[1]], [SamplingParams(max_new_tokens=20), seeded, SamplingParams(do_sample=True, seed=1)])
    in_other_batch = engine.generate([prompt, *others], [seeded] + [SamplingParams(max_new_tokens=3)] * 3)
    assert in_batch[1].token_ids == alone
    assert in_other_batch[0].token_ids == alone
    other_seed = engine.generate([prompt], SamplingParams(max_new_tokens=12, do_sample=True, temperature=0.9, top_k=50, seed=43))[0]
    assert other_seed.token_ids != alone
    assert in_batch[1].seed == 42


def test_best_of_computes_the_prompt_once_and_returns_the_best_mean_logprob(engine) -> None:
    prompt = chat(engine, "Write a short sentence about rain.")
    params = SamplingParams(max_new_tokens=10, best_of=3, do_sample=True, ignore_eos_token=True)
    request_id = engine.add_request(prompt, params)
    num_prompt = len(engine.tokenizer(prompt)["input_ids"])
    computed_tokens, final = 0, None
    while engine.has_unfinished_requests():
        output = engine.scheduler.schedule()
        computed_tokens += output.num_batched_tokens
        final = _finish_step(engine, output) or final
    assert final is not None and final.request_id == request_id
    candidates = [final, *final.best_of_sequences]
    assert len({c.seed for c in candidates}) == 3 and None not in {c.seed for c in candidates}
    means = [sum(t.logprob for t in c.tokens) / len(c.tokens) for c in candidates]
    assert means == sorted(means, reverse=True)  # the winner, then the others best first
    # The prompt ran once (but for what an earlier test left in the prefix cache); each candidate
    # then computed its own generated tokens but the last.
    assert computed_tokens == num_prompt - final.num_cached_tokens + 3 * (10 - 1)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def _finish_step(engine: Engine, output):
    """Run a step whose schedule was already taken (as Engine.step does after scheduling)."""
    runner_output = engine.runner.execute(output)
    engine.scheduler.update_after_step(output)
    finished = [o for o in engine._sample_and_update(runner_output) if o.finished]
    return finished[0] if finished else None


def test_stop_string_spanning_tokens_stops_and_stays_in_the_text(engine) -> None:
    prompt = "1, 2, 3, 4, 5, 6,"
    free = engine.generate([prompt], SamplingParams(max_new_tokens=12))[0].text
    assert "8, 9" in free, f"the test needs the model to count on: {free!r}"
    stopped = engine.generate([prompt], SamplingParams(max_new_tokens=12, stop=("8, 9",)))[0]
    assert stopped.finish_reason == "stop_sequence"
    assert stopped.text.endswith("8, 9") or "8, 9" in stopped.text[-6:]
    assert len(stopped.text) < len(free)


def test_seeded_best_of_candidate_i_repeats_the_request_alone_with_seed_plus_i(engine) -> None:
    # TGI's wire refuses a seed with best_of (the server's rule); the engine gives candidate i seed + i.
    prompt = chat(engine, "Invent a name for a dog.")
    options = dict(max_new_tokens=6, do_sample=True, temperature=1.5, ignore_eos_token=True, top_logprobs=2)
    final = engine.generate([prompt], SamplingParams(best_of=3, seed=42, **options))[0]
    candidates = [final, *final.best_of_sequences]
    assert sorted(c.seed for c in candidates) == [42, 43, 44]
    for candidate in candidates:
        alone = engine.generate([prompt], SamplingParams(seed=candidate.seed, **options))[0]
        assert candidate.token_ids == alone.token_ids
        assert _top_ids(candidate) == _top_ids(alone)
        for ours, reference in zip(candidate.tokens, alone.tokens):
            assert [t.logprob for t in ours.top] == pytest.approx([t.logprob for t in reference.top], abs=1e-5)
        assert all(len(t.top) == 2 for t in candidate.tokens)


def _top_ids(output) -> list[list[int]]:
    return [[top.id for top in token.top] for token in output.tokens]


def test_truncate_keeps_exactly_the_last_tokens(engine) -> None:
    prompt = "alpha beta gamma delta epsilon zeta eta theta"
    ids = engine.tokenizer(prompt)["input_ids"]
    output = engine.generate([prompt], SamplingParams(max_new_tokens=2, truncate=3))[0]
    assert output.prompt_token_ids == ids[-3:]
    with pytest.raises(ValidationError) as error:
        engine.add_request(prompt, SamplingParams(truncate=10**6))
    assert error.value.field == "truncate"


def test_prompt_logprobs_equal_hf_log_softmax(engine, hf_embedded_model) -> None:
    prompt = chat(engine, "Why is the sky blue?")
    output = engine.generate([prompt], SamplingParams(max_new_tokens=1, decoder_input_details=True))[0]
    ids = output.prompt_token_ids
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_embedded_model(torch.tensor([ids])).logits[0], dim=-1)
    expected = [logprobs[i, t].item() for i, t in enumerate(ids[1:])]
    assert output.prefill[0].logprob is None
    assert [p.logprob for p in output.prefill[1:]] == pytest.approx(expected, abs=1e-4)


def test_watermarked_text_is_detected_by_transformers_and_by_ours(engine) -> None:
    from transformers import LlamaConfig, WatermarkDetector, WatermarkingConfig

    prompt = chat(engine, "Tell me a long story about a dragon and a knight.")
    params = dict(max_new_tokens=80, do_sample=True, seed=3, ignore_eos_token=True)
    marked = engine.generate([prompt], SamplingParams(watermark=True, **params))[0]
    plain = engine.generate([prompt], SamplingParams(**params))[0]
    vocab = engine.model.shape.vocab_size
    last = marked.prompt_token_ids[-1]
    ours_marked = detect_watermark(last, marked.token_ids, vocab)
    ours_plain = detect_watermark(last, plain.token_ids, vocab)
    assert ours_marked.z_score > 4 and ours_plain.z_score < 2
    config = WatermarkingConfig(greenlist_ratio=0.5, bias=2.0, hashing_key=15485863, seeding_scheme="lefthash", context_width=1)
    model_config = LlamaConfig(vocab_size=vocab, bos_token_id=vocab - 1)  # a bos id that never occurs here
    detector = WatermarkDetector(model_config=model_config, device="cpu", watermarking_config=config)
    z = detector(torch.tensor([[last, *marked.token_ids]]), return_dict=True).z_score[0]
    assert z == pytest.approx(ours_marked.z_score, abs=1e-3)


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "pet": {"enum": ["cat", "dog", "none"]}},
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("sampled", [False, True])
def test_schema_outputs_validate(engine, sampled: bool) -> None:
    prompt = chat(engine, "Describe a person as JSON.")
    extra = dict(do_sample=True, seed=11, temperature=1.2) if sampled else {}
    output = engine.generate([prompt], SamplingParams(max_new_tokens=60, schema=json.dumps(SCHEMA), **extra))[0]
    assert output.finish_reason == "eos_token"
    jsonschema.validate(json.loads(output.text), SCHEMA)


def test_uncompilable_schema_is_refused_before_generation(engine) -> None:
    with pytest.raises(ValidationError) as error:
        engine.add_request("hi", SamplingParams(schema='{"type": "string", "format": "no-such-format", "uniqueItems": true, "not": {}}'))
    assert error.value.field == "schema"


CUSTOM_TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}<<assistant>>"


def test_apply_chat_template_renders_text_or_messages_with_the_base_template(engine) -> None:
    from lora_runtime.validation import prepare_prompt

    params = SamplingParams(max_new_tokens=4, apply_chat_template=True)
    expected = chat(engine, "What is 2 + 2?")
    for inputs in ("What is 2 + 2?", json.dumps([{"role": "user", "content": "What is 2 + 2?"}])):
        output = engine.generate([inputs], params)[0]
        assert output.prompt == expected
        assert output.prompt_token_ids == engine.tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert prepare_prompt("hi", params, engine.info, engine.kv_capacity, CUSTOM_TEMPLATE)[0] == "<<user>>hi<<assistant>>"
    with pytest.raises(ValidationError) as error:
        engine.add_request(json.dumps([{"role": "user"}]), params)
    assert error.value.field == "inputs"


def test_a_request_is_validated_from_the_engine_info_and_the_kv_capacity_alone(engine) -> None:
    """What a front end holds of an engine (its `EngineInfo`, picklable) and the KV cache's capacity
    decide the checks: a cache with room for 4 new tokens refuses 8, which the engine's own accepts."""
    from lora_runtime.validation import KVCapacity, prepare_prompt

    info = pickle.loads(pickle.dumps(engine.info))
    params = SamplingParams(max_new_tokens=8)
    _, token_ids, _ = prepare_prompt("hi", params, info, engine.kv_capacity)
    assert token_ids == engine.tokenizer("hi")["input_ids"]
    small = KVCapacity(num_blocks=len(token_ids) + 4, block_size_tokens=1)
    with pytest.raises(ValidationError, match=f"the cache holds {len(token_ids) + 4}") as error:
        prepare_prompt("hi", params, info, small)
    assert error.value.field == "max_new_tokens"
    assert prepare_prompt("hi", SamplingParams(max_new_tokens=None), info, small)[2].max_new_tokens == 4  # the room


def test_add_request_takes_a_typed_adapter_request_and_generate_takes_ids(engine) -> None:
    with pytest.raises(ValidationError) as error:
        engine.add_request("hi", SamplingParams(max_new_tokens=1), "org/name")
    assert error.value.field == "adapter" and "parse_adapter" in error.value.message
    assert not engine.has_unfinished_requests()
