"""The one safetensors header reader (lora_runtime/safetensors_header.py) against files safetensors
itself writes: each tensor's dtype, shape and bytes where the header says; the data's bounds checked
for the checkpoint and tolerated for the memory budget (headers only); bad headers refused by name
in the budget as in the loader."""
from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lora_runtime.checkpoint import _DTYPES
from lora_runtime.errors import ValidationError
from lora_runtime.memory_budget import checkpoint_weights_bytes
from lora_runtime.safetensors_header import DTYPE_SIZES, read_safetensors_header

TENSORS = {"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
           "b.bias": torch.arange(5, dtype=torch.bfloat16),
           "c.ids": torch.tensor([[1, 2], [3, 4]], dtype=torch.int64),
           "d.empty": torch.zeros(0, 7, dtype=torch.float16)}
NAMES_IN_TORCH = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64", torch.float16: "F16"}


def test_each_tensor_is_where_its_header_says(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file(TENSORS, path, metadata={"format": "pt"})
    entries = read_safetensors_header(path)
    assert set(entries) == set(TENSORS)  # __metadata__ is not a tensor
    data = path.read_bytes()
    for name, tensor in TENSORS.items():
        entry = entries[name]
        assert (entry.dtype, entry.shape, entry.numel) == (NAMES_IN_TORCH[tensor.dtype], tuple(tensor.shape),
                                                           tensor.numel())
        stored = data[entry.offset:entry.offset + entry.num_bytes]
        assert stored == tensor.contiguous().view(torch.uint8).numpy().tobytes(), name


def test_the_data_is_checked_against_the_file_unless_only_headers_are_read(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file(TENSORS, path)
    whole = path.read_bytes()
    path.write_bytes(whole[:8 + int.from_bytes(whole[:8], "little")])  # the header alone
    numels = {name: entry.numel for name, entry in read_safetensors_header(path, data_in_file=False).items()}
    assert numels == {name: tensor.numel() for name, tensor in TENSORS.items()}
    with pytest.raises(ValidationError, match="model.safetensors: data_offsets .* within the file"):
        read_safetensors_header(path)


def test_the_checkpoint_knows_every_dtype_the_header_accepts_at_its_size() -> None:
    assert {name: dtype.itemsize for name, dtype in _DTYPES.items()} == DTYPE_SIZES


def _write_raw(path: Path, header: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header)


@pytest.mark.parametrize("header,named", [
    (b"not json", "header is not JSON"),
    (b"[1, 2]", "header is not a JSON object"),
    (b'{"w": {"dtype": "BF16", "shape": [4]}}', "malformed"),
    (b'{"w": {"dtype": ["BF16"], "shape": [4], "data_offsets": [0, 8]}}', "malformed"),
    (b'{"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0.0, 8.0]}}', "malformed"),
    (b'{"w": {"dtype": "C64", "shape": [4], "data_offsets": [0, 32]}}', "'C64'"),
    (b'{"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 6]}}', "data_offsets"),
])
def test_the_budget_refuses_a_bad_header_naming_the_file(tmp_path: Path, header: bytes, named: str) -> None:
    """Before, the budget read headers with a reader of its own that let the json, struct or key
    errors out raw (or counted what the loader then refused)."""
    _write_raw(tmp_path / "extra.safetensors", header)
    with pytest.raises(ValidationError) as refused:
        checkpoint_weights_bytes(tmp_path, "float32")
    assert "extra.safetensors" in str(refused.value) and named in str(refused.value)
