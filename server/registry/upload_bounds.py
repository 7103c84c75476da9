"""How much one upload may stage: each file by what an adapter file can be, each upload by its
files and bytes, each tenant by its open uploads and staged bytes. The server's own upload route
checks a PUT against the smallest of these while the body streams in (413 naming it); bytes of PUTs
still arriving are reserved here, so concurrent PUTs cannot together pass a bound.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

from lora_runtime.adapter_files import ADAPTER_CONFIG_FILE, WEIGHT_FILES
from lora_runtime.api import AdapterLimits, BaseModelShape
from server.registry.errors import ByteBound

# PEFT writes about 1 KB; a `target_modules` list naming every module of an 80-layer model is ~25 KB.
CONFIG_MAX_BYTES = 64 * 1024
# Tokenizer files and chat templates: `tokenizer.json` of a 128k-token vocabulary is ~9 MB, of a
# 256k one ~34 MB.
TOKENIZER_FILE_MAX_BYTES = 48 * 1024**2
_WIDEST_DTYPE_BYTES = 4  # float32: the widest dtype the adapter loader accepts
# Container bytes around the tensors: a safetensors header entry or a torch zip record per tensor.
_TENSOR_OVERHEAD_BYTES = 4096
_FILE_OVERHEAD_BYTES = 64 * 1024


def weights_max_bytes(shape: BaseModelShape, limits: AdapterLimits) -> int:
    """The largest weights file of an adapter the loader can accept for `shape`: both factors of
    every module of every layer at `limits.max_rank` in float32 (no more than `limits.max_bytes`,
    which the loader refuses past), plus the container's bytes."""
    per_layer = sum(limits.max_rank * (in_features + out_features)
                    for in_features, out_features in shape.module_shapes.values())
    tensor_bytes = min(per_layer * shape.num_layers * _WIDEST_DTYPE_BYTES, limits.max_bytes)
    num_tensors = 2 * len(shape.module_shapes) * shape.num_layers
    return tensor_bytes + num_tensors * _TENSOR_OVERHEAD_BYTES + _FILE_OVERHEAD_BYTES


def file_bound(name: str, weights_bytes: int) -> ByteBound:
    """What the upload file `name` (`checkpoint-<N>/` included) can be, by its kind."""
    base_name = name.rsplit("/", 1)[-1]
    if base_name == ADAPTER_CONFIG_FILE:
        return ByteBound(CONFIG_MAX_BYTES, f"{name}: an adapter config holds at most {CONFIG_MAX_BYTES} bytes")
    if base_name in WEIGHT_FILES:
        return ByteBound(weights_bytes, f"{name}: adapter weights of this server's base model at its "
                                        f"largest rank in float32 take at most {weights_bytes} bytes")
    return ByteBound(TOKENIZER_FILE_MAX_BYTES,
                     f"{name}: a tokenizer or chat template file holds at most {TOKENIZER_FILE_MAX_BYTES} bytes")


def remaining_bound(limit_bytes: int, used_bytes: int, refusal: str) -> ByteBound:
    """What is left of a bound of `limit_bytes` of which `used_bytes` are taken."""
    left = max(0, limit_bytes - used_bytes)
    return ByteBound(left, f"{refusal} hold at most {limit_bytes} bytes, {used_bytes} of them taken")


def tightest(bounds: list[ByteBound]) -> ByteBound:
    return min(bounds, key=lambda bound: bound.max_bytes)


@dataclass(frozen=True, slots=True)
class Reservation:
    tenant_id: str
    upload_id: str
    num_bytes: int


class StagingLedger:
    """The bytes reserved by PUTs in progress, per tenant and per upload, in this process; and the
    lock under which a PUT reads what is staged and reserves its share (one at a time per server).
    Also serializes counting a tenant's open uploads with opening one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._reservations: list[Reservation] = []

    def reserved(self, tenant_id: str, upload_id: str | None = None) -> int:
        """Bytes in flight for `tenant_id` (only those of `upload_id`, when given). Hold `lock`."""
        return sum(r.num_bytes for r in self._reservations
                   if r.tenant_id == tenant_id and upload_id in (None, r.upload_id))

    def reserve(self, reservation: Reservation) -> Reservation:
        """Hold `lock`."""
        self._reservations.append(reservation)
        return reservation

    def release(self, reservation: Reservation) -> None:
        with self.lock:
            self._reservations.remove(reservation)


def staged_bytes(listing: Mapping[str, int], except_name: str | None = None) -> int:
    """The bytes of an upload's staged files, not counting `except_name` (a PUT replaces it)."""
    return sum(size for name, size in listing.items() if name != except_name)
