"""A directory's safetensors checkpoint, read a tensor at a time with plain file reads.

Not through safetensors' own `safe_open`: its tensors are views of a copy-on-write map of the file,
so the pages read stay in the process (RSS) while any tensor of the file lives, and the model keeps
its embedding: on a model of Llama-3.2-1B's shape two layers' checkpoint (730 MiB) stayed resident
beside the packed weights. Here each tensor is read straight into memory the model owns, and the
page cache its reads filled is released after each tensor (`posix_fadvise(DONTNEED)`): a 16 GB
checkpoint loads in the weights' memory plus one tensor in flight.

Each file's header is read and checked by safetensors_header.py. Sharded checkpoints name their
files in `model.safetensors.index.json`."""
from __future__ import annotations

import json
import logging
import mmap
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from lora_runtime.errors import ValidationError
from lora_runtime.safetensors_header import read_safetensors_header

LOG = logging.getLogger(__name__)
INDEX_FILE = "model.safetensors.index.json"
_OWN_MAPPING_MIN_BYTES = 2**20
# The header's dtype names (safetensors_header.DTYPE_SIZES) -> torch's.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor's bytes lie: `num_bytes` at `offset` (from the file's start) of `file`."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    num_bytes: int


class Checkpoint:
    """The tensors of a model directory's safetensors files (the shards its index names, else every
    `*.safetensors`), each read on request into a tensor the caller owns. A context manager: the
    files stay open until it exits."""

    def __init__(self, model_dir: Path) -> None:
        self.files = checkpoint_files(model_dir)
        self.entries = {name: entry for path in self.files for name, entry in read_header(path).items()}
        self._fds: dict[Path, int] = {}
        self.progress = _progress_bar(sum(entry.num_bytes for entry in self.entries.values()), model_dir.name)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.progress.update(self.progress.total - self.progress.n)  # tensors the model does not read
        self.progress.close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def file_names(self) -> str:
        return ", ".join(path.name for path in self.files)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Tensor `name`'s bytes into `out` (contiguous, on the CPU, of the tensor's dtype and size)."""
        entry = self.entries[name]
        assert out.is_contiguous() and out.device.type == "cpu" and out.dtype == entry.dtype
        assert out.numel() * out.element_size() == entry.num_bytes
        fd = self._fds.get(entry.file)
        if fd is None:
            fd = self._fds[entry.file] = os.open(entry.file, os.O_RDONLY)
        _read_fully(fd, entry, out)
        # The pages just read are not needed again: release them (a no-op on file systems that ignore it).
        os.posix_fadvise(fd, entry.offset, entry.num_bytes, os.POSIX_FADV_DONTNEED)
        self.progress.update(entry.num_bytes)

    def read(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        out = empty_buffer(entry.shape, entry.dtype)
        self.read_into(name, out)
        return out


def empty_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty on the CPU; from 1 MiB up, in an anonymous mapping of its own, returned to the system
    when the tensor is freed. The read buffers a load frees (each weight before its backend's layout)
    would otherwise stay in the process: glibc keeps freed chunks under its mmap threshold (which rises
    to 32 MiB as large chunks are freed) in its heap, and loading Llama-3.2-1B's shape left 178 MiB of
    them resident."""
    num_bytes = torch.Size(shape).numel() * dtype.itemsize
    if num_bytes < _OWN_MAPPING_MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    mapping = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps the mapping


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The files of the checkpoint: those its index maps tensors to, or every `*.safetensors`."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            raise ValidationError("model", f"{INDEX_FILE} has no readable weight_map ({error})") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            raise ValidationError("model", f"{INDEX_FILE} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValidationError("model", f"no .safetensors weights in {model_dir.name}")
    return files


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Each tensor of one safetensors file, checked against the file's size."""
    return {name: TensorEntry(path, _DTYPES[entry.dtype], entry.shape, entry.offset, entry.num_bytes)
            for name, entry in read_safetensors_header(path).items()}


def _read_fully(fd: int, entry: TensorEntry, out: torch.Tensor) -> None:
    """Reads the entry's bytes into out's memory (a read may return less than asked: 2 GiB at most on Linux)."""
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < entry.num_bytes:
        count = os.preadv(fd, [view[done:]], entry.offset + done)
        if count == 0:
            raise ValidationError("model", f"{entry.file.name} ends inside a tensor (truncated)")
        done += count


def _progress_bar(total_bytes: int, label: str) -> tqdm:
    """A bar of bytes read, on stderr, shown where a person watches (a terminal) or where logging asks
    for detail (DEBUG); never in logs or captured test output otherwise."""
    shown = sys.stderr.isatty() or LOG.isEnabledFor(logging.DEBUG)
    return tqdm(total=total_bytes, desc=f"loading {label}", unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, disable=not shown, leave=False)
