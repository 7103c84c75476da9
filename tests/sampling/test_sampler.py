"""Per-request generators, batch independence, logprobs, and transformers' generate as the seed oracle."""
from __future__ import annotations

import pytest
import torch

from lora_runtime.core import SamplingParams
from lora_runtime.errors import ValidationError
from lora_runtime.sampling import Sampler, SamplingState, TokenizerInfo, next_token_logprobs, prompt_logprobs
from lora_runtime.sampling.processors import apply_logits_chain
from lora_runtime.sampling.sampler import top_tokens
from tests.sampling.generation import generate

VOCAB = 500
STEPS = 12
PROMPT = [5, 17, 17, 42]


@pytest.fixture(scope="module")
def info() -> TokenizerInfo:
    return TokenizerInfo(tokenizer=None, vocab_size=VOCAB, eos_token_ids=[0])


def _run_batches(batches: list[list[tuple[str, SamplingParams]]], info: TokenizerInfo) -> dict[str, list[int]]:
    """Step several batch compositions; request `name` always sees the same logits at step t."""
    logits_of = {name: torch.randn(STEPS, VOCAB, generator=torch.Generator().manual_seed(hash(name) % 1000))
                 for batch in batches for name, _ in batch}
    results: dict[str, list[int]] = {}
    for batch in batches:
        states = [SamplingState(params, PROMPT, info) for _, params in batch]
        for step in range(STEPS):
            logits = torch.stack([logits_of[name][step] for name, _ in batch])  # [num_rows, vocab]
            for state, token_id in zip(states, Sampler().sample(logits, states).token_ids):
                state.accept(token_id)
        for (name, _), state in zip(batch, states):
            results.setdefault(name, state.token_ids)
            assert results[name] == state.token_ids, f"{name} changed with the batch"
    return results


def test_seeded_tokens_do_not_depend_on_the_batch(info: TokenizerInfo) -> None:
    seeded = SamplingParams(do_sample=True, seed=7, top_k=50, top_p=0.9, repetition_penalty=1.2)
    others = [
        ("greedy", SamplingParams()),
        ("hot", SamplingParams(temperature=1.5, seed=3)),
        ("watermark", SamplingParams(do_sample=True, seed=9, watermark=True, typical_p=0.9)),
    ]
    results = _run_batches(
        [[("seeded", seeded)], [others[0], ("seeded", seeded), others[1]], [*others, ("seeded", seeded)]], info
    )
    different_seed = _run_batches([[("seeded", SamplingParams(do_sample=True, seed=8, top_k=50, top_p=0.9,
                                                              repetition_penalty=1.2))]], info)
    assert results["seeded"] != different_seed["seeded"]


def test_random_seed_is_reported_and_reproduces(info: TokenizerInfo) -> None:
    params = SamplingParams(do_sample=True, temperature=2.0)
    first, second = SamplingState(params, PROMPT, info), SamplingState(params, PROMPT, info)
    assert first.seed is not None and first.seed != second.seed
    replay = SamplingState(SamplingParams(do_sample=True, temperature=2.0, seed=first.seed), PROMPT, info)
    logits = torch.randn(STEPS, VOCAB)
    for step in range(STEPS):
        original = Sampler().sample(logits[step : step + 1], [first]).token_ids
        assert Sampler().sample(logits[step : step + 1], [replay]).token_ids == original
    assert SamplingState(SamplingParams(temperature=0.0, top_k=5), PROMPT, info).seed is None


def test_best_of_candidates_draw_their_own_reported_seeds(info: TokenizerInfo) -> None:
    # Without a request seed each candidate draws one, reported to replay it alone.
    params = SamplingParams(do_sample=True, best_of=3)
    candidates = [SamplingState(params, PROMPT, info) for _ in range(3)]
    assert len({c.seed for c in candidates}) == 3 and None not in {c.seed for c in candidates}
    alone = SamplingState(SamplingParams(do_sample=True, seed=candidates[2].seed), PROMPT, info)
    logits = torch.randn(4, VOCAB)
    assert Sampler().sample(logits[:1], [candidates[2]]).token_ids == Sampler().sample(logits[:1], [alone]).token_ids


