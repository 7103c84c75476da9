"""Serve a GGUF file as it is: the architecture, shape, tokenizer and chat template from its metadata
(read by transformers' own GGUF config and tokenizer converters, as `embedded.py` does), and every
projection kept in its block type (kernels/quantized.py), copied out of the memory-mapped file a
tensor at a time, so the resident weights are about the file's size.

Dense tensors (F32, F16, BF16: llama.cpp keeps norms in F32) are cast to the model's dtype. The token
embedding stays in its blocks too (tied, the head's one copy is it): a lookup dequantizes the rows it
reads. Each family's tensor names, and the changes llama.cpp's converter made to them (a Llama's q
and k rows permuted into its rotary layout: whole rows, so whole block rows, undone here without
dequantizing), are in `gguf_architectures.py`.
"""
from __future__ import annotations

import functools
import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch

import kernels
from kernels import reference
from kernels.linear import LinearWeight
from kernels.quantized import BLOCK_TYPES, QuantizedTensor, QuantizedWeight
from lora_runtime.dtypes import DTYPES
from lora_runtime.errors import ValidationError
from lora_runtime.gguf_architectures import ARCHITECTURES, projection_rows, rotary_unpermutation, unread_metadata
from lora_runtime.models.architectures import ModelShape, model_features_from_config, model_shape_from_config
from lora_runtime.models.llama import LayerWeights, LlamaModel, ModelWeights
from lora_runtime.models.rope import rotary_tables

DENSE_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
SUPPORTED_TYPES = (*DENSE_TYPES, *BLOCK_TYPES)

Weight = torch.Tensor | QuantizedTensor

logger = logging.getLogger(__name__)


def is_gguf_file(path: Path) -> bool:
    return path.suffix.lower() == ".gguf"


def gguf_config(path: Path) -> object:
    """transformers' config of a GGUF file, read once per file version: the memory budget and the
    load both need it, and each read parses the whole metadata (seconds for a 128k vocabulary)."""
    return _read_gguf_config(*_file_version(path))


def _file_version(path: Path) -> tuple[Path, int, int]:
    """What the cached reads of a file are keyed on: a rewritten file is read again."""
    stat = path.stat()
    return path.resolve(), stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=4)
def _read_gguf_config(path: Path, mtime_ns: int, size: int) -> object:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)


