"""Validation of a PEFT `adapter_config.json` and its per-module rank and alpha.

Supported: `r`, `lora_alpha`, `use_rslora`, `target_modules` (names of q/k/v/o/gate/up/down, a regex
string, or `all-linear`), `rank_pattern` / `alpha_pattern`, `layers_to_transform`, `fan_in_fan_out`,
`bias: none`. Everything that changes the model beyond low-rank updates of those linears is refused,
naming the field, because applying only part of such an adapter would silently give wrong outputs."""
from __future__ import annotations

import math
import re
from numbers import Real
from typing import Any

from lora_runtime.adapters.weights import TARGETABLE_MODULES
from lora_runtime.errors import AdapterInvalidError

CLASSIFICATION_TASK_TYPES = ("SEQ_CLS", "TOKEN_CLS")

# (field, refusal) for fields whose presence (a truthy value) means an unsupported feature.
_UNSUPPORTED_WHEN_SET = (
    ("use_dora", "DoRA adapters are not supported"),
    ("modules_to_save", "adapters that fully train extra modules are not supported"),
    ("lora_bias", "LoRA bias terms are not supported"),
    ("target_parameters", "LoRA on raw parameters is not supported"),
    ("trainable_token_indices", "trainable embedding tokens are not supported"),
    ("layer_replication", "layer replication is not supported"),
    ("alora_invocation_tokens", "activated LoRA (aLoRA) is not supported"),
    ("use_qalora", "QA-LoRA (input pooling) is not supported"),
)


def check_supported_config(config: dict[str, Any]) -> None:
    """Raise AdapterInvalidError naming the first unsupported or malformed field."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterInvalidError(f"peft_type: only LORA adapters are supported, got {peft_type!r}")
    task_type = config.get("task_type")
    if task_type in CLASSIFICATION_TASK_TYPES:
        raise AdapterInvalidError(
            f"task_type: {task_type} is a classification adapter; classification adapters need a "
            "different deployment flow (a classification head), not text generation"
        )
    for field, refusal in _UNSUPPORTED_WHEN_SET:
        if config.get(field):
            raise AdapterInvalidError(f"{field}: {refusal}")
    if config.get("bias", "none") != "none":
        raise AdapterInvalidError(f"bias: only 'none' is supported, got {config['bias']!r}")
    _check_numbers(config)
    _check_target_modules(config.get("target_modules"))


def _check_numbers(config: dict[str, Any]) -> None:
    if not _is_positive_int(config.get("r")):
        raise AdapterInvalidError(f"r: must be a positive integer, got {config.get('r')!r}")
    if not _is_number(config.get("lora_alpha")):
        raise AdapterInvalidError(f"lora_alpha: must be a number, got {config.get('lora_alpha')!r}")
    for field, is_valid in (("rank_pattern", _is_positive_int), ("alpha_pattern", _is_number)):
        pattern = config.get(field) or {}
        if not isinstance(pattern, dict) or not all(is_valid(value) for value in pattern.values()):
            raise AdapterInvalidError(f"{field}: must map module patterns to numbers")
    layers = config.get("layers_to_transform")
    if layers is not None and not (
        _is_non_negative_int(layers)
        or (isinstance(layers, list) and all(_is_non_negative_int(idx) for idx in layers))
    ):
        raise AdapterInvalidError(f"layers_to_transform: must be layer indices, got {layers!r}")


def _check_target_modules(target_modules: Any) -> None:
    if target_modules is None or isinstance(target_modules, str):
        return  # `all-linear` or a regex: the saved tensor names are checked one by one instead
    if not isinstance(target_modules, list):
        raise AdapterInvalidError(f"target_modules: must be a list or a string, got {target_modules!r}")
    for name in target_modules:
        if not isinstance(name, str) or name.rsplit(".", 1)[-1] not in TARGETABLE_MODULES:
            raise AdapterInvalidError(
                f"target_modules: {name!r} is not supported; supported modules are "
                f"{', '.join(TARGETABLE_MODULES)} (embedding and lm_head LoRA are not)"
            )


def module_rank_and_alpha(config: dict[str, Any], module_path: str) -> tuple[int, float]:
    """PEFT's rank and alpha for the module at `module_path` (e.g. `model.layers.0.self_attn.q_proj`):
    the first `rank_pattern` / `alpha_pattern` key that matches a dotted suffix of the path wins."""
    rank = _pattern_value(config.get("rank_pattern") or {}, module_path, config["r"])
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module_path, config["lora_alpha"])
    _check_layer_transformed(config.get("layers_to_transform"), module_path)
    return int(rank), float(alpha)


def _pattern_value(patterns: dict[str, Any], module_path: str, default: Any) -> Any:
    for pattern, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({pattern})$", module_path):
                return value
        except re.error as error:
            raise AdapterInvalidError(f"rank_pattern/alpha_pattern: bad pattern {pattern!r}") from error
    return default


def _check_layer_transformed(layers: int | list[int] | None, module_path: str) -> None:
    if layers is None:
        return
    allowed = [layers] if isinstance(layers, int) else layers
    layer_idx = int(re.search(r"layers\.(\d+)\.", module_path).group(1))
    if layer_idx not in allowed:
        raise AdapterInvalidError(
            f"layers_to_transform: weights for layer {layer_idx} but the config lists {allowed}"
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and not (isinstance(value, float) and math.isnan(value))


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_non_negative_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
