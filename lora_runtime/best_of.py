"""best_of: n sampled candidates of one prompt, the prompt computed once.

The first candidate is the request itself. When its prompt has been computed and its first token
drawn, the engine forks the others from it: they share the prompt's full KV blocks (reference
counted), get a copy of the partial last block, and draw their own first token from the same logits
with their own seed: seed + i for candidate i when the request has a seed, else a random one each
(TGI's wire refuses a seed with best_of > 1; that is the server's rule, not the engine's). The winner
has the highest mean logprob per generated token (TGI's rule; the lower candidate index wins a tie);
the others are reported as `best_of_sequences`, ranked by the same rule.

`BestOfGroups` makes the decisions (when to fork, the children's requests, which outputs callers
see) and `share_prompt_cache` the KV fork; the engine only samples and keeps the requests' states.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from lora_runtime.core import Request, RequestOutput
from lora_runtime.kv_cache import KVCacheManager
from lora_runtime.request_state import RequestState
from lora_runtime.sampling.sampler import TokenizerInfo
from lora_runtime.scheduler import Scheduler


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


class BestOfGroups:
    """The best_of groups in flight, by the request id of each of their candidates."""

    def __init__(self) -> None:
        self._group_of: dict[str, BestOfGroup] = {}

    def add(self, state: RequestState) -> None:
        """A new request: with best_of > 1 it is the first candidate of its group."""
        if state.request.params.best_of > 1:
            self._group_of[state.request_id] = BestOfGroup(state)

    def group_of(self, request_id: str) -> BestOfGroup | None:
        return self._group_of.get(request_id)

    def take_candidate_ids(self, request_id: str) -> list[str]:
        """The ids of every candidate of the request's group (the request alone without one), the
        group forgotten: what aborting the request ends."""
        group = self._group_of.get(request_id)
        candidate_ids = [c.request_id for c in group.candidates] if group is not None else [request_id]
        for candidate_id in candidate_ids:
            self._group_of.pop(candidate_id, None)
        return candidate_ids

    def to_fork(self, state: RequestState) -> BestOfGroup | None:
        """The group to fork now that `state` drew a token: its first candidate's first token."""
        group = self._group_of.get(state.request_id)
        return group if group is not None and group.needs_fork else None

    def fork(self, group: BestOfGroup, tokenizer_info: TokenizerInfo) -> list[RequestState]:
        """Candidates 1..n-1, on the first one's prompt, adapter and cached tokens, in the group."""
        first = group.candidates[0]
        children = []
        for index in range(1, group.num_candidates):
            request = Request(group.candidate_id(index), first.request.prompt_token_ids, first.request.params,
                              adapter_key=first.request.adapter_key, cache_scope=first.request.cache_scope,
                              num_cached_tokens=first.request.num_cached_tokens)
            child = RequestState(request, first.prompt, tokenizer_info, candidate_index=index)
            self._group_of[request.request_id] = group
            group.add(child)
            children.append(child)
        return children

    def outputs_after_token(self, state: RequestState) -> list[RequestOutput]:
        """What callers see after `state` took a token: its snapshot, or for a candidate the group's
        result once every candidate has finished (best_of results are reported whole, once)."""
        group = self._group_of.get(state.request_id)
        if group is None:
            return [state.snapshot()]
        if state.is_finished and group.mark_finished(state):
            for candidate in group.candidates:
                self._group_of.pop(candidate.request_id, None)
            return [group.result()]
        return []


def share_prompt_cache(parent: Request, child: Request, kv_cache: KVCacheManager, scheduler: Scheduler,
                       copy_block: Callable[[int, int], None]) -> None:
    """Give the child the parent's prompt K/V: full blocks shared, the partial last one copied
    (`copy_block(source, destination)`), and run it. Without a free block for the copy, the child
    queues to recompute its prompt instead."""
    num_prompt = parent.num_prompt_tokens
    kv_cache.fork(parent.request_id, child.request_id, num_prompt)
    if not kv_cache.allocate_slots(child.request_id, num_prompt):
        kv_cache.free(child.request_id)
        scheduler.add_request(child)
        return
    partial_idx = num_prompt // kv_cache.block_size_tokens
    if num_prompt % kv_cache.block_size_tokens:
        copy_block(kv_cache.block_table(parent.request_id)[partial_idx], kv_cache.block_table(child.request_id)[partial_idx])
    child.num_computed_tokens = num_prompt
    scheduler.add_running(child)


def _mean_logprob(output: RequestOutput) -> float:
    if not output.tokens:
        return float("-inf")
    return sum(token.logprob for token in output.tokens) / len(output.tokens)
