"""The local adapter store shared by all sources: atomic, deduplicated, bounded downloads.

A source fetches into a fresh staging directory under `<root>/.staging`; the store checks what
arrived (only expected file names, bounded count and bytes) and renames the directory into place,
so a reader sees a complete adapter or nothing. Concurrent requests for one key wait on a per-key
lock and the first one downloads; the others find the finished directory.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from lora_runtime.adapter_files import ADAPTER_CONFIG_FILE, ADAPTER_FILES, WEIGHT_FILES
from lora_runtime.adapters.sources.ids import is_store_key_part
from lora_runtime.errors import AdapterInvalidError

logger = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class DownloadLimits:
    max_total_bytes: int = 2 * 1024**3
    max_files: int = len(ADAPTER_FILES)


@dataclass(frozen=True, slots=True)
class RemoteFile:
    name: str
    size_bytes: int


def select_adapter_files(files: Iterable[RemoteFile], limits: DownloadLimits, adapter_id: str) -> list[RemoteFile]:
    """The expected adapter files among a remote listing, checked against the limits before download.

    Raises:
        AdapterInvalidError: no `adapter_config.json` or no weights, or over the size / count limits.
    """
    chosen = [f for f in files if f.name in ADAPTER_FILES]
    names = {f.name for f in chosen}
    if ADAPTER_CONFIG_FILE not in names or not names.intersection(WEIGHT_FILES):
        raise AdapterInvalidError(f"adapter {adapter_id!r} has no {ADAPTER_CONFIG_FILE} and adapter weights")
    check_limits(sum(f.size_bytes for f in chosen), len(chosen), limits, adapter_id)
    return chosen


def check_limits(total_bytes: int, num_files: int, limits: DownloadLimits, adapter_id: str) -> None:
    if num_files > limits.max_files:
        raise AdapterInvalidError(f"adapter {adapter_id!r} has more than {limits.max_files} files")
    if total_bytes > limits.max_total_bytes:
        raise AdapterInvalidError(f"adapter {adapter_id!r} is larger than {limits.max_total_bytes} bytes")


class AdapterStore:
    """Owns the directory `root` holding one subdirectory per downloaded adapter key."""

    def __init__(self, root: Path, limits: DownloadLimits = DownloadLimits()) -> None:
        self.root = root.resolve()
        self.limits = limits
        self._staging = self.root / ".staging"
        self._staging.mkdir(parents=True, exist_ok=True)
        self._locks: dict[tuple[str, ...], threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def path_for(self, key: tuple[str, ...]) -> Path:
        """The directory of `key`; every part is validated so the path stays under the root."""
        assert key, "a store key has at least one part"
        if not all(is_store_key_part(part) for part in key):
            raise AdapterInvalidError("adapter id has characters the store does not accept")
        path = self.root.joinpath(*key)
        assert path.resolve().is_relative_to(self.root), "validated key parts cannot leave the root"
        return path

    def fetch(self, key: tuple[str, ...], adapter_id: str, fill: Callable[[Path], None]) -> Path:
        """The directory of `key`, calling `fill(staging_dir)` once to download it when missing.

        `fill` writes the adapter's files flat into `staging_dir`; errors it raises pass through.
        """
        final = self.path_for(key)
        if final.is_dir():
            return final
        with self._lock_for(key):
            if final.is_dir():
                return final
            staging = Path(tempfile.mkdtemp(dir=self._staging))
            try:
                fill(staging)
                self._check_staged(staging, adapter_id)
                self._publish(staging, final)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        return final

    def _lock_for(self, key: tuple[str, ...]) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())

    def _check_staged(self, staging: Path, adapter_id: str) -> None:
        entries = list(staging.iterdir())
        unexpected = [e.name for e in entries if e.name not in ADAPTER_FILES or not e.is_file() or e.is_symlink()]
        if unexpected:
            raise AdapterInvalidError(f"adapter {adapter_id!r} has unexpected files: {sorted(unexpected)[:5]}")
        check_limits(sum(e.stat().st_size for e in entries), len(entries), self.limits, adapter_id)

    def _publish(self, staging: Path, final: Path) -> None:
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(staging, final)
        except OSError:
            # Another process published the same key first; its copy is as good as ours.
            if not final.is_dir():
                raise
            logger.debug("store key %s was published concurrently", final.name)
