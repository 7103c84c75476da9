"""A request whose own processing raises while it generates (its logits processing inside the
batch's sampling, or its bookkeeping once a token is drawn) fails alone: it finishes with the error
and frees its blocks, and every other request of the batch gets exactly the tokens it gets without
the faulty one. The fault is a grammar matcher (the object a `schema` request holds) that raises,
put into one request's sampling state."""
from __future__ import annotations

import pytest
import torch

from lora_runtime import Engine, EngineConfig, SamplingParams
from lora_runtime.errors import EngineError

PROMPTS = ["The capital of France is", "Count from one to ten:", "A short poem about the sea:"]
PARAMS = SamplingParams(max_new_tokens=8, ignore_eos_token=True)


@pytest.fixture(scope="module")
def engine(embedded_model_dir) -> Engine:
    # The Hugging Face directory (bf16 on AVX-512): faults are what is tested, not the default GGUF.
    return Engine.from_config(EngineConfig(model=str(embedded_model_dir)))


class Fault(RuntimeError):
    pass


def _run_with_fault(engine: Engine, faulty_index: int, fails_in: str, after_tokens: int) -> list:
    """Run PROMPTS together; request `faulty_index` gets a FaultyGrammar once it has `after_tokens` tokens."""
    ids = [engine.add_request(prompt, PARAMS) for prompt in PROMPTS]
    final, broken = {}, False
    while engine.has_unfinished_requests():
        state = engine._states.get(ids[faulty_index])
        if not broken and state is not None and len(state.request.output_token_ids) >= after_tokens:
            state.sampling._grammar = FaultyGrammar(fails_in, engine.model.shape.vocab_size)
            broken = True
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
    assert broken
    return [final[request_id] for request_id in ids]


class FaultyGrammar:
    """Allows every token; raises computing its mask (inside the batch's sampling) or accepting the
    drawn token (in the request's own bookkeeping)."""

    is_complete = False

    def __init__(self, fails_in: str, vocab_size: int) -> None:
        self.fails_in = fails_in
        self.vocab_size = vocab_size

    def allowed_tokens(self) -> torch.Tensor:
        if self.fails_in == "mask":
            raise Fault("the grammar could not compute its mask")
        return torch.ones(self.vocab_size, dtype=torch.bool)

    def accept(self, token_id: int) -> None:
        raise Fault(f"the grammar rejected token {token_id}")


@pytest.mark.parametrize("fails_in", ["mask", "accept"], ids=["in-batch-sampling", "after-drawing"])
def test_a_failing_request_fails_alone(engine, fails_in: str) -> None:
    alone = [output.token_ids for output in engine.generate(PROMPTS, PARAMS)]
    outputs = _run_with_fault(engine, faulty_index=1, fails_in=fails_in, after_tokens=3)
    failed = outputs[1]
    assert isinstance(failed.error, EngineError) and "grammar" in failed.error.message
    assert len(failed.token_ids) <= 4  # the tokens it had, at most the one drawn before the fault
    assert [outputs[0].token_ids, outputs[2].token_ids] == [alone[0], alone[2]]
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.has_unfinished_requests()


def test_a_failing_best_of_candidate_fails_its_whole_request(engine) -> None:
    params = SamplingParams(max_new_tokens=6, best_of=2, do_sample=True, ignore_eos_token=True)
    request_id = engine.add_request(PROMPTS[0], params)
    other_id = engine.add_request(PROMPTS[2], PARAMS)
    final, broken = {}, False
    while engine.has_unfinished_requests():
        candidate = engine._states.get(f"{request_id}#1")
        if not broken and candidate is not None:
            candidate.sampling._grammar = FaultyGrammar("accept", engine.model.shape.vocab_size)
            broken = True
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
    assert broken
    assert set(final) == {request_id, other_id}
    assert isinstance(final[request_id].error, EngineError)
    assert final[other_id].error is None and len(final[other_id].token_ids) == PARAMS.max_new_tokens
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
