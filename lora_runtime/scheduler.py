"""Continuous batching that counts tokens, not phases.

Each request has `num_computed_tokens`; each step grants it some of the rest, within a work budget
(tokens plus their attention, `SchedulerConfig`) and a sequence budget. Prefill, chunked prefill,
decode and recompute after preemption are the same mechanism. Running requests go first, decode
tokens before prefill chunks, then waiting ones in arrival order; one request's chunk is capped, so a
long prompt never holds a step for long nor fills it. When KV blocks run out, the newest running
request is preempted (its blocks freed, recomputed later).

Adapters are a resource like KV blocks, with no count per step: a waiting request is admitted once
its adapter is loaded and its device pages are reserved in the `AdapterPagePool` (which may evict an
adapter no running request uses); a running request keeps its adapter's pages pinned until it
finishes or is preempted. The step's output carries where each of its adapters lies. The scheduler
touches no tensors and can be tested with no model.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from lora_runtime.adapters.pages import AdapterPagePool, AdapterPlacement
from lora_runtime.adapters.refs import AdapterKey
from lora_runtime.config import SchedulerConfig
from lora_runtime.core import Request, RequestStatus
from lora_runtime.kv_cache import KVCacheManager
from lora_runtime.prefix_cache import extend_block_hashes, kv_identity


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step: `num_new_tokens` tokens starting at `num_computed_tokens`."""

    request: Request
    num_new_tokens: int
    num_computed_tokens: int
    # True when this chunk reaches the end of the request's tokens, so a new token is drawn.
    samples_next_token: bool

    @classmethod
    def of(cls, request: Request, num_new_tokens: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return cls(request, num_new_tokens, start, start + num_new_tokens == request.num_tokens)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """The contract between scheduler and model runner. Requests of one adapter are contiguous, and
    `adapters` holds each adapter of the step once, in that order, with its device placement."""

    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[Request, ...]
    adapters: tuple[tuple[AdapterKey, AdapterPlacement], ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def chunk_work(num_computed_tokens: int, num_new_tokens: int, attention_pairs_per_token: int) -> int:
    """Work of a chunk in token-equivalents: its tokens, plus its query-key pairs (each new token
    attends to every earlier token and itself) in units of `attention_pairs_per_token`."""
    num_pairs = num_new_tokens * num_computed_tokens + num_new_tokens * (num_new_tokens + 1) // 2
    return num_new_tokens + num_pairs // attention_pairs_per_token


class _StepBudget:
    """What is left of one step's budgets while the scheduler fills it."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.work = config.max_num_batched_tokens
        self.seqs = config.max_num_seqs

    @property
    def is_open(self) -> bool:
        return self.work > 0 and self.seqs > 0

    def num_tokens_for(self, request: Request) -> int:
        """The most of the request's remaining tokens whose work fits what is left of the step and
        one chunk's cap; one token at least in a step still empty, so that every request progresses
        whatever its context."""
        start, num_left = request.num_computed_tokens, request.num_tokens - request.num_computed_tokens
        max_work = min(self.work, self.config.max_prefill_chunk_work)
        low, high = 0, num_left  # work grows with the tokens: the largest count that fits
        while low < high:
            middle = (low + high + 1) // 2
            if chunk_work(start, middle, self.config.attention_pairs_per_token) <= max_work:
                low = middle
            else:
                high = middle - 1
        is_empty = self.seqs == self.config.max_num_seqs
        return max(low, 1) if is_empty else low

    def take(self, request: Request, num_tokens: int) -> None:
        self.work -= chunk_work(request.num_computed_tokens, num_tokens,
                                self.config.attention_pairs_per_token)
        self.seqs -= 1

    def give_back(self, item: ScheduledRequest) -> None:
        """Return the share of a request taken out of the step again (preempted after it)."""
        self.work += chunk_work(item.num_computed_tokens, item.num_new_tokens,
                                self.config.attention_pairs_per_token)
        self.seqs += 1


class Scheduler:
    """FCFS continuous-batching scheduler over a `KVCacheManager` and, for requests with an adapter,
    an `AdapterPagePool`. Waiting requests whose adapter is still loading, or whose pages do not fit
    beside the running requests' adapters, are passed over (others keep being served)."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager,
                 adapter_pages: AdapterPagePool | None = None,
                 identity_of: Callable[[Request], bytes] = lambda request: kv_identity(
                     request.adapter_key, None, request.cache_scope),
                 recompute_length: int | None = None) -> None:
        """`identity_of`: the root of a request's block chain for prefix caching (the engine's
        includes the load of the adapter's weights). `recompute_length`: a running request whose
        tokens grow past it recomputes its whole cache (the model's `recompute_length`)."""
        self.config = config
        self.kv_cache = kv_cache
        self.adapter_pages = adapter_pages
        self._identity_of = identity_of
        self.recompute_length = recompute_length
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._waited_steps: dict[str, int] = {}
        self._arrivals = 0
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request) -> None:
        self._arrivals += 1
        request.arrival_order = self._arrivals
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Admit a request whose cache is already filled (a best_of candidate forked from another,
        whose adapter is resident: the parent runs it)."""
        if request.adapter_key is not None:
            assert self._adapters().reserve(request.adapter_key), "a running request's adapter is resident"
        self._arrivals += 1
        request.arrival_order = self._arrivals
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def schedule(self) -> SchedulerOutput:
        """Fill one step: running requests first (decode tokens, then prefill chunks), then waiting
        ones while budgets allow."""
        budget = _StepBudget(self.config)
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        self._schedule_running(budget, scheduled, preempted)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        scheduled.sort(key=self._step_order)
        keys = dict.fromkeys(item.request.adapter_key for item in scheduled if item.request.adapter_key is not None)
        adapters = tuple((key, self._adapters().placement(key)) for key in keys)
        return SchedulerOutput(scheduled=tuple(scheduled), preempted=tuple(preempted), adapters=adapters)

    def _step_order(self, item: ScheduledRequest) -> tuple:
        """Base-model requests first, then each adapter's requests side by side (the LoRA op reads an
        adapter's pages once for all of its tokens), adapters in the order of their pages (so the
        op streams the pools upwards), each in arrival order."""
        key = item.request.adapter_key
        if key is None:
            return (False, -1, item.request.arrival_order)
        return (True, self._adapters().placement(key).first_page, key, item.request.arrival_order)

    def _adapters(self) -> AdapterPagePool:
        assert self.adapter_pages is not None, "a request names an adapter but this scheduler has no adapter pool"
        return self.adapter_pages

    def _schedule_running(
        self, budget: _StepBudget, scheduled: list[ScheduledRequest], preempted: list[Request]
    ) -> None:
        # Decode tokens first (a stable sort keeps arrival order within each kind): a long prefill
        # then never holds back the requests that are already generating.
        for request in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if not budget.is_open:
                return
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            if request.num_computed_tokens == self.recompute_length == request.num_tokens - 1:
                self._restart(request)
            num_new = budget.num_tokens_for(request)
            if num_new == 0:
                continue
            if not self._allocate_or_preempt(request, num_new, budget, scheduled, preempted):
                return
            budget.take(request, num_new)
            scheduled.append(ScheduledRequest.of(request, num_new))

    def _allocate_or_preempt(self, request: Request, num_new: int, budget: _StepBudget,
                             scheduled: list[ScheduledRequest], preempted: list[Request]) -> bool:
        """Allocate the request's slots, preempting the newest running requests until they fit (one
        already scheduled in this step, a decode, gives its share back); False when that reached
        the request itself."""
        while not self.kv_cache.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
            victim = self.running.pop()
            granted = next((item for item in scheduled if item.request is victim), None)
            if granted is not None:
                scheduled.remove(granted)
                budget.give_back(granted)
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, budget: _StepBudget, scheduled: list[ScheduledRequest]) -> None:
        passed_over: list[Request] = []
        while self.waiting and budget.is_open:
            request = self.waiting.popleft()
            key = request.adapter_key
            if key is not None and not self._adapters().is_loaded(key):
                passed_over.append(request)  # still loading: waiting longer is not the scheduler's doing
                continue
            if budget.num_tokens_for(request) == 0:
                passed_over.append(request)
                break  # out of work: admitting later arrivals first would break FCFS
            if key is not None and not self._adapters().reserve(key):
                passed_over.append(request)
                if self._is_overdue(request):
                    break  # strict FCFS from here on, so the running adapters drain and this one fits
                continue  # its pages are held by running adapters: later requests of resident ones go on
            self._start_after_cached_prefix(request)
            num_new = budget.num_tokens_for(request)
            if num_new == 0 or not self.kv_cache.allocate_slots(request.request_id,
                                                                request.num_computed_tokens + num_new):
                if key is not None:
                    self._adapters().release(key)
                self.kv_cache.free(request.request_id)  # the cached prefix it took, if any
                request.num_computed_tokens = 0
                passed_over.append(request)
                break  # out of work or blocks: admitting later arrivals first would break FCFS
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._waited_steps.pop(request.request_id, None)
            budget.take(request, num_new)
            scheduled.append(ScheduledRequest.of(request, num_new))
        for request in passed_over:
            self._waited_steps[request.request_id] = self._waited_steps.get(request.request_id, 0) + 1
        self.waiting.extendleft(reversed(passed_over))

    def _start_after_cached_prefix(self, request: Request) -> None:
        """A request about to start (or restart after preemption) takes the longest run of its full
        blocks already cached, and computes only the rest. Its last token is always computed: its
        logits are what the next token is drawn from. A request that wants its prompt's logprobs
        computes every position."""
        if not self.kv_cache.enable_prefix_caching or request.num_computed_tokens or request.params.decoder_input_details:
            return
        num_blocks = (request.num_tokens - 1) // self.kv_cache.block_size_tokens
        num_hit = self.kv_cache.match_prefix(request.request_id, self._block_hashes(request, num_blocks),
                                             request.num_tokens)
        request.num_computed_tokens = num_hit * self.kv_cache.block_size_tokens
        if request.num_preemptions == 0:
            request.num_cached_tokens = request.num_computed_tokens

    def _block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        if request.kv_identity is None:
            request.kv_identity = self._identity_of(request)
        extend_block_hashes(request.block_hashes, request.kv_identity, request.all_token_ids, num_blocks,
                            self.kv_cache.block_size_tokens)
        return request.block_hashes[:num_blocks]

    def _is_overdue(self, request: Request) -> bool:
        return self._waited_steps.get(request.request_id, 0) >= self.config.max_wait_steps_before_priority

    def _restart(self, request: Request) -> None:
        """Recompute the running request's cache from its first token, under the block chain of its
        new length (LongRoPE's switch to its long factors, where HF's Phi-3 `generate` recomputes)."""
        self.kv_cache.free(request.request_id)
        request.num_computed_tokens = 0
        request.kv_identity = None
        request.block_hashes = []

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and its adapter's pin; it will recompute its prompt and outputs
        when readmitted."""
        self.kv_cache.free(request.request_id)
        if request.adapter_key is not None:
            self._adapters().release(request.adapter_key)
        self.num_preemptions += 1
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self._insert_waiting_by_arrival(request)

    def _insert_waiting_by_arrival(self, request: Request) -> None:
        position = 0
        while position < len(self.waiting) and self.waiting[position].arrival_order < request.arrival_order:
            position += 1
        self.waiting.insert(position, request)

    def update_after_step(self, output: SchedulerOutput) -> None:
        """Record that the step's tokens are now in the cache."""
        for item in output.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            num_full = request.num_computed_tokens // self.kv_cache.block_size_tokens
            if self.kv_cache.enable_prefix_caching and num_full > self.kv_cache.num_registered_blocks(request.request_id):
                self.kv_cache.register_full_blocks(request.request_id, self._block_hashes(request, num_full))
            self.kv_cache.release_outside_window(request.request_id, request.num_computed_tokens)

    def finish(self, request: Request, status: RequestStatus = RequestStatus.FINISHED) -> None:
        """Remove a request (finished or aborted) wherever it is and free its blocks (and, if it was
        running, its adapter's pin) at once."""
        if request in self.running:
            self.running.remove(request)
            if request.adapter_key is not None:
                self._adapters().release(request.adapter_key)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._waited_steps.pop(request.request_id, None)
        self.kv_cache.free(request.request_id)
        request.status = status
