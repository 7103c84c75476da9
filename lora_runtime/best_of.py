"""best_of: n sampled candidates of one prompt, the prompt computed once.

The first candidate is the request itself. When its prompt has been computed and its first token
drawn, the engine forks the others from it: they share the prompt's full KV blocks (reference
counted), get a copy of the partial last block, and draw their own first token from the same logits
with their own seed: seed + i for candidate i when the request has a seed, else a random one each
(TGI's wire refuses a seed with best_of > 1; that is the server's rule, not the engine's). The winner
has the highest mean logprob per generated token (TGI's rule; the lower candidate index wins a tie);
the others are reported as `best_of_sequences`, ranked by the same rule.
"""
from __future__ import annotations

import dataclasses

from lora_runtime.core import RequestOutput
from lora_runtime.request_state import RequestState


class BestOfGroup:
    def __init__(self, first: RequestState) -> None:
        self.request_id = first.request_id
        self.num_candidates = first.request.params.best_of
        self.candidates: list[RequestState] = [first]
        self._finished: set[str] = set()

    @property
    def needs_fork(self) -> bool:
        return len(self.candidates) < self.num_candidates

    def candidate_id(self, index: int) -> str:
        return f"{self.request_id}#{index}"

    def add(self, state: RequestState) -> None:
        self.candidates.append(state)

    def mark_finished(self, state: RequestState) -> bool:
        """Record a finished candidate; True once every candidate has finished."""
        self._finished.add(state.request_id)
        return not self.needs_fork and len(self._finished) == self.num_candidates

    def result(self) -> RequestOutput:
        """The winner, with the other candidates as `best_of_sequences`, best first: the first k of
        [winner] + best_of_sequences are the k best (mean logprob per generated token, descending;
        ties by candidate index)."""
        snapshots = [state.snapshot() for state in self.candidates]
        ranked = sorted(range(len(snapshots)), key=lambda i: (-_mean_logprob(snapshots[i]), i))
        others = [snapshots[i] for i in ranked[1:]]
        return dataclasses.replace(snapshots[ranked[0]], request_id=self.request_id, best_of_sequences=others)


def _mean_logprob(output: RequestOutput) -> float:
    if not output.tokens:
        return float("-inf")
    return sum(token.logprob for token in output.tokens) / len(output.tokens)
