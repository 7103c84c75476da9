"""The files of a PEFT adapter directory, by name, and copies bounded in bytes: shared by the
adapter sources, the registry's uploads and the client library, which imports without torch."""
from __future__ import annotations

from collections.abc import Callable
from typing import BinaryIO

ADAPTER_CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"
WEIGHT_FILES = (SAFETENSORS_FILE, BIN_FILE)
# Files an adapter may ship besides its config and weights: its tokenizer and chat template.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
ADAPTER_FILES = frozenset((ADAPTER_CONFIG_FILE, *WEIGHT_FILES, *TOKENIZER_FILES))

_COPY_CHUNK_BYTES = 1 << 20


def copy_bounded(source: BinaryIO, out: BinaryIO, max_bytes: int, too_large: Callable[[], Exception]) -> int:
    """Copy `source` into `out` in chunks; raise `too_large()` as soon as more than `max_bytes`
    arrive, so an oversized body is never read whole. Returns the bytes copied."""
    copied = 0
    while chunk := source.read(_COPY_CHUNK_BYTES):
        copied += len(chunk)
        if copied > max_bytes:
            raise too_large()
        out.write(chunk)
    return copied
