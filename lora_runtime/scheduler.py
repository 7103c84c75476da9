"""Continuous batching that counts tokens, not phases.

Each request has `num_computed_tokens`; each step grants it some of the rest, within a work budget
(tokens plus their attention, `SchedulerConfig`), a sequence budget and a budget of distinct
adapters. Prefill, chunked prefill, decode and recompute after preemption are the same mechanism.
Running requests go first, decode tokens before prefill chunks, then waiting ones in arrival order;
one request's chunk is capped, so a long prompt never holds a step for long nor fills it. When KV
blocks run out, the newest running request is preempted (its blocks freed, recomputed later). The
scheduler touches no tensors and can be tested with no model.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from lora_runtime.config import SchedulerConfig
from lora_runtime.core import Request, RequestStatus
from lora_runtime.kv_cache import KVCacheManager


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
    """The contract between scheduler and model runner. Requests of one adapter are contiguous."""

    scheduled: tuple[ScheduledRequest, ...]
    preempted: tuple[Request, ...]

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def adapter_keys(self) -> set[str]:
        return {item.request.adapter_key for item in self.scheduled if item.request.adapter_key}

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
        self.adapter_keys: Counter[str] = Counter()  # adapter -> its requests in the step

    @property
    def is_open(self) -> bool:
        return self.work > 0 and self.seqs > 0

    def admits_adapter(self, adapter_key: str | None) -> bool:
        return (adapter_key is None or adapter_key in self.adapter_keys
                or len(self.adapter_keys) < self.config.max_adapters_per_step)

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
        if request.adapter_key:
            self.adapter_keys[request.adapter_key] += 1

    def give_back(self, item: ScheduledRequest) -> None:
        """Return the share of a request taken out of the step again (preempted after it)."""
        self.work += chunk_work(item.num_computed_tokens, item.num_new_tokens,
                                self.config.attention_pairs_per_token)
        self.seqs += 1
        if item.request.adapter_key:
            self.adapter_keys[item.request.adapter_key] -= 1
            if not self.adapter_keys[item.request.adapter_key]:
                del self.adapter_keys[item.request.adapter_key]


class Scheduler:
    """FCFS continuous-batching scheduler over a `KVCacheManager`.

    `is_adapter_ready(key)` tells whether an adapter is loaded; waiting requests whose adapter is still
    loading are passed over (others keep being served) and admitted once it is ready.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        is_adapter_ready: Callable[[str], bool] = lambda key: True,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.is_adapter_ready = is_adapter_ready
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
        """Admit a request whose cache is already filled (a best_of candidate forked from another)."""
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
        scheduled.sort(key=lambda item: (item.request.adapter_key or "", item.request.arrival_order))
        return SchedulerOutput(scheduled=tuple(scheduled), preempted=tuple(preempted))

    def _schedule_running(
        self, budget: _StepBudget, scheduled: list[ScheduledRequest], preempted: list[Request]
    ) -> None:
        # Decode tokens first (a stable sort keeps arrival order within each kind): a long prefill
        # then never holds back the requests that are already generating.
        for request in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if not budget.is_open:
                return
            if request.status is not RequestStatus.RUNNING or not budget.admits_adapter(request.adapter_key):
                continue  # preempted earlier in this step, or its adapter does not fit this step
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
            if not self._can_admit(request, budget):
                passed_over.append(request)
                if self._is_overdue(request):
                    break  # strict FCFS from here on, so the overdue request's adapter gets in next
                continue
            num_new = budget.num_tokens_for(request)
            num_needed = request.num_computed_tokens + num_new
            if num_new == 0 or not self.kv_cache.allocate_slots(request.request_id, num_needed):
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

    def _can_admit(self, request: Request, budget: _StepBudget) -> bool:
        if request.adapter_key and not self.is_adapter_ready(request.adapter_key):
            return False
        return budget.admits_adapter(request.adapter_key)

    def _is_overdue(self, request: Request) -> bool:
        if request.adapter_key and not self.is_adapter_ready(request.adapter_key):
            return False  # still loading: waiting longer is not the scheduler's doing
        return self._waited_steps.get(request.request_id, 0) >= self.config.max_wait_steps_before_priority

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks; it will recompute its prompt and outputs when readmitted."""
        self.kv_cache.free(request.request_id)
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
            item.request.num_computed_tokens += item.num_new_tokens

    def finish(self, request: Request, status: RequestStatus = RequestStatus.FINISHED) -> None:
        """Remove a request (finished or aborted) wherever it is and free its blocks at once."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._waited_steps.pop(request.request_id, None)
        self.kv_cache.free(request.request_id)
        request.status = status
