"""Adapters: references and sources, PEFT loading and validation, merging, and the tiers that hold
loaded adapters (the host cache, the device's adapter pages). The engine wires these together; nothing
here knows about requests."""
from lora_runtime.adapters.cache import AdapterCache, AdapterLease
from lora_runtime.adapters.merge import MergedAdapters, merge_lora_weights
from lora_runtime.adapters.pages import AdapterPagePool, AdapterPlacement
from lora_runtime.adapters.peft_format import load_peft_adapter
from lora_runtime.adapters.refs import AdapterKey, AdapterRef, AdapterRequest, AdapterSource, Caller, LocalSource, parse_adapter_ref
from lora_runtime.adapters.weights import (
    MODULE_NAMES,
    AdapterLimits,
    BaseModelShape,
    LoraModuleWeights,
    LoraWeights,
)

__all__ = [
    "MODULE_NAMES",
    "AdapterCache",
    "AdapterKey",
    "AdapterLease",
    "AdapterLimits",
    "AdapterPagePool",
    "AdapterPlacement",
    "AdapterRef",
    "AdapterRequest",
    "AdapterSource",
    "BaseModelShape",
    "Caller",
    "LocalSource",
    "LoraModuleWeights",
    "LoraWeights",
    "MergedAdapters",
    "load_peft_adapter",
    "merge_lora_weights",
    "parse_adapter_ref",
]