def test_seeded_best_of_candidate_i_draws_with_seed_plus_i(info: TokenizerInfo) -> None:
    params = SamplingParams(do_sample=True, best_of=3, seed=2**64 - 2)
    candidates = [SamplingState(params, PROMPT, info, candidate_index=i) for i in range(3)]
    assert [c.seed for c in candidates] == [2**64 - 2, 2**64 - 1, 0]  # mod 2**64
    logits = torch.randn(1, VOCAB)
    for candidate in candidates:
        alone = SamplingState(SamplingParams(do_sample=True, seed=candidate.seed), PROMPT, info)
        draws = [Sampler().sample(logits, [state]).token_ids[0] for state in (candidate, alone) for _ in range(5)]
        assert draws[:5] == draws[5:]


def _dense_counts(token_ids: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(token_ids, dtype=torch.int64), minlength=VOCAB).float()  # [vocab]


@pytest.mark.parametrize("penalty_counts", ["output", "sequence_fraction"])
def test_penalty_counts_are_kept_step_by_step(info: TokenizerInfo, penalty_counts: str) -> None:
    params = SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4, penalty_counts=penalty_counts)
    state = SamplingState(params, PROMPT, info)
    # Nothing generated yet: "output" has nothing to count, so the row stays on the identity path.
    assert state.row_settings().is_identity == (penalty_counts == "output")
    logits = torch.randn(1, VOCAB) * 3
    for token_id in [17, 3, 3, 99, 17, 17, 5]:
        state.accept(token_id)
        counted = state.token_ids if penalty_counts == "output" else PROMPT + state.token_ids
        counts = _dense_counts(counted)
        if penalty_counts == "sequence_fraction":
            counts = counts / len(counted)
        expected = logits[0] - 0.7 * counts + 0.4 * (counts > 0).float()
        torch.testing.assert_close(apply_logits_chain(logits, [state.row_settings()])[0], expected)


def test_penalties_of_zero_and_no_bias_keep_the_identity_path(info: TokenizerInfo) -> None:
    state = SamplingState(SamplingParams(frequency_penalty=0.0, presence_penalty=0.0,
                                         penalty_counts="sequence_fraction"), PROMPT, info)
    state.accept(3)
    assert state.row_settings().is_identity


def test_logit_bias_id_outside_the_vocabulary_is_refused(info: TokenizerInfo) -> None:
    assert not SamplingState(SamplingParams(logit_bias=[(VOCAB - 1, 1.0)]), PROMPT, info).row_settings().is_identity
    with pytest.raises(ValidationError) as error:
        SamplingState(SamplingParams(logit_bias=[(1, 1.0), (VOCAB, 1.0)]), PROMPT, info)
    assert error.value.field == "logit_bias"


def _reference_top(logprobs: torch.Tensor, n: int) -> list[tuple[int, float]]:
    """Sort every id by (logprob descending, id), keep n, drop -inf: the spec of top_tokens, in Python."""
    values = logprobs.tolist()
    ranked = sorted(range(len(values)), key=lambda t: (-values[t], t))[:n]
    return [(t, values[t]) for t in ranked if values[t] != float("-inf")]


def test_top_tokens_are_exactly_n_with_ties_to_the_lower_id() -> None:
    logprobs = torch.log_softmax(torch.randn(4, VOCAB), dim=-1)
    logprobs[0, [400, 7, 250, 3, 90]] = -0.5  # a five-way tie for the top: n = 3 keeps 3, 7, 90
    logprobs[1, :] = -6.2  # all tied
    logprobs[2, 10:] = float("-inf")  # only ten possible tokens
    logprobs[3, [13, 11, 12]] = logprobs[3].max() + 1  # a tie inside the top, more after it
    for n in (1, 3, 12, 20):
        ours = top_tokens(logprobs, n)
        assert ours == [tuple(_reference_top(row, n)) for row in logprobs]
    assert [t for t, _ in top_tokens(logprobs, 3)[0]] == [3, 7, 90]
    assert len(top_tokens(logprobs, 20)[2]) == 10


