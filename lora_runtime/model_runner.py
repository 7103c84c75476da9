"""Turns a `SchedulerOutput` into the step's tensors (the attention plan, and the LoRA applier for
the step's adapters where the scheduler placed them), runs the model, and returns the logits rows.
It makes no policy decisions: which tokens run, and where adapters lie, was decided by the scheduler."""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from lora_runtime.adapters.manager import AdapterManager
from lora_runtime.core import Request
from lora_runtime.forward_batch import ForwardBatch, LoraBatch
from lora_runtime.kv_cache import KVCacheManager
from lora_runtime.models.llama import KVCacheTensors, LlamaModel
from lora_runtime.scheduler import SchedulerOutput
from lora_runtime.step_timing import StepTimes


@dataclass(frozen=True, slots=True)
class LogitsRows:
    """Which logits row belongs to what: a next-token row per sampling request, and for requests
    asking for prompt logprobs, the rows of their prompt positions in this chunk."""

    sample_requests: tuple[Request, ...]
    sample_rows: tuple[int, ...]
    prompt_rows: tuple[tuple[Request, int, int, int], ...]  # (request, first position, first row, rows)


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    logits: torch.Tensor  # [num_rows, vocab] in the model's dtype
    rows: LogitsRows


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCacheManager, num_blocks: int, device: str,
                 adapters: AdapterManager | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.adapters = adapters
        self.device = device
        self.block_size = kv_cache.block_size_tokens
        self.cache_tensors = KVCacheTensors.allocate(model.shape, num_blocks, self.block_size, model.dtype, device)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, times: StepTimes | None = None) -> ModelRunnerOutput:
        """The step's logits; the time of building its inputs and of the forward pass added to `times`."""
        times = times if times is not None else StepTimes()
        with times.phase("prepare"):
            batch, rows = self.prepare(output)
        with times.phase("forward"):
            logits = self.model.forward(batch, self.cache_tensors)
        return ModelRunnerOutput(logits=logits, rows=rows)

    def prepare(self, output: SchedulerOutput) -> tuple[ForwardBatch, LogitsRows]:
        step = _StepInputs(self.block_size)
        for item in output.scheduled:
            step.add(item.request, item.num_computed_tokens, item.num_new_tokens, item.samples_next_token,
                     self.kv_cache.block_table(item.request.request_id))
        sequences = kernels.StepSequences(step.query_start, step.seq_lens, step.tables, self.block_size)
        batch = ForwardBatch(
            input_ids=self._tensor(step.input_ids),
            positions=self._tensor(step.positions),
            slot_mapping=self._tensor(step.slots),
            attention=self.model.backend.plan_attention(sequences),
            logits_indices=self._tensor(step.logits_indices),
            request_lens=self._tensor(step.request_lens),
            lora=self._lora(output),
        )
        return batch, LogitsRows(tuple(step.sample_requests), tuple(step.sample_rows), tuple(step.prompt_rows))

    def _lora(self, output: SchedulerOutput) -> LoraBatch | None:
        """The step's adapters applied per token (None when no token has one)."""
        if not output.adapters:
            return None
        assert self.adapters is not None, "a step names adapters but this runner has none"
        entry_of = {key: entry for entry, (key, _) in enumerate(output.adapters)}
        token_entries = [entry_of[item.request.adapter_key] if item.request.adapter_key is not None else -1
                         for item in output.scheduled for _ in range(item.num_new_tokens)]
        return self.adapters.lora_step(output.adapters, token_entries)

    def copy_block(self, source_block: int, target_block: int) -> None:
        """Copy one KV block's contents, in every layer (best_of forks copy a partial block)."""
        for cache in (*self.cache_tensors.key, *self.cache_tensors.value):
            cache[target_block].copy_(cache[source_block])

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)


class _StepInputs:
    """Python-side lists of one step's inputs, filled request by request, turned into tensors once."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.request_lens: list[int] = []
        self.slots: list[int] = []
        self.query_start = [0]
        self.seq_lens: list[int] = []
        self.tables: list[list[int]] = []
        self.logits_indices: list[int] = []
        self.sample_requests: list[Request] = []
        self.sample_rows: list[int] = []
        self.prompt_rows: list[tuple[Request, int, int, int]] = []

    def add(self, request: Request, start: int, count: int, samples: bool, table: list[int]) -> None:
        """Tokens start..start+count-1 of `request`, whose blocks are `table`."""
        first_token = len(self.input_ids)
        self.input_ids.extend(request.all_token_ids[start : start + count])
        self.positions.extend(range(start, start + count))
        self.request_lens.extend([request.num_tokens] * count)
        size = self.block_size
        self.slots.extend(table[p // size] * size + p % size for p in range(start, start + count))
        self.query_start.append(len(self.input_ids))
        self.seq_lens.append(start + count)
        self.tables.append(table)
        # Logits at prompt positions t score prompt token t + 1 (decoder_input_details), from the first
        # prefill only: a recompute (after a preemption, or LongRoPE's switch) does not score it again.
        num_prompt_rows = min(start + count, request.num_prompt_tokens - 1) - start
        if request.params.decoder_input_details and num_prompt_rows > 0 and not request.output_token_ids:
            self.prompt_rows.append((request, start, len(self.logits_indices), num_prompt_rows))
            self.logits_indices.extend(range(first_token, first_token + num_prompt_rows))
        if samples:
            self.sample_requests.append(request)
            self.sample_rows.append(len(self.logits_indices))
            self.logits_indices.append(len(self.input_ids) - 1)