def load_gguf(path: Path, dtype: str, device: str, backend: kernels.Backend) -> tuple[LlamaModel, object]:
    """Our model and its tokenizer from a GGUF file; `dtype` is the dtype of the activations and of
    the dense tensors (a concrete one: "auto" is resolved by the engine)."""
    from transformers import AutoTokenizer

    file = GGUFTensors(path, DTYPES[dtype], device)
    # Each transformers reader below turns the tokenizer's metadata arrays (Llama 3's 128k tokens and
    # 280k merges) into Python objects, ~300 MB at once: read them before any weight is held, so that
    # transient does not stack on the weights' bytes at the load's peak.
    config = gguf_config(path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    shape = model_shape_from_config(config)
    features = model_features_from_config(config, shape)
    file.check_read_fully(shape)
    embed_tokens, lm_head = _embedding_and_head(file, shape, backend)
    weights = ModelWeights(
        embed_tokens=embed_tokens,
        layers=[_layer_weights(file, shape, idx, backend) for idx in range(shape.num_layers)],
        final_norm=file.dense("output_norm.weight", (shape.hidden_size,)),
        lm_head=lm_head,
    )
    file.warn_widened()
    rotary = rotary_tables(config, features.layer_rope, shape.head_dim, shape.max_model_len, file.dtype, file.device)
    return LlamaModel(shape, weights, rotary, backend, features), tokenizer


def _embedding_and_head(file: GGUFTensors, shape: ModelShape,
                        backend: kernels.Backend) -> tuple[torch.Tensor | LinearWeight | None, LinearWeight]:
    """The token embedding and the head, each kept as stored: the lookup dequantizes only the rows it
    reads (`LlamaModel._embed`). Tied (no output.weight), the head's one copy serves both (None)."""
    table_shape = (shape.vocab_size, shape.hidden_size)
    if not file.has("output.weight"):
        return None, backend.linear(file.projection(["token_embd.weight"], *table_shape))
    table = file.projection(["token_embd.weight"], *table_shape)
    embed_tokens = table if isinstance(table, torch.Tensor) else backend.linear(table)
    return embed_tokens, backend.linear(file.projection(["output.weight"], *table_shape))


def _layer_weights(file: GGUFTensors, shape: ModelShape, layer_idx: int, backend: kernels.Backend) -> LayerWeights:
    prefix, layout = f"blk.{layer_idx}.", file.layout
    qkv = [prefix + name for name in layout.qkv]
    hidden, intermediate = shape.hidden_size, shape.intermediate_size
    qkv_rows = shape.q_size + 2 * shape.kv_size

    def norm(name: str | None, width: int = hidden) -> torch.Tensor | None:
        return None if name is None else file.dense(f"{prefix}{name}.weight", (width,))

    return LayerWeights(
        attention_in_norm=norm(layout.attention_in_norm),
        attention_out_norm=norm(layout.attention_out_norm),
        mlp_in_norm=norm(layout.mlp_in_norm),
        mlp_out_norm=norm(layout.mlp_out_norm),
        q_norm=norm("attn_q_norm" if layout.qk_norm else None, shape.head_dim),
        k_norm=norm("attn_k_norm" if layout.qk_norm else None, shape.head_dim),
        qkv=backend.linear(file.projection([name + ".weight" for name in qkv], qkv_rows, hidden, shape),
                           file.bias([name + ".bias" for name in qkv], qkv_rows, shape) if shape.qkv_bias else None),
        o=backend.linear(file.projection([prefix + "attn_output.weight"], hidden, shape.q_size),
                         file.bias([prefix + "attn_output.bias"], hidden, shape) if shape.o_bias else None),
        gate_up=backend.linear(file.projection([f"{prefix}{name}.weight" for name in layout.gate_up],
                                               2 * intermediate, hidden)),
        down=backend.linear(file.projection([prefix + "ffn_down.weight"], hidden, intermediate)),
    )


@functools.lru_cache(maxsize=1)
def _header_reader(path: Path, mtime_ns: int, size: int) -> object:
    """gguf's reader of the file, parsed once per file version: the memory budget and the load both
    read its tensors, and each parse walks every metadata array (seconds for a large vocabulary).
    The arrays are dropped after: the reader holds a numpy view per element of each (the tokenizer's
    ~400k strings for Llama 3: ~350 MB of objects) for as long as it lives, and it lives through the
    weights' load; only scalar keys are read here (the tokenizer is transformers' to read)."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(path)
    for key in [key for key, field in reader.fields.items() if field.types[:1] == [GGUFValueType.ARRAY]]:
        del reader.fields[key]
    return reader


class GGUFTensors:
    """The tensors of one GGUF file, each checked against its type and the shape the model needs."""

    def __init__(self, path: Path, dtype: torch.dtype, device: str) -> None:
        self.path, self.dtype, self.device = path, dtype, device
        try:
            self._reader = _header_reader(*_file_version(path))
        except (ValueError, OSError, IndexError, KeyError, TypeError) as error:
            raise ValidationError("model", f"{path}: not a readable GGUF file (truncated or corrupt?): "
                                           f"{error}") from None
        self.architecture = self._string("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise ValidationError("model", f"{path}: general.architecture {self.architecture!r} is not supported; "
                                           f"supported: {sorted(ARCHITECTURES)}")
        self.layout = ARCHITECTURES[self.architecture]
        self._tensors = {tensor.name: tensor for tensor in self._reader.tensors}
        self._check_extents()
        self.widened: Counter[str] = Counter()

    def _check_extents(self) -> None:
        """Each tensor's bytes, as its type and shape size them, end before the next tensor's start (or
        the file's end): the reader slices them by type and shape alone, so a header whose type or
        shape disagrees with the data laid out would hand a tensor its neighbour's bytes."""
        ordered = sorted(self._reader.tensors, key=lambda tensor: tensor.data_offset)
        ends = [tensor.data_offset for tensor in ordered[1:]] + [self.path.stat().st_size]
        for tensor, end in zip(ordered, ends):
            if tensor.data_offset + tensor.n_bytes > end:
                raise ValidationError("model", f"{self.path}: tensor {tensor.name} ({tensor.tensor_type.name}, "
                                               f"{tensor.n_elements} weights) needs {tensor.n_bytes} bytes, but the "
                                               f"file holds {end - tensor.data_offset} before the next tensor or its "
                                               f"end (a size that disagrees with its type and shape)")

    def check_read_fully(self, shape: ModelShape) -> None:
        """Refuse, naming the key or tensor, a file that asks for more than its config says
        (`gguf_architectures.unread_metadata`)."""
        reason = unread_metadata(self.architecture, self._metadata, set(self._tensors), shape.head_dim)
        if reason is not None:
            raise ValidationError("model", f"{self.path}: {reason}")

    def _metadata(self, key: str) -> object | None:
        field = self._reader.fields.get(key)
        return None if field is None else field.contents()

    def _string(self, key: str) -> str:
        field = self._reader.fields.get(key)
        if field is None:
            raise ValidationError("model", f"{self.path}: metadata key {key} is missing")
        return str(field.contents())

    def has(self, name: str) -> bool:
        return name in self._tensors

    @property
    def tensor_infos(self) -> list:
        """gguf's record of each tensor (name, type, element and byte counts); the data stay unread."""
        return list(self._tensors.values())

    def dense(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor `name` of `shape` in the model's dtype (quantized ones dequantized)."""
        weight = self._read(name, shape)
        if isinstance(weight, QuantizedTensor):
            weight = reference.dequantize(weight)
        return weight.to(device=self.device, dtype=self.dtype)

    def bias(self, names: list[str], rows: int, shape: ModelShape) -> torch.Tensor:
        parts = [self._unpermuted(name, self.dense(name, (projection_rows(name, shape),)), shape) for name in names]
        return self._fused_rows(names, torch.cat(parts), rows)

    def projection(self, names: list[str], rows: int, cols: int,
                   shape: ModelShape | None = None) -> QuantizedWeight | torch.Tensor:
        """The weights `names` stacked by rows into one `[rows, cols]` projection: kept in their block
        types where all are quantized, else dense in the model's dtype. `shape`: the model's, where
        q/k rows are to be un-permuted."""
        parts = [self._read(name, (projection_rows(name, shape) if shape else None, cols)) for name in names]
        if shape is not None:
            parts = [self._unpermuted(name, part, shape) for name, part in zip(names, parts)]
        if all(isinstance(part, QuantizedTensor) for part in parts):
            weight = QuantizedWeight.of(parts)
            return self._fused_rows(names, weight, rows, weight.shape[0])
        dense = [reference.dequantize(p) if isinstance(p, QuantizedTensor) else p for p in parts]
        stacked = torch.cat([part.to(self.dtype) for part in dense]).to(self.device)
        return self._fused_rows(names, stacked, rows)

    def _fused_rows(self, names: list[str], weight, rows: int, actual: int | None = None):
        actual = weight.shape[0] if actual is None else actual
        if actual != rows:
            raise ValidationError("model", f"{self.path}: {' + '.join(names)} have {actual} rows, expected {rows}")
        return weight

    def _unpermuted(self, name: str, weight: Weight, shape: ModelShape) -> Weight:
        """`weight`'s rows in HF's order, where llama.cpp's converter permuted them (whole rows, so
        whole block rows of a quantized one)."""
        num_rows = weight.shape[0] if isinstance(weight, torch.Tensor) else weight.rows
        order = rotary_unpermutation(self.layout, name, num_rows, shape)
        if order is None:
            return weight
        return weight.select_rows(order) if isinstance(weight, QuantizedTensor) else weight.index_select(0, order)

    def _read(self, name: str, shape: tuple[int | None, ...]) -> Weight:
        """One tensor copied out of the mapped file: dense as stored, or its blocks. `shape`: rows first
        (None: any number), as the model reads it (GGUF lists dimensions innermost first)."""
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ValidationError("model", f"{self.path}: tensor {name} is missing")
        stored = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        if len(stored) != len(shape) or any(want not in (None, got) for want, got in zip(shape, stored)):
            raise ValidationError("model", f"{self.path}: tensor {name} has shape {stored}, expected {shape}")
        type_name = tensor.tensor_type.name
        data = np.asarray(tensor.data)
        if type_name not in SUPPORTED_TYPES:
            return self._widened(name, tensor, data, stored)
        if type_name in DENSE_TYPES:
            return self._dense_copy(name, data, stored, DENSE_TYPES[type_name])
        return self._blocks_copy(name, data, stored, BLOCK_TYPES[type_name])

    def _widened(self, name: str, tensor, data: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor of a block type our kernels do not multiply (llama.cpp's Q4_K_M puts Q5_0 where rows
        are not whole 256-weight blocks), widened to the model's dtype by gguf's own dequantization;
        a type gguf cannot widen either is refused by name."""
        from gguf import quants

        type_name = tensor.tensor_type.name
        try:
            values = quants.dequantize(data, tensor.tensor_type)
        except NotImplementedError:
            raise ValidationError("model", f"{self.path}: tensor {name} is of type {type_name}, which is not "
                                           f"supported; supported types: {', '.join(SUPPORTED_TYPES)}") from None
        self.widened[type_name] += 1
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape).to(self.dtype)

    def warn_widened(self) -> None:
        """One warning per file for the tensors `_widened` took out of their block types."""
        if self.widened:
            counts = ", ".join(f"{count} of {type_name}" for type_name, count in sorted(self.widened.items()))
            logger.warning("%s: tensors of types without a compiled kernel were widened to %s: %s "
                           "(kept in their blocks: %s)", self.path, self.dtype, counts, ", ".join(BLOCK_TYPES))

    def _dense_copy(self, name: str, data: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        expected = int(np.prod(shape)) * dtype.itemsize
        self._check_size(name, data.nbytes, expected)
        raw = torch.from_numpy(np.array(data.reshape(-1).view(np.uint8)))
        return raw.view(dtype).reshape(shape)

    def _blocks_copy(self, name: str, data: np.ndarray, shape: tuple[int, ...], block) -> QuantizedTensor:
        rows, cols = (1, *shape)[-2:]
        if cols % block.block_elements:
            raise ValidationError("model", f"{self.path}: tensor {name} ({block.name}) has rows of {cols} weights, "
                                           f"not whole blocks of {block.block_elements}")
        self._check_size(name, data.nbytes, rows * cols // block.block_elements * block.block_bytes)
        raw = torch.from_numpy(np.array(data.reshape(-1).view(np.uint8)))
        return QuantizedTensor(block, raw.view(rows, -1), cols)

    def _check_size(self, name: str, actual: int, expected: int) -> None:
        if actual != expected:
            raise ValidationError("model", f"{self.path}: tensor {name} holds {actual} bytes where its type and "
                                           f"shape need {expected} (truncated or corrupt file?)")