def test_top_logprobs_are_the_log_softmax_of_the_processed_scores(info: TokenizerInfo) -> None:
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

    params = [
        SamplingParams(top_logprobs=5, logit_bias=[(3, 4.0)]),  # greedy
        SamplingParams(temperature=0.7, top_k=6, seed=1, top_logprobs=8),  # sampled: 6 possible tokens
        SamplingParams(temperature=0.7, seed=1),  # asks for none
        SamplingParams(do_sample=True, seed=2, top_logprobs=20),
    ]
    states = [SamplingState(p, PROMPT, info) for p in params]
    logits = torch.randn(4, VOCAB) * 3
    result = Sampler().sample(logits, states)
    greedy = logits[0].clone()
    greedy[3] += 4.0
    sampled = TopKLogitsWarper(6)(None, TemperatureLogitsWarper(0.7)(None, logits[1:2].clone()))[0]
    expected = [_reference_top(torch.log_softmax(greedy, -1), 5), _reference_top(torch.log_softmax(sampled, -1), 8),
                [], _reference_top(torch.log_softmax(logits[3], -1), 20)]
    for row, (ours, reference) in enumerate(zip(result.top, expected)):
        assert [t for t, _ in ours] == [t for t, _ in reference], row
        assert [v for _, v in ours] == pytest.approx([v for _, v in reference], abs=1e-5)
    assert len(result.top[1]) == 6
    for row in (0, 1):  # the chosen token (listed: the argmax, one of the 6) has its value in the list
        assert dict(result.top[row])[result.token_ids[row]] == result.logprobs[row]


def test_logprob_is_log_softmax_of_the_processed_scores(info: TokenizerInfo) -> None:
    params = [SamplingParams(), SamplingParams(temperature=0.5, top_k=10, seed=1), SamplingParams(repetition_penalty=2.0)]
    states = [SamplingState(p, PROMPT, info) for p in params]
    logits = torch.randn(3, VOCAB) * 4
    logits[2, 17] = 100.0  # a repeated prompt id: the penalty halves it, still the argmax
    processed = apply_logits_chain(logits, [s.row_settings() for s in states])
    result = Sampler().sample(logits, states)
    expected = torch.log_softmax(processed, -1)[torch.arange(3), torch.tensor(result.token_ids)]
    torch.testing.assert_close(torch.tensor(result.logprobs), expected)
    assert result.token_ids[0] == int(logits[0].argmax()) and result.token_ids[2] == 17
    assert result.token_ids[1] in torch.topk(logits[1], 10).indices.tolist()


def test_bad_schema_is_refused_when_the_state_is_made(tokenizer_info: TokenizerInfo) -> None:
    with pytest.raises(ValidationError) as error:
        SamplingState(SamplingParams(schema='{"type": "array", "uniqueItems": true}'), PROMPT, tokenizer_info)
    assert error.value.field == "schema"


@pytest.mark.parametrize("seed", [0, 1234])
def test_seed_matches_transformers_generate(seed: int, hf_model, tokenizer, tokenizer_info) -> None:
    prompt_ids = tokenizer("The best thing about the sea is")["input_ids"]
    options = dict(temperature=0.8, top_k=30, top_p=0.9, repetition_penalty=1.3)
    torch.manual_seed(seed)
    with torch.inference_mode():
        expected = hf_model.generate(torch.tensor([prompt_ids]), do_sample=True, max_new_tokens=10, **options)
    state = SamplingState(SamplingParams(do_sample=True, seed=seed, **options), prompt_ids, tokenizer_info)
    ours = generate(hf_model, [prompt_ids], [state], {tokenizer.eos_token_id}, max_new_tokens=10)
    assert ours[0] == expected[0, len(prompt_ids) :].tolist()


@torch.inference_mode()
def test_prompt_logprobs_equal_next_token_logprobs_from_prefixes(hf_model, tokenizer) -> None:
    ids = tokenizer("Paris is the capital of France.")["input_ids"]
    logits = hf_model(torch.tensor([ids])).logits[0]  # [T, vocab]
    ours = prompt_logprobs(logits, ids)
    assert ours[0] is None and len(ours) == len(ids)
    chunks = next_token_logprobs(logits[:3], ids[1:4]) + next_token_logprobs(logits[3:-1], ids[4:])
    assert chunks == ours[1:]
    for t in range(1, len(ids)):
        prefix_logits = hf_model(torch.tensor([ids[:t]])).logits[0, -1]
        assert ours[t] == pytest.approx(float(torch.log_softmax(prefix_logits, -1)[ids[t]]), abs=1e-4)
