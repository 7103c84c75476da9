"""A package's public names imported on first use (PEP 562's module `__getattr__`), so that importing
the package, or a torch-free module inside it, does not load the modules that define the rest (the
engine, the sampler, torch). Shared by `lora_runtime`, `lora_runtime.adapters` and `lora_runtime.sampling`."""
from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(namespace: dict[str, Any], homes: Mapping[str, str]) -> Callable[[str], Any]:
    """The `__getattr__` of the module whose globals are `namespace`: each name of `homes` imported from
    the module `homes` maps it to, then kept in `namespace` so that later reads skip this function.

    Submodules (`from lora_runtime.adapters import weights`) are found by the import system before
    `__getattr__` is asked; any other name is a typo, refused as a plain module refuses it."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name]), name)
        namespace[name] = value
        return value

    return __getattr__
