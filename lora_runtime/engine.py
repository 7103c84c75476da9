"""The engine: the only module that wires model, KV cache, scheduler, runner and sampler together.

Life of a step: the scheduler picks tokens -> the runner builds tensors and runs the model -> the
sampler draws the next token of each request that reached its end -> each request's state updates
its text and stop criteria -> finished requests leave the scheduler and free their blocks.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

import kernels
from lora_runtime.adapters.cache import AdapterLease
from lora_runtime.adapters.manager import AdapterManager, Lease
from lora_runtime.adapters.refs import AdapterArgument, AdapterKey, AdapterRequest, AdapterSource, Caller
from lora_runtime.api import EngineStats
from lora_runtime.engine_info import BaseModelShape
from lora_runtime.best_of import BestOfGroup
from lora_runtime.config import EngineConfig
from lora_runtime.dtypes import resolve_dtype
from lora_runtime.device_memory import sized_for_device
from lora_runtime.core import CacheScope, Request, RequestOutput, RequestStatus, SamplingParams
from lora_runtime.embedded import EMBEDDED_MODEL_NAME, ensure_embedded_model
from lora_runtime.engine_info import EngineInfo
from lora_runtime.engine_stats import LoopActivity, engine_stats
from lora_runtime.errors import EngineError, NonFiniteLogitsError, ValidationError
from lora_runtime.gguf_model import is_gguf_file, load_gguf
from lora_runtime.kv_cache import KVCacheManager
from lora_runtime.loader import load_model
from lora_runtime.memory_budget import MemoryBudget, memory_budget_for
from lora_runtime.model_runner import ModelRunner, ModelRunnerOutput
from lora_runtime.prefix_cache import kv_identity
from lora_runtime.models.llama import LlamaModel
from lora_runtime.request_state import RequestState
from lora_runtime.sampling.sampler import SampleResult, Sampler, TokenizerInfo, TopPairs, chunk_logprobs
from lora_runtime.scheduler import Scheduler
from lora_runtime.step_timing import StepTimes
from lora_runtime.threads import use_threads
from lora_runtime.validation import prepare_prompt

logger = logging.getLogger(__name__)

# The longest a step waits, when requests wait and none can run, for an adapter load to settle or for
# `wake()`: every known change that can let a request run signals, so this bounds only the unknown ones.
IDLE_WAIT_S = 0.05


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaModel,
        tokenizer,
        model_name: str,
        adapter_sources: dict[str, AdapterSource] | None = None,
        memory_budget: MemoryBudget | None = None,
    ) -> None:
        if memory_budget is None:  # built from a model in hand: the budget of the checkpoint it came from
            memory_budget = memory_budget_for(config, _model_location(config)[0], str(model.dtype).removeprefix("torch."))
        self.memory_budget = memory_budget
        config = _sized(config, memory_budget)
        self.config = config
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.model = model
        num_blocks = _num_kv_blocks(config, model)
        self.kv_cache = KVCacheManager(num_blocks, config.kv_cache.block_size_tokens,
                                       config.kv_cache.enable_prefix_caching, model.features.max_window)
        base_shape = BaseModelShape(model_name, model.shape.num_layers, model.shape.module_dims())
        self.adapters = AdapterManager(config.adapters, base_shape, model.backend, model.dtype, adapter_sources)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.adapters.pages, self._kv_identity,
                                   model.recompute_length)
        self.runner = ModelRunner(model, self.kv_cache, num_blocks, config.device, self.adapters)
        self.step_times = StepTimes()
        self.sampler = Sampler(self.step_times)
        self.tokenizer_info = TokenizerInfo(tokenizer, model.shape.vocab_size, _eos_token_ids(tokenizer, model_name))
        self._states: dict[str, RequestState] = {}
        self._group_of: dict[str, BestOfGroup] = {}  # candidate request id -> its best_of group
        self._leases: dict[str, Lease] = {}  # request id -> its hold on its adapter
        self._request_counter = itertools.count()
        self._wakeup = threading.Event()  # set when an adapter load settles or `wake()` is called
        self.num_threads = torch.get_num_threads()  # the compute threads (Engine.from_config sets them)

    @classmethod
    def from_config(cls, config: EngineConfig | None = None, adapter_sources: dict[str, AdapterSource] | None = None) -> Engine:
        """Load the configured model (the embedded one by default) and build the engine."""
        from transformers import AutoTokenizer

        config = config or EngineConfig()
        num_threads, source = use_threads(config.num_threads)
        logger.info("compute threads: %d (%s)", num_threads, source)
        model_dir, model_name = _model_location(config)
        backend = kernels.backend_for(config.device, config.kernel_backend)
        dtype, reason = resolve_dtype(config.dtype, config.device)
        logger.info("model %s in %s (%s), kernel backend %s", model_name, dtype, reason, backend.label)
        memory_budget = memory_budget_for(config, model_dir, dtype)  # refuses a model that does not fit, unread
        if is_gguf_file(model_dir):
            if config.quantization is not None:
                raise ValidationError("quantization", f"{model_dir.name} is a GGUF file: it keeps its own types")
            model, tokenizer = load_gguf(model_dir, dtype, config.device, backend)
        else:
            model = load_model(model_dir, dtype, config.device, backend, config.quantization)
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        return cls(config, model, tokenizer, model_name, adapter_sources, memory_budget)

    @property
    def max_model_len(self) -> int:
        return self.model.shape.max_model_len

    @property
    def dtype_name(self) -> str:
        return str(self.model.dtype).removeprefix("torch.")

    @property
    def kernel_backend(self) -> str:
        """The kernel backend's name, and its instruction-set form for the compiled CPU ops ("cpu/avx2")."""
        return self.model.backend.label

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(self.model_name, self.max_model_len, self.config, self.dtype_name, self.kernel_backend,
                          self.tokenizer, self.adapters.base_shape, self.adapters.limits, self.num_threads,
                          self.memory_budget)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        adapter: AdapterArgument | Lease = None,
        request_id: str | None = None,
        api_token: str | None = None,
        cache_scope: CacheScope = CacheScope(),
    ) -> str:
        """Validate and queue a request; returns its id. Raises ValidationError for bad input.

        `adapter`: None (base model), an adapter id (a local PEFT directory path works), an
        `AdapterRef`, a `MergedAdapters`, an `AdapterRequest`, or a lease from `adapters.acquire`,
        which the engine then owns (released when the request ends, or here if it is refused). It
        loads in the background; other requests keep running meanwhile, and a failed load fails this
        request only. `cache_scope`: whose cached prompt blocks it may reuse (its tenant, its salt).
        """
        params = params or SamplingParams()
        lease = adapter if isinstance(adapter, AdapterLease) else None
        try:
            if lease is None:
                adapter_request = self.parse_adapter(adapter, Caller(api_token=api_token))
                lease = self.acquire_adapter(adapter_request) if adapter_request is not None else None
            request_id = request_id or f"req-{next(self._request_counter)}"
            if request_id in self._states:
                raise ValidationError("request_id", f"{request_id!r} is already in use")
            chat_template = self._chat_template(params, lease)
            prompt_text, token_ids, params = prepare_prompt(prompt, params, self, chat_template)
            request = Request(request_id=request_id, prompt_token_ids=token_ids, params=params,
                              cache_scope=cache_scope)
            state = RequestState(request, prompt_text, self.tokenizer_info)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        if lease is not None:
            request.adapter_key = lease.key
            self._leases[request_id] = lease
            lease.load.add_done_callback(lambda _: self._wakeup.set())
        self._states[request_id] = state
        if params.best_of > 1:
            self._group_of[request_id] = BestOfGroup(state)
        self.scheduler.add_request(request)
        return request_id

    def parse_adapter(self, adapter: AdapterArgument, caller: Caller = Caller()) -> AdapterRequest | None:
        """`add_request`'s `adapter` (but a lease) as a typed request; safe from any thread (it reads
        only the configured sources)."""
        return self.adapters.parse(adapter, caller)

    def acquire_adapter(self, request: AdapterRequest) -> Lease:
        """Start (or join) the background load of the request's adapter; the lease, handed to
        `add_request`, pins its host copy until the request ends. Safe from any thread (the host
        cache locks)."""
        return self.adapters.acquire(request)

    def cached_adapters(self) -> tuple[AdapterKey, ...]:
        """The adapters the host cache holds now, least recently used first; safe from any thread."""
        return tuple(key for key, _, _ in self.adapters.host.snapshot())

    def stats(self, activity: LoopActivity) -> EngineStats:
        """The engine's figures beside what the thread stepping it has counted; safe from any thread."""
        return engine_stats(activity, self.kv_cache, self.scheduler.num_preemptions, self.adapters)

    def _kv_identity(self, request: Request) -> bytes:
        """The root of the request's KV block chain: its cache scope, its rotation, its adapter's key and
        the load its weights came from (the scheduler asks once the adapter is loaded)."""
        lease = self._leases.get(request.request_id)
        load_serial = lease.load.result().load_serial if lease is not None else None
        return kv_identity(request.adapter_key, load_serial, request.cache_scope,
                           self.config.kv_cache.share_base_prefix_cache,
                           self.model.rope_variant(request.num_tokens))

    def _chat_template(self, params: SamplingParams, lease: Lease | None) -> str | None:
        """The adapter's own chat template for apply_chat_template: this waits for the adapter to
        load (AsyncEngine loads it before calling add_request, so the server never waits here)."""
        if not params.apply_chat_template or lease is None:
            return None
        return lease.load.result().chat_template  # raises the adapter's typed error

    def abort(self, request_id: str) -> None:
        """Cancel a request (all its best_of candidates) wherever it is; its KV blocks are freed at
        once. Unknown ids are ignored."""
        group = self._group_of.get(request_id)
        candidates = [c.request_id for c in group.candidates] if group is not None else [request_id]
        for candidate_id in candidates:
            self._group_of.pop(candidate_id, None)
            state = self._states.get(candidate_id)
            if state is not None:
                self._finish(state, RequestStatus.ABORTED)

    def _finish(self, state: RequestState, status: RequestStatus = RequestStatus.FINISHED) -> None:
        """Take the request out of the scheduler (its blocks return at once) and unpin its adapter."""
        self.scheduler.finish(state.request, status)
        self._states.pop(state.request_id, None)
        lease = self._leases.pop(state.request_id, None)
        if lease is not None:
            lease.release()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def wake(self) -> None:
        """End a step's idle wait now (safe from any thread): the caller has new work for the engine."""
        self._wakeup.set()

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns a snapshot of every request that made progress (or failed).

        When requests wait and none can run (their adapters are still loading), the step first waits
        up to `IDLE_WAIT_S` for a load to settle or for `wake()`: a caller calling again at once would
        spin holding the GIL, which the loader threads need for every tensor op they run. Its phases'
        wall time adds up in `step_times`."""
        self._wakeup.clear()  # before looking: a load settling from here on ends the wait below
        times = self.step_times
        with times.phase("schedule"):
            failed = self._fail_requests_with_failed_adapters()
            output = self.scheduler.schedule()
        if output.is_empty:
            if not failed and self.has_unfinished_requests():
                self._wakeup.wait(IDLE_WAIT_S)
            return failed
        times.steps += 1
        runner_output = self.runner.execute(output, times)
        with times.phase("update"):
            self.scheduler.update_after_step(output)
            self._record_prompt_logprobs(runner_output)
        return failed + self._sample_and_update(runner_output)

    def _fail_requests_with_failed_adapters(self) -> list[RequestOutput]:
        failed = []
        for request in list(self.scheduler.waiting):
            lease = self._leases.get(request.request_id)
            error = lease.failure() if lease is not None else None
            if error is not None:
                state = self._states[request.request_id]
                state.fail(error if isinstance(error, EngineError) else EngineError(str(error)))
                self._finish(state, RequestStatus.ABORTED)
                failed.append(state.snapshot())
        return failed

    def _record_prompt_logprobs(self, runner_output: ModelRunnerOutput) -> None:
        logits = runner_output.logits
        for request, first_position, first_row, num_rows in runner_output.rows.prompt_rows:
            # Row first_row + i scores prompt token first_position + 1 + i.
            next_ids = request.prompt_token_ids[first_position + 1 : first_position + 1 + num_rows]
            values, top = chunk_logprobs(logits[first_row : first_row + num_rows], next_ids,
                                         request.params.top_logprobs)
            self._states[request.request_id].record_prompt_logprobs(first_position, values, top)

    def _sample_and_update(self, runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        rows = runner_output.rows
        states = [self._states[request.request_id] for request in rows.sample_requests]
        logits = runner_output.logits
        if rows.sample_rows != tuple(range(logits.shape[0])):  # prompt rows are mixed in
            logits = logits[list(rows.sample_rows)]
        with self.step_times.phase("sample"):
            samples = self._sample_each(logits, states)
        with self.step_times.phase("update"):
            return self._update_each(states, samples, logits)

    def _update_each(self, states: list[RequestState], samples: list[tuple[int, float, TopPairs] | Exception],
                     logits: torch.Tensor) -> list[RequestOutput]:
        """Each request's sampled token appended (its text, stop criteria, best_of forks)."""
        outputs = []
        for row, (state, sample) in enumerate(zip(states, samples)):
            try:
                if isinstance(sample, Exception):  # its sampling failed (see _sample_each)
                    outputs.append(self._fail_request(state, sample))
                    continue
                outputs.extend(self._append_token(state, *sample))
                group = self._group_of.get(state.request_id)
                if group is not None and group.needs_fork:
                    outputs.extend(self._fork_candidates(group, logits[row]))
            except Exception as error:  # this request's own processing (its grammar, say): it alone fails
                outputs.append(self._fail_request(state, error))
        return outputs

    def _sample_each(
        self, logits: torch.Tensor, states: list[RequestState]
    ) -> list[tuple[int, float, TopPairs] | Exception]:
        """(token, logprob, top tokens) per row, sampled as one batch; if the batch raises, each row
        alone, so that a request whose logits processing fails gets its error and the others theirs.
        (Rows redrawn alone after a failure inside the batch's draws may not repeat their seeded
        draws; the batch raises before drawing in every failure we know of: the processors run first.)"""
        try:
            return _samples_of(self.sampler.sample(logits, [state.sampling for state in states]))
        except Exception:
            samples: list[tuple[int, float, TopPairs] | Exception] = []
            for row, state in enumerate(states):
                try:
                    samples.extend(_samples_of(self.sampler.sample(logits[row : row + 1], [state.sampling])))
                except Exception as error:
                    samples.append(error)
            return samples

    def _fail_request(self, state: RequestState, error: Exception) -> RequestOutput:
        """End a request (every candidate of its best_of group) with `error`; its blocks return now."""
        logger.error("request %s failed while generating", state.request_id, exc_info=error)
        wrapped = error if isinstance(error, EngineError) else EngineError(f"generation failed: {error}")
        group = self._group_of.get(state.request_id)
        state.fail(wrapped)
        self.abort(state.request_id)
        output = state.snapshot()
        return output if group is None else dataclasses.replace(output, request_id=group.request_id)

    def _append_token(self, state: RequestState, token_id: int, logprob: float, top: TopPairs) -> list[RequestOutput]:
        """Add the token; finish the request if it stopped; return what callers should see now."""
        state.append_token(token_id, logprob, top)
        if state.is_finished:
            self._finish(state)
        group = self._group_of.get(state.request_id)
        if group is None:
            return [state.snapshot()]
        if state.is_finished and group.mark_finished(state):
            for candidate in group.candidates:
                self._group_of.pop(candidate.request_id, None)
            return [group.result()]
        return []  # best_of results are reported whole, once every candidate has finished

    def _fork_candidates(self, group: BestOfGroup, logits_row: torch.Tensor) -> list[RequestOutput]:
        """Start candidates 1..n-1 from the first one's computed prompt and its first-token logits."""
        first = group.candidates[0]
        children = []
        for index in range(1, group.num_candidates):
            request = Request(group.candidate_id(index), first.request.prompt_token_ids, first.request.params,
                              adapter_key=first.request.adapter_key, cache_scope=first.request.cache_scope,
                              num_cached_tokens=first.request.num_cached_tokens)
            child = RequestState(request, first.prompt, self.tokenizer_info, candidate_index=index)
            self._states[request.request_id] = child
            self._group_of[request.request_id] = group
            group.add(child)
            parent_lease = self._leases.get(first.request_id)
            if parent_lease is not None:
                self._leases[request.request_id] = parent_lease.share()
            children.append(child)
        logits = logits_row.unsqueeze(0).expand(len(children), -1)
        result = self.sampler.sample(logits, [child.sampling for child in children])
        outputs = []
        for child, token_id, logprob, top in zip(children, result.token_ids, result.logprobs, result.top):
            self._share_prompt_cache(first.request, child.request)
            outputs.extend(self._append_token(child, token_id, logprob, top))
        return outputs

    def _share_prompt_cache(self, parent: Request, child: Request) -> None:
        """Give the child the parent's prompt K/V: full blocks shared, the partial last one copied.
        Without a free block for the copy, the child recomputes its prompt instead."""
        num_prompt = parent.num_prompt_tokens
        self.kv_cache.fork(parent.request_id, child.request_id, num_prompt)
        if self.kv_cache.allocate_slots(child.request_id, num_prompt):
            partial_idx = num_prompt // self.kv_cache.block_size_tokens
            if num_prompt % self.kv_cache.block_size_tokens:
                parent_block = self.kv_cache.block_table(parent.request_id)[partial_idx]
                self.runner.copy_block(parent_block, self.kv_cache.block_table(child.request_id)[partial_idx])
            child.num_computed_tokens = num_prompt
            self.scheduler.add_running(child)
        else:
            self.kv_cache.free(child.request_id)
            self.scheduler.add_request(child)

    def generate(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        adapters: Sequence[object] | None = None,
        cache_scope: CacheScope = CacheScope(),
    ) -> list[RequestOutput]:
        """Run prompts to completion together, all in `cache_scope`; outputs in prompt order. A
        request whose adapter failed to load comes back with `error` set and no tokens; the others
        are unaffected."""
        param_list = _broadcast_params(params, len(prompts))
        adapter_list = list(adapters) if adapters is not None else [None] * len(prompts)
        if len(adapter_list) != len(prompts):
            raise ValidationError("adapters", f"expected {len(prompts)} entries, got {len(adapter_list)}")
        ids = [self.add_request(prompt, p, adapter, cache_scope=cache_scope)
               for prompt, p, adapter in zip(prompts, param_list, adapter_list)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for output in self.step():
                if output.finished:
                    final[output.request_id] = output
        return [final[request_id] for request_id in ids]


def _samples_of(result: SampleResult) -> list[tuple[int, float, TopPairs] | Exception]:
    """Each row's (token, logprob, top tokens), or the error of a row whose scores were not finite."""
    return [(token_id, logprob, top) if finite else NonFiniteLogitsError()
            for token_id, logprob, top, finite in zip(result.token_ids, result.logprobs, result.top, result.finite)]


def _broadcast_params(params, count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise ValidationError("params", f"expected one SamplingParams or {count}, got {len(params)}")
    return params


def _eos_token_ids(tokenizer, model_name: str) -> list[int]:
    if tokenizer.eos_token_id is None:
        raise ValidationError("model", f"{model_name}: the tokenizer defines no EOS token")
    return [tokenizer.eos_token_id]


def _model_location(config: EngineConfig) -> tuple[Path, str]:
    """The configured model's path (the embedded one's by default) and its name."""
    if config.model is None:
        return ensure_embedded_model(config.cache_dir), EMBEDDED_MODEL_NAME
    model_dir = Path(config.model).expanduser()
    return model_dir, model_dir.name.lower()


def _sized(config: EngineConfig, budget: MemoryBudget | None) -> EngineConfig:
    """`config` with its KV cache's bytes: the CPU budget's, or on CUDA what the device has free."""
    if budget is None:
        return sized_for_device(config)
    logger.info("%s", budget.describe())
    return dataclasses.replace(config, kv_cache=dataclasses.replace(config.kv_cache, memory_bytes=budget.kv_cache_bytes))


def _num_kv_blocks(config: EngineConfig, model: LlamaModel) -> int:
    if config.kv_cache.num_blocks is not None:
        return config.kv_cache.num_blocks
    shape = model.shape
    bytes_per_block = (
        2 * shape.num_layers * config.kv_cache.block_size_tokens * shape.num_kv_heads * shape.head_dim
        * model.dtype.itemsize
    )
    return max(1, config.kv_cache.memory_bytes // bytes_per_block)
