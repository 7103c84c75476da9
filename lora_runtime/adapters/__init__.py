"""Adapters: references and sources, PEFT loading and validation, merging, and the tiers that hold
loaded adapters (the host cache, the device's adapter pages). The engine wires these together; nothing
here knows about requests.

Names are imported on first use (PEP 562): the torch-free modules (`refs`, `merge_request`) import
without the others' torch."""
from __future__ import annotations

from lora_runtime.lazy_exports import lazy_getattr

# Each public name -> the module that defines it.
_HOMES = {
    "MODULE_NAMES": "lora_runtime.adapters.weights",
    "AdapterCache": "lora_runtime.adapters.cache",
    "AdapterKey": "lora_runtime.adapters.refs",
    "AdapterLease": "lora_runtime.adapters.cache",
    "AdapterLimits": "lora_runtime.engine_info",
    "AdapterPagePool": "lora_runtime.adapters.pages",
    "AdapterPlacement": "lora_runtime.adapters.pages",
    "AdapterRef": "lora_runtime.adapters.refs",
    "AdapterRequest": "lora_runtime.adapters.refs",
    "AdapterSource": "lora_runtime.adapters.refs",
    "BaseModelShape": "lora_runtime.engine_info",
    "Caller": "lora_runtime.adapters.refs",
    "LocalSource": "lora_runtime.adapters.refs",
    "LoraModuleWeights": "lora_runtime.adapters.weights",
    "LoraWeights": "lora_runtime.adapters.weights",
    "MergedAdapters": "lora_runtime.adapters.merge_request",
    "load_peft_adapter": "lora_runtime.adapters.peft_format",
    "merge_lora_weights": "lora_runtime.adapters.merge",
    "parse_adapter_ref": "lora_runtime.adapters.refs",
}

__all__ = sorted(_HOMES)

__getattr__ = lazy_getattr(globals(), _HOMES)
