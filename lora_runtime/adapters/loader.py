"""From a parsed adapter request to weights in memory: the sources (pbase, hub, s3, local) fetch a PEFT
directory, `load_peft_adapter` validates and reads it against the base model, merges combine several.
Runs on the host cache's loader threads; keeps nothing between loads."""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from lora_runtime.adapters.merge import merge_lora_weights
from lora_runtime.adapters.merge_request import MergedAdapters
from lora_runtime.adapters.peft_format import load_peft_adapter
from lora_runtime.adapters.refs import (AdapterArgument, AdapterRef, AdapterRequest, AdapterSource, Caller, LocalSource,
                                        parse_adapter_ref, parse_merged_ids)
from lora_runtime.adapters.weights import LoraWeights
from lora_runtime.engine_info import AdapterLimits, BaseModelShape
from lora_runtime.errors import AdapterInvalidError, ValidationError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    """An adapter in host memory: its weights, the rank of each module it adapts (the most over its
    layers: what its device pages must hold) and the chat template it ships, if any."""

    weights: LoraWeights
    chat_template: str | None = None
    module_ranks: Mapping[str, int] = field(init=False)

    def __post_init__(self) -> None:
        ranks: dict[str, int] = {}
        for (_, module), factors in self.weights.modules.items():
            ranks[module] = max(ranks.get(module, 0), factors.rank)
        object.__setattr__(self, "module_ranks", ranks)


class AdapterLoader:
    def __init__(self, base_shape: BaseModelShape, limits: AdapterLimits, sources: Mapping[str, AdapterSource],
                 allow_local_paths: bool) -> None:
        self.base_shape = base_shape
        self.limits = limits
        self.allow_local_paths = allow_local_paths
        self.sources: dict[str, AdapterSource] = {"local": LocalSource(), **sources}

    def parse(self, adapter: AdapterArgument, caller: Caller = Caller()) -> AdapterRequest | None:
        """Accept None, an id string, an `AdapterRef`, a `MergedAdapters` or an `AdapterRequest`."""
        if adapter is None or adapter == "":
            return None
        if isinstance(adapter, AdapterRequest):
            request = adapter
        else:
            if isinstance(adapter, str):
                adapter = parse_adapter_ref(adapter, allow_local=self.allow_local_paths)
            if not isinstance(adapter, (AdapterRef, MergedAdapters)):
                raise ValidationError("adapter_id", f"unsupported adapter reference {type(adapter).__name__}")
            request = AdapterRequest(adapter, caller)
        if isinstance(request.adapter, AdapterRef) and request.adapter.source not in self.sources:
            raise ValidationError("adapter_source", f"source {request.adapter.source!r} is not configured")
        if isinstance(request.adapter, MergedAdapters) and not request.parts:  # a library caller's merge
            request = replace(request, parts=parse_merged_ids(request.adapter, self.allow_local_paths))
        return request

    def load(self, request: AdapterRequest) -> LoadedAdapter:
        """Fetch and read the request's adapter (a merge: each distinct id once, then merged)."""
        if isinstance(request.adapter, MergedAdapters):
            merge = request.adapter
            parts = {adapter_id: self._read(part)[0] for adapter_id, part in request.part_requests().items()}
            return LoadedAdapter(merge_lora_weights([parts[adapter_id] for adapter_id in merge.ids], merge))
        return LoadedAdapter(*self._read(request))

    def _read(self, request: AdapterRequest) -> tuple[LoraWeights, str | None]:
        ref = request.adapter
        assert isinstance(ref, AdapterRef), "a merge's parts are references (AdapterRequest.parts)"
        source = self.sources.get(ref.source)
        if source is None:
            raise ValidationError("adapter_source", f"source {ref.source!r} is not configured")
        directory = source.resolve(ref, request.caller)
        weights = load_peft_adapter(directory, self.base_shape, self.limits)
        logger.info("loaded adapter %s (rank %d, %d bytes)", ref.adapter_id, weights.max_rank, weights.num_bytes)
        return weights, read_chat_template(directory)


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
