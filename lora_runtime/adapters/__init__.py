"""Adapters: references and sources, PEFT loading and validation, merging, the host cache and the
device slot pool. The engine wires these together; nothing here knows about requests."""
from lora_runtime.adapters.cache import AdapterCache
from lora_runtime.adapters.merge import MergedAdapters, merge_lora_weights
from lora_runtime.adapters.peft_format import load_peft_adapter
from lora_runtime.adapters.refs import AdapterRef, LocalSource, parse_adapter_ref
from lora_runtime.adapters.slots import PROJECTION_SLICES, AdapterSlotPool
from lora_runtime.adapters.weights import (
    MODULE_NAMES,
    AdapterLimits,
    BaseModelShape,
    LoraModuleWeights,
    LoraWeights,
)

__all__ = [
    "MODULE_NAMES",
    "PROJECTION_SLICES",
    "AdapterCache",
    "AdapterLimits",
    "AdapterRef",
    "AdapterSlotPool",
    "BaseModelShape",
    "LocalSource",
    "LoraModuleWeights",
    "LoraWeights",
    "MergedAdapters",
    "load_peft_adapter",
    "merge_lora_weights",
    "parse_adapter_ref",
]
