"""Continuous batching that counts tokens, not phases.

Each request has `num_computed_tokens`; each step grants it some of the rest, within a token budget,
a sequence budget and a budget of distinct adapters. Prefill, chunked prefill, decode and recompute
after preemption are the same mechanism. Running requests go first, then waiting ones in arrival
order. When KV blocks run out, the newest running request is preempted (its blocks freed, recomputed
later). The scheduler touches no tensors and can be tested with no model.
"""
from __future__ import annotations

from collections import deque
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


class _StepBudget:
    """What is left of one step's budgets while the scheduler fills it."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.tokens = config.max_num_batched_tokens
        self.seqs = config.max_num_seqs
        self.max_adapters = config.max_adapters_per_step
        self.adapter_keys: set[str] = set()

    def admits_adapter(self, adapter_key: str | None) -> bool:
        return adapter_key is None or adapter_key in self.adapter_keys or len(self.adapter_keys) < self.max_adapters

    def take(self, request: Request, num_tokens: int) -> None:
        self.tokens -= num_tokens
        self.seqs -= 1
        if request.adapter_key:
            self.adapter_keys.add(request.adapter_key)


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
        """Fill one step: running requests first, then waiting ones while budgets allow."""
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
        index = 0
        while index < len(self.running) and budget.tokens > 0 and budget.seqs > 0:
            request = self.running[index]
            index += 1
            if not budget.admits_adapter(request.adapter_key):
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget.tokens)
            while not self.kv_cache.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    return
            budget.take(request, num_new)
            scheduled.append(ScheduledRequest.of(request, num_new))

    def _schedule_waiting(self, budget: _StepBudget, scheduled: list[ScheduledRequest]) -> None:
        passed_over: list[Request] = []
        while self.waiting and budget.tokens > 0 and budget.seqs > 0:
            request = self.waiting.popleft()
            if not self._can_admit(request, budget):
                passed_over.append(request)
                if self._is_overdue(request):
                    break  # strict FCFS from here on, so the overdue request's adapter gets in next
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget.tokens)
            if not self.kv_cache.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
                passed_over.append(request)
                break  # out of blocks: admitting later arrivals first would break FCFS
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
