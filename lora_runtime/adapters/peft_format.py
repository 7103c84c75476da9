"""Read a PEFT LoRA directory into validated `LoraWeights`.

A PEFT LoRA directory holds `adapter_config.json` and `adapter_model.safetensors` (preferred) or
`adapter_model.bin` (read only with `torch.load(weights_only=True)`, which refuses arbitrary
pickled code). Saved keys look like `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`.

The factors are used exactly as PEFT's LoRA forward uses them, `y += (x @ A.T) @ B.T * scale`, so
`fan_in_fan_out` (which only transposes the merged delta for Conv1D-style base weights; PEFT turns it
off for `nn.Linear` targets) never changes them. Refusals name the field: `AdapterInvalidError` for
corrupt, missing or unsupported content, `AdapterIncompatibleError` for what does not fit the base
model or the configured limits."""
from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from lora_runtime.adapter_files import ADAPTER_CONFIG_FILE as CONFIG_FILE
from lora_runtime.adapter_files import BIN_FILE, SAFETENSORS_FILE
from lora_runtime.adapters.peft_config import check_supported_config, module_rank_and_alpha
from lora_runtime.adapters.weights import (
    FUSED_MODULES,
    MODULE_NAMES,
    TARGETABLE_MODULES,
    LoraModuleWeights,
    LoraWeights,
    ModuleKey,
    unbounded_module,
)
from lora_runtime.engine_info import AdapterLimits, BaseModelShape
from lora_runtime.errors import AdapterIncompatibleError, AdapterInvalidError

logger = logging.getLogger(__name__)

BIN_REFUSAL = (f"{BIN_FILE} is corrupt or not a plain tensor checkpoint (a dictionary of named "
               f"tensors); save the adapter as {SAFETENSORS_FILE}")

_FACTOR_KEY = re.compile(
    r"^(?:base_model\.model\.)?"
    r"(?P<path>(?:[\w.]*\.)?layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\.(?P<module>\w+))"
    r"\.lora_(?P<factor>[AB])\.weight$"
)
_PARENT_OF = {name: "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
              for name in TARGETABLE_MODULES}
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def load_peft_adapter(
    directory: Path, base_shape: BaseModelShape, limits: AdapterLimits
) -> LoraWeights:
    """Read, validate and return the adapter stored in `directory`.

    Raises:
        AdapterInvalidError: missing or corrupt files, unsupported PEFT features (named), values
            that are not finite or an update over `weights.MAX_DELTA_NORM` (the module named).
        AdapterIncompatibleError: shapes that do not fit `base_shape`, rank or size over `limits`.
    """
    config = read_adapter_config(directory)
    check_supported_config(config)
    factors = _group_factors(_read_tensors(directory))
    modules = {key: _module_weights(config, path, a, b) for key, (path, a, b) in factors.items()}
    weights = LoraWeights(_unfused(modules, base_shape), config.get("base_model_name_or_path"))
    check_fits(weights, base_shape, limits)
    _check_bounded(weights)
    return weights


