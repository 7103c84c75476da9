"""One safetensors file's header, read and checked without torch: the one reader of the format's
header, shared by the checkpoint (checkpoint.py, which then reads the tensors it locates) and the CPU
memory budget (memory_budget.py, which counts the weights' bytes before any weight is read).

The format (github.com/huggingface/safetensors, "Format"): an 8-byte little-endian header length,
a JSON header naming each tensor's dtype, shape and `data_offsets` (from the end of the header),
then the data."""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_runtime.errors import ValidationError

# Largest header we accept (the format's own readers refuse past 100 MB).
MAX_HEADER_BYTES = 100 * 2**20
# The format's dtype names we serve -> bytes per element (checkpoint.py maps the same names to torch's).
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    """One tensor as its file's header describes it: `num_bytes` at `offset` (from the file's start)."""

    dtype: str  # the format's name, a key of DTYPE_SIZES
    shape: tuple[int, ...]
    offset: int
    num_bytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_safetensors_header(path: Path, *, data_in_file: bool = True) -> dict[str, HeaderEntry]:
    """Each tensor of one safetensors file, checked: a dtype of DTYPE_SIZES, a shape of whole numbers,
    `data_offsets` spanning exactly the shape's bytes and, with `data_in_file`, lying within the file.
    Raises ValidationError("model") naming the file (and the tensor) otherwise.

    `data_in_file=False` tolerates a file whose data is truncated or absent (the header alone): for
    the memory budget, which reads headers only and refuses a model that does not fit before any
    weight is read (its test gives it headers only); the checkpoint's reads check the data."""
    size = path.stat().st_size
    with path.open("rb") as file:
        prefix = file.read(8)
        header_bytes = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        if not 0 < header_bytes <= min(MAX_HEADER_BYTES, size - 8):
            raise ValidationError("model", f"{path.name} is not a safetensors file (header length)")
        try:
            header = json.loads(file.read(header_bytes))
        except ValueError:
            raise ValidationError("model", f"{path.name} is not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValidationError("model", f"{path.name} is not a safetensors file (header is not a JSON object)")
    data_start, data_end = 8 + header_bytes, size if data_in_file else None
    return {name: _entry(path, name, fields, data_start, data_end)
            for name, fields in header.items() if name != "__metadata__"}


def _entry(path: Path, name: str, fields: Any, data_start: int, data_end: int | None) -> HeaderEntry:
    try:
        dtype, shape, (begin, end) = fields["dtype"], tuple(fields["shape"]), fields["data_offsets"]
        well_formed = isinstance(dtype, str) and all(type(number) is int for number in (*shape, begin, end))
        well_formed = well_formed and all(length >= 0 for length in shape)
    except (KeyError, TypeError, ValueError):
        well_formed = False
    if not well_formed:
        raise ValidationError("model", f"weight {name} in {path.name} has a malformed header entry")
    if dtype not in DTYPE_SIZES:
        raise ValidationError("model", f"weight {name} in {path.name} has dtype {dtype!r}, "
                                       f"not one of {sorted(DTYPE_SIZES)}")
    num_bytes = end - begin
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    beyond_the_file = data_end is not None and data_start + end > data_end
    if begin < 0 or num_bytes != expected or beyond_the_file:
        raise ValidationError("model", f"weight {name} in {path.name}: data_offsets {[begin, end]} do not hold "
                                       f"{expected} bytes of {shape} within the file")
    return HeaderEntry(dtype, shape, data_start + begin, num_bytes)
