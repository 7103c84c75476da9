"""The engine's view of adapters: resolve a request's adapter to weights (in the background), keep
them pinned while requests use them, and give each step's adapters a device slot.

Keys: every adapter a request asks for becomes an `AdapterRequest` (reference or merge, plus the
caller's credential and tenant scope). Its `key` string identifies the weights in the host cache,
in the scheduler's adapter budget and in the slot pool. The key includes a digest of the caller's
hub token, so a private adapter cached for one caller is never served to another on the strength
of the cache alone.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

import kernels
from lora_runtime.adapters.cache import AdapterCache
from lora_runtime.adapters.merge import MergedAdapters, merge_lora_weights
from lora_runtime.adapters.peft_format import load_peft_adapter
from lora_runtime.adapters.refs import AdapterRef, LocalSource, parse_adapter_ref
from lora_runtime.adapters.slots import AdapterSlotPool, projection_shapes
from lora_runtime.adapters.weights import AdapterLimits, BaseModelShape, LoraWeights
from lora_runtime.config import AdapterConfig
from lora_runtime.errors import AdapterInvalidError, ValidationError

logger = logging.getLogger(__name__)

# A source turns a validated reference into a local PEFT directory: (ref, api_token, scope) -> Path.
SourceResolver = Callable[[AdapterRef, str | None, str], Path]


@dataclass(frozen=True, slots=True)
class AdapterRequest:
    """One request's adapter: a reference or a merge, with the caller's hub token and tenant."""

    adapter: AdapterRef | MergedAdapters
    api_token: str | None = None
    scope: str = ""
    # What a mutable id names right now (the server puts a pbase version's blob id here): the same id
    # naming new content is a new key, so weights cached for the old content are never served for it.
    version_key: str = ""

    @property
    def key(self) -> str:
        credential = hashlib.sha256(self.api_token.encode()).hexdigest()[:16] if self.api_token else ""
        if isinstance(self.adapter, MergedAdapters):
            described = repr((self.adapter.ids, self.adapter.weights, self.adapter.merge_strategy,
                              self.adapter.density, self.adapter.majority_sign_method))
            return f"merge:{self.scope}:{credential}:{self.version_key}:{described}"
        return f"{self.adapter.source}:{self.scope}:{credential}:{self.version_key}:{self.adapter.adapter_id}"


class AdapterManager:
    def __init__(
        self,
        config: AdapterConfig,
        base_shape: BaseModelShape,
        backend: kernels.Backend,
        model_dtype: torch.dtype,
        sources: Mapping[str, SourceResolver] | None = None,
    ) -> None:
        self.config = config
        self.base_shape = base_shape
        self.limits = AdapterLimits(max_rank=config.max_rank, max_bytes=config.max_adapter_bytes)
        local = LocalSource()
        self.sources: dict[str, SourceResolver] = {"local": lambda ref, token, scope: local.resolve(ref, token)}
        self.sources.update(sources or {})
        self._requests: dict[str, AdapterRequest] = {}
        self.cache: AdapterCache[str, LoraWeights] = AdapterCache(
            loader=self._load, size_of=lambda weights: weights.num_bytes,
            max_bytes=config.host_cache_bytes, num_workers=config.num_loader_threads,
        )
        self.backend = backend
        layout = backend.lora_layout(model_dtype, list(projection_shapes(base_shape).values()))
        self.pool = AdapterSlotPool(base_shape, config.num_slots, config.max_rank, layout, backend.device)
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._futures: dict[str, Future[LoraWeights]] = {}
        self._chat_templates: dict[str, str] = {}  # key -> the adapter's own chat template

    def parse(self, adapter: object, api_token: str | None = None, scope: str = "") -> AdapterRequest | None:
        """Accept None, an id string, an `AdapterRef`, a `MergedAdapters` or an `AdapterRequest`."""
        if adapter is None or adapter == "":
            return None
        if isinstance(adapter, AdapterRequest):
            request = adapter
        else:
            if isinstance(adapter, str):
                adapter = parse_adapter_ref(adapter, allow_local=self.config.allow_local_paths)
            if not isinstance(adapter, (AdapterRef, MergedAdapters)):
                raise ValidationError("adapter_id", f"unsupported adapter reference {type(adapter).__name__}")
            request = AdapterRequest(adapter, api_token, scope)
        if isinstance(request.adapter, AdapterRef) and request.adapter.source not in self.sources:
            raise ValidationError("adapter_source", f"source {request.adapter.source!r} is not configured")
        return request

    def acquire(self, request: AdapterRequest) -> Future[LoraWeights]:
        """Start (or join) the load of the request's adapter and pin it for one user; the caller
        owes one `release(key)` once the future has succeeded."""
        key = request.key
        self._requests[key] = request
        future = self.cache.get_or_load(key, pin=True)
        self._futures[key] = future
        return future

    def pin(self, key: str) -> None:
        """One more user of an adapter that is already loaded (a best_of candidate)."""
        self.cache.pin(key)

    def release(self, key: str) -> None:
        if self.failure(key) is None and key in self.cache:
            self.cache.unpin(key)

    def release_when_loaded(self, key: str, load: Future[LoraWeights]) -> None:
        """Give back a pin taken by `acquire` whose request was refused, once its load settles."""
        load.add_done_callback(lambda done: self.release(key) if done.exception() is None else None)

    def is_ready(self, key: str) -> bool:
        future = self._futures.get(key)
        return future is not None and future.done() and future.exception() is None

    def failure(self, key: str) -> BaseException | None:
        future = self._futures.get(key)
        return future.exception() if future is not None and future.done() else None

    def chat_template(self, key: str) -> str | None:
        """The chat template the adapter ships (tokenizer files beside its weights), if any."""
        return self._chat_templates.get(key)

    def _load(self, key: str) -> LoraWeights:
        request = self._requests[key]
        if isinstance(request.adapter, MergedAdapters):
            parts = [self._load_one(self.parse(adapter_id, request.api_token, request.scope))[0] for adapter_id in request.adapter.ids]
            return merge_lora_weights(parts, request.adapter)
        weights, template = self._load_one(request)
        if template:
            self._chat_templates[key] = template
        return weights

    def _load_one(self, request: AdapterRequest) -> tuple[LoraWeights, str | None]:
        ref = request.adapter
        if not isinstance(ref, AdapterRef):
            raise ValidationError("merged_adapters.ids", "a merge cannot contain another merge")
        directory = self.sources[ref.source](ref, request.api_token, request.scope)
        weights = load_peft_adapter(directory, self.base_shape, self.limits)
        logger.info("loaded adapter %s (rank %d, %d bytes)", ref.adapter_id, weights.max_rank, weights.num_bytes)
        return weights, read_chat_template(directory)

    def assign_slots(self, keys: set[str]) -> dict[str, int]:
        """Give every adapter of the step a device slot, loading weights into free or least recently
        used slots that this step does not need."""
        assert len(keys) <= self.pool.num_slots, "the scheduler's adapter budget exceeds the slot pool"
        for key in keys:
            if key in self._slot_of:
                self._slot_of.move_to_end(key)
                continue
            slot = self._free_slot(keys)
            weights = self.cache.get(key)
            assert weights is not None, f"adapter {key!r} is scheduled but not pinned in the cache"
            self.pool.load(slot, weights)
            self._slot_of[key] = slot
        return {key: self._slot_of[key] for key in keys}

    def _free_slot(self, keys: set[str]) -> int:
        used = set(self._slot_of.values())
        for slot in range(self.pool.num_slots):
            if slot not in used:
                return slot
        victim = next(key for key in self._slot_of if key not in keys)
        return self._slot_of.pop(victim)

    def lora_batch(self, token_slots: list[int], active_slots: set[int]) -> LoraStep:
        """The step's LoRA applier, for token_slots `[num_tokens]` (-1 = base model). Projections
        that no active slot targets are skipped; the others run at each slot's rank per slice."""
        targeted = {projection for projection, ranks in self.pool.projection_ranks.items()
                    if any(ranks[slot] for slot in active_slots)}
        return LoraStep(self.pool, self.backend, self.backend.plan_lora(token_slots), targeted)

    def close(self) -> None:
        self.cache.close()


def read_chat_template(directory: Path) -> str | None:
    """`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a string, or a list of
    named templates of which `default` is used)."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config_path = directory / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    try:
        template = json.loads(config_path.read_text()).get("chat_template")
    except (json.JSONDecodeError, AttributeError):
        raise AdapterInvalidError("tokenizer_config.json: not a JSON object") from None
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


class LoraStep:
    """Implements `forward_batch.LoraBatch` for one step: adds each token's adapter delta."""

    __slots__ = ("pool", "backend", "plan", "targeted")

    def __init__(self, pool: AdapterSlotPool, backend: kernels.Backend, plan: object, targeted: set[str]) -> None:
        self.pool = pool
        self.backend = backend
        self.plan = plan  # the backend's LoRA plan of the step
        self.targeted = targeted  # projections some adapter of the step adapts

    def apply(self, layer_idx: int, projection: str, y: torch.Tensor, x: torch.Tensor) -> None:
        if projection not in self.targeted:
            return
        lora_a, lora_b, slice_offsets = self.pool.layer(layer_idx, projection)
        self.backend.add_lora(y, x, lora_a, lora_b, self.plan, slice_offsets=slice_offsets,
                              slice_ranks=self.pool.slice_ranks[projection])
