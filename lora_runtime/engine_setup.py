"""What the engine is built from: the configured model loaded (the embedded GGUF by default), and the
sizes it derives from the model and the memory budget (the KV cache's bytes and blocks, the EOS ids)."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kernels
from lora_runtime.config import EngineConfig
from lora_runtime.device_memory import sized_for_device
from lora_runtime.dtypes import resolve_dtype
from lora_runtime.embedded import EMBEDDED_MODEL_NAME, gguf_path
from lora_runtime.errors import ValidationError
from lora_runtime.gguf_model import is_gguf_file, load_gguf
from lora_runtime.loader import load_model
from lora_runtime.memory_budget import MemoryBudget, memory_budget_for
from lora_runtime.models.llama import LlamaModel
from lora_runtime.threads import use_threads

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: LlamaModel
    tokenizer: Any  # a transformers tokenizer
    model_name: str
    memory_budget: MemoryBudget | None  # None on CUDA (device_memory.py sizes it)


def load_configured_model(config: EngineConfig) -> LoadedModel:
    """Set the compute threads, then load the configured model and its tokenizer; a model that does
    not fit the memory budget is refused before any weight is read."""
    from transformers import AutoTokenizer

    num_threads, source = use_threads(config.num_threads)
    logger.info("compute threads: %d (%s)", num_threads, source)
    model_dir, model_name = model_location(config)
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
    return LoadedModel(model, tokenizer, model_name, memory_budget)


def model_location(config: EngineConfig) -> tuple[Path, str]:
    """The configured model's path and its name; by default the embedded model's GGUF file, served as
    it is (nothing converted, nothing written)."""
    if config.model is None:
        return gguf_path(), EMBEDDED_MODEL_NAME
    model_dir = Path(config.model).expanduser()
    return model_dir, model_dir.name.lower()


def sized_config(config: EngineConfig, budget: MemoryBudget | None) -> EngineConfig:
    """`config` with its KV cache's bytes: the CPU budget's, or on CUDA what the device has free."""
    if budget is None:
        return sized_for_device(config)
    logger.info("%s", budget.describe())
    return dataclasses.replace(config, kv_cache=dataclasses.replace(config.kv_cache, memory_bytes=budget.kv_cache_bytes))


def num_kv_blocks(config: EngineConfig, model: LlamaModel) -> int:
    if config.kv_cache.num_blocks is not None:
        return config.kv_cache.num_blocks
    shape = model.shape
    bytes_per_block = (
        2 * shape.num_layers * config.kv_cache.block_size_tokens * shape.num_kv_heads * shape.head_dim
        * model.dtype.itemsize
    )
    return max(1, config.kv_cache.memory_bytes // bytes_per_block)


def eos_token_ids(tokenizer: Any, model_name: str) -> list[int]:
    if tokenizer.eos_token_id is None:
        raise ValidationError("model", f"{model_name}: the tokenizer defines no EOS token")
    return [tokenizer.eos_token_id]