def read_adapter_config(directory: Path) -> dict[str, Any]:
    config_path = Path(directory) / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterInvalidError(f"{CONFIG_FILE} is missing in the adapter directory")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AdapterInvalidError(f"{CONFIG_FILE} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise AdapterInvalidError(f"{CONFIG_FILE} must hold a JSON object")
    return config


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    safetensors_path, bin_path = Path(directory) / SAFETENSORS_FILE, Path(directory) / BIN_FILE
    if safetensors_path.is_file():
        try:
            return load_file(safetensors_path, device="cpu")
        except (SafetensorError, OSError) as error:
            raise AdapterInvalidError(f"adapter weights file is corrupt: {error}") from error
    if bin_path.is_file():
        return read_bin_tensors(bin_path)
    raise AdapterInvalidError(f"{SAFETENSORS_FILE} (or {BIN_FILE}) is missing")


def read_bin_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The named tensors of a torch-pickled `adapter_model.bin`, read with `weights_only=True` so
    that pickled code never runs. Every source's adapters and every upload's conversion read a
    `.bin` here, so a bad file gets one message whichever way it came.

    Raises:
        AdapterInvalidError: `BIN_REFUSAL`, for pickled code, a corrupt file or anything but a
            dictionary of named tensors. torch's own text (paragraphs, advice to turn `weights_only`
            off) is only logged: it is no answer to give a client.
    """
    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any failure to unpickle plain tensors is this refusal
        logger.info("refused %s: %s: %s", path, type(error).__name__, error)
        raise AdapterInvalidError(BIN_REFUSAL) from None
    if not isinstance(tensors, dict) or not all(
        isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in tensors.items()
    ):
        raise AdapterInvalidError(BIN_REFUSAL)
    return tensors


def _group_factors(
    tensors: dict[str, torch.Tensor],
) -> dict[ModuleKey, tuple[str, torch.Tensor, torch.Tensor]]:
    """Pair each module's A and B tensors: (layer, module) -> (module path, A, B), sorted."""
    found: dict[ModuleKey, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        match = _FACTOR_KEY.match(key)
        if match is None or match["module"] not in TARGETABLE_MODULES:
            raise AdapterInvalidError(_describe_unsupported_key(key))
        if _PARENT_OF[match["module"]] != match["parent"]:
            raise AdapterInvalidError(f"weights: unexpected tensor {key!r}")
        _check_tensor(key, tensor)
        entry = found.setdefault((int(match["layer"]), match["module"]), {"path": match["path"]})
        entry[match["factor"]] = tensor
    if not found:
        raise AdapterInvalidError("weights: the adapter holds no LoRA tensors")
    grouped = {}
    for key in sorted(found, key=lambda k: (k[0], TARGETABLE_MODULES.index(k[1]))):
        entry = found[key]
        if "A" not in entry or "B" not in entry:
            raise AdapterInvalidError(f"weights: {entry['path']} lacks its lora_A or lora_B tensor")
        grouped[key] = (entry["path"], entry["A"], entry["B"])
    return grouped


def _describe_unsupported_key(key: str) -> str:
    if "lora_magnitude_vector" in key:
        return f"use_dora: DoRA adapters are not supported (tensor {key!r})"
    if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
        return f"target_modules: embedding and lm_head LoRA are not supported (tensor {key!r})"
    if "modules_to_save" in key:
        return f"modules_to_save: fully trained modules are not supported (tensor {key!r})"
    return (
        f"weights: unsupported tensor {key!r}; only LoRA factors of "
        f"{', '.join(TARGETABLE_MODULES)} are supported"
    )


def _check_tensor(key: str, tensor: torch.Tensor) -> None:
    """Its shape and dtype; its values are checked with all the others' (`_check_bounded`)."""
    if tensor.dim() != 2 or tensor.dtype not in _FLOAT_DTYPES:
        raise AdapterInvalidError(
            f"weights: {key!r} must be a 2-D float tensor, got {tuple(tensor.shape)} {tensor.dtype}"
        )


def _check_bounded(weights: LoraWeights) -> None:
    """Refuse values that are not finite or a module whose update could exceed the bound
    (`weights.MAX_DELTA_NORM`): one rule for every source, since every one reads adapters here."""
    found = unbounded_module(weights.modules)
    if found is not None:
        (layer_idx, module), what = found
        raise AdapterInvalidError(f"weights: layer {layer_idx} {module} holds {what}")


def _module_weights(
    config: dict[str, Any], path: str, lora_a: torch.Tensor, lora_b: torch.Tensor
) -> LoraModuleWeights:
    rank = lora_a.shape[0]
    if lora_b.shape[1] != rank:
        raise AdapterInvalidError(
            f"weights: {path} has lora_A rank {rank} but lora_B rank {lora_b.shape[1]}"
        )
    config_rank, alpha = module_rank_and_alpha(config, path)
    if config_rank != rank:
        raise AdapterInvalidError(
            f"r: {path} has rank {rank} in the weights but {config_rank} in {CONFIG_FILE}"
        )
    denominator = math.sqrt(rank) if config.get("use_rslora") else rank
    return LoraModuleWeights(lora_a, lora_b, alpha / denominator)


def _unfused(modules: dict[ModuleKey, LoraModuleWeights],
             base_shape: BaseModelShape) -> dict[ModuleKey, LoraModuleWeights]:
    """Each factor pair of a fused module (Phi-3's qkv_proj, gate_up_proj) as its parts' pairs, in
    layer then module order; refuses a fused module the base model does not have, or whose B does not
    split into its parts' widths."""
    parts_of: dict[ModuleKey, LoraModuleWeights] = {}
    for (layer_idx, module), factors in modules.items():
        parts = FUSED_MODULES.get(module)
        if parts is None:
            parts_of[(layer_idx, module)] = factors
            continue
        if module not in base_shape.module_shapes:
            raise AdapterIncompatibleError(f"target_modules: {module} is not a module of {base_shape.model_name}")
        widths = [base_shape.module_shapes[part][1] for part in parts]
        if factors.lora_b.shape[0] != sum(widths):
            raise AdapterIncompatibleError(
                f"target_modules: layer {layer_idx} {module} expects lora_B [{sum(widths)}, r], got "
                f"{tuple(factors.lora_b.shape)}: the adapter was made for another base model")
        for part, lora_b in zip(parts, factors.lora_b.split(widths)):
            parts_of[(layer_idx, part)] = LoraModuleWeights(factors.lora_a, lora_b.contiguous(), factors.scale)
    return dict(sorted(parts_of.items(), key=lambda item: (item[0][0], MODULE_NAMES.index(item[0][1]))))


def check_fits(weights: LoraWeights, base_shape: BaseModelShape, limits: AdapterLimits) -> None:
    """Refuse weights that do not fit the base model or exceed the limits; warn (only) when the
    adapter names another base model whose shapes nevertheless fit."""
    for (layer_idx, module), factors in weights.modules.items():
        if layer_idx >= base_shape.num_layers:
            raise AdapterIncompatibleError(
                f"layers_to_transform: layer {layer_idx} does not exist in {base_shape.model_name} "
                f"({base_shape.num_layers} layers)"
            )
        in_features, out_features = base_shape.module_shapes[module]
        if factors.lora_a.shape[1] != in_features or factors.lora_b.shape[0] != out_features:
            raise AdapterIncompatibleError(
                f"target_modules: layer {layer_idx} {module} expects lora_A [r, {in_features}] and "
                f"lora_B [{out_features}, r], got {tuple(factors.lora_a.shape)} and "
                f"{tuple(factors.lora_b.shape)}: the adapter was made for another base model"
            )
    if weights.max_rank > limits.max_rank:
        raise AdapterIncompatibleError(
            f"r: rank {weights.max_rank} exceeds the maximum adapter rank {limits.max_rank}"
        )
    if weights.num_bytes > limits.max_bytes:
        raise AdapterIncompatibleError(
            f"adapter size {weights.num_bytes} bytes exceeds the limit of {limits.max_bytes} bytes"
        )
    _warn_on_other_base_model(weights.base_model_name, base_shape.model_name)


def _warn_on_other_base_model(adapter_base: str | None, model_name: str) -> None:
    def short(name: str) -> str:
        return name.rstrip("/").rsplit("/", 1)[-1].lower()

    if adapter_base and short(adapter_base) != short(model_name):
        logger.warning(
            "adapter was made for base model %r but is applied to %r (shapes fit)",
            adapter_base, model_name,
        )
