"""The frequency/presence penalties, logit_bias, top_logprobs and regex through the whole engine on
the embedded model (float32), against HF transformers' logits and the formulas of docs/semantics.md."""
from __future__ import annotations

import re

import pytest
import torch

from lora_runtime import SamplingParams, ValidationError
from tests.engine.factories import chat


def _hf_log_softmax(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([token_ids])).logits[0], dim=-1)  # [len, vocab]


def _reference_top(logprobs: torch.Tensor, n: int) -> list[tuple[int, float]]:
    """The n largest of `logprobs` [vocab], ties to the lower id (a stable sort keeps id order)."""
    order = torch.sort(logprobs, descending=True, stable=True).indices[:n]
    return list(zip(order.tolist(), logprobs[order].tolist()))


def _assert_top_matches(top, reference: list[tuple[int, float]], tokenizer) -> None:
    assert [t.id for t in top] == [t for t, _ in reference]
    assert [t.logprob for t in top] == pytest.approx([v for _, v in reference], abs=1e-4)
    assert [t.text for t in top] == [tokenizer.decode([t.id]) for t in top]


def _num_repeats(token_ids: list[int]) -> int:
    return len(token_ids) - len(set(token_ids))


def test_a_large_frequency_penalty_repeats_less(engine) -> None:
    prompts = ["the the the the the the", chat(engine, "Write a list of fruits.")]
    options = dict(max_new_tokens=40, ignore_eos_token=True)
    plain = engine.generate(prompts, SamplingParams(**options))
    penalised = engine.generate(prompts, SamplingParams(frequency_penalty=2.0, **options))
    assert sum(_num_repeats(o.token_ids) for o in penalised) < sum(_num_repeats(o.token_ids) for o in plain)


def test_top_logprobs_of_greedy_tokens_and_prompt_equal_hf(engine, hf_embedded_model) -> None:
    prompt = chat(engine, "Name three rivers.")
    params = SamplingParams(max_new_tokens=8, top_logprobs=5, decoder_input_details=True)
    output = engine.generate([prompt], params)[0]
    ids = output.prompt_token_ids + output.token_ids
    logprobs = _hf_log_softmax(hf_embedded_model, ids[:-1])
    num_prompt = len(output.prompt_token_ids)
    for k, token in enumerate(output.tokens):
        # Greedy: the most likely token is the chosen one, with the same logprob.
        assert (token.top[0].id, token.top[0].logprob) == (token.id, token.logprob)
        _assert_top_matches(token.top, _reference_top(logprobs[num_prompt - 1 + k], 5), engine.tokenizer)
    assert output.prefill[0].top == ()
    for t in range(1, num_prompt):
        _assert_top_matches(output.prefill[t].top, _reference_top(logprobs[t - 1], 5), engine.tokenizer)
    plain = engine.generate([prompt], SamplingParams(max_new_tokens=2, decoder_input_details=True))[0]
    assert all(t.top == () for t in plain.tokens) and all(p.top == () for p in plain.prefill)


def test_penalties_and_bias_of_the_first_step_follow_the_formula(engine, hf_embedded_model) -> None:
    # sequence_fraction counts the prompt: the very first step is penalised, as c / len(prompt).
    prompt = "one two two three three three"
    prompt_ids = engine.tokenizer(prompt)["input_ids"]
    biased = prompt_ids[0]
    params = SamplingParams(max_new_tokens=1, top_logprobs=6, frequency_penalty=1.5, presence_penalty=0.5,
                            penalty_counts="sequence_fraction", logit_bias=[(biased, 3.0)])
    output = engine.generate([prompt], params)[0]
    with torch.no_grad():
        logits = hf_embedded_model(torch.tensor([prompt_ids])).logits[0, -1]  # [vocab]
    counts = torch.bincount(torch.tensor(prompt_ids), minlength=logits.shape[0]).float() / len(prompt_ids)
    expected = logits - 1.5 * counts - 0.5 * (counts > 0).float()
    expected[biased] += 3.0
    _assert_top_matches(output.tokens[0].top, _reference_top(torch.log_softmax(expected, -1), 6), engine.tokenizer)


def test_logit_bias_steers_greedy_and_ids_outside_the_vocabulary_are_refused(engine) -> None:
    prompt = chat(engine, "Say something.")
    target = engine.tokenizer(" banana", add_special_tokens=False)["input_ids"][0]
    output = engine.generate([prompt], SamplingParams(max_new_tokens=4, logit_bias=[(target, 100.0)]))[0]
    assert output.token_ids == [target] * 4
    with pytest.raises(ValidationError) as error:
        engine.add_request(prompt, SamplingParams(logit_bias=[(engine.model.shape.vocab_size, 1.0)]))
    assert error.value.field == "logit_bias"


REGEXES = [r"\d{4}-\d{2}-\d{2}", r"(red|green|blue) (cat|dog)", r"[a-z]{3,8}@[a-z]{3,8}\.com", r"-?\d{1,3}"]


def test_regex_outputs_ending_with_eos_fully_match(engine) -> None:
    prompt = chat(engine, "Answer briefly.")
    params = [SamplingParams(max_new_tokens=30, regex=regex, do_sample=True, seed=seed, temperature=1.2)
              for regex in REGEXES for seed in (5, 6)]
    outputs = engine.generate([prompt] * len(params), params)
    for p, output in zip(params, outputs):
        assert output.finish_reason == "eos_token", (p.regex, output.text)
        assert re.fullmatch(p.regex, output.text), (p.regex, output.text)


def test_bad_regexes_are_refused_before_generation(engine) -> None:
    for params in (SamplingParams(regex="(?=a)b"), SamplingParams(regex="[0-9")):
        with pytest.raises(ValidationError) as error:
            engine.add_request("hi", params)
        assert error.value.field == "regex"
    assert not engine.has_unfinished_requests()
