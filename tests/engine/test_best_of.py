"""BestOfGroup's ranking, with no model: the first k of [winner] + best_of_sequences are the k best
by mean logprob per generated token, ties to the lower candidate index."""
from __future__ import annotations

import pytest

from lora_runtime.best_of import BestOfGroup
from lora_runtime.core import Request, RequestOutput, SamplingParams, TokenInfo


class _Candidate:
    """What BestOfGroup reads of a RequestState: its request and a snapshot."""

    def __init__(self, index: int, num_candidates: int, logprobs: list[float]) -> None:
        self.request_id = "req" if index == 0 else f"req#{index}"
        self.request = Request(self.request_id, [1], SamplingParams(do_sample=True, best_of=num_candidates))
        self.index = index
        self.logprobs = logprobs

    def snapshot(self) -> RequestOutput:
        """Its text is its index, to tell the candidates apart in the result."""
        tokens = [TokenInfo(7, "x", logprob, False) for logprob in self.logprobs]
        return RequestOutput(self.request_id, None, [1], [7] * len(tokens), str(self.index), True, tokens=tokens)


@pytest.mark.parametrize(("logprobs", "expected_order"), [
    ([[-1.0], [-0.5, -0.5], [-2.0], [-0.25, -0.75], [-3.0, -0.1]], [1, 3, 0, 4, 2]),  # ties 1 and 3: 1 first
    ([[-0.9], [-0.1, -0.1, -0.1], [], [-0.5]], [1, 3, 0, 2]),  # no tokens ranks last
    ([[-1.0], [-1.0], [-1.0]], [0, 1, 2]),
])
def test_candidates_are_ranked_by_mean_logprob_then_index(
    logprobs: list[list[float]], expected_order: list[int]
) -> None:
    candidates = [_Candidate(i, len(logprobs), values) for i, values in enumerate(logprobs)]
    group = BestOfGroup(candidates[0])
    for candidate in candidates[1:]:
        group.add(candidate)
    result = group.result()
    assert [int(output.text) for output in [result, *result.best_of_sequences]] == expected_order
    assert result.request_id == "req"
