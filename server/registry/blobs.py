"""Where registry files live: a local directory by default, an S3 bucket when configured.

Keys are `/`-separated relative paths the registry builds itself from validated parts; a key is
checked again here so no key can leave the local root.
"""

from __future__ import annotations

import abc
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

from lora_runtime.adapter_files import copy_bounded
from lora_runtime.adapters.sources.s3 import S3Config, make_s3_client
from server.registry.errors import ByteBound

_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)*")


def check_key(key: str) -> str:
    assert _KEY.fullmatch(key) and ".." not in key and len(key) <= 512, (
        "registry blob keys are built from checked parts"
    )
    return key


def _copy_upload(source: BinaryIO, out: BinaryIO, bound: ByteBound) -> int:
    return copy_bounded(source, out, bound.max_bytes, bound.error)


class BlobStore(abc.ABC):
    @abc.abstractmethod
    def put_file(self, key: str, path: Path) -> None: ...

    @abc.abstractmethod
    def put_stream(self, key: str, stream: BinaryIO, bound: ByteBound) -> int:
        """Stores a stream (an upload body) within `bound` (refused as it passes it); returns its size."""

    @abc.abstractmethod
    def list(self, prefix: str) -> dict[str, int]:
        """Every key under `prefix/`, recursively, relative to it, with its size in bytes."""

    @abc.abstractmethod
    def child_names(self, prefix: str) -> set[str]:
        """The first path part of every key under `prefix/` (the upload ids under `uploads`), also
        of keys that a write in progress or an interrupted one left (they are disk too)."""

    @abc.abstractmethod
    def get_file(self, key: str, path: Path) -> None: ...

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> None: ...

    def presigned_put_url(self, key: str, ttl_s: int) -> str | None:
        """A URL that stores a PUT body at `key` without further credentials, or None when the
        server itself receives uploads (the caller then signs a URL to its own upload route)."""
        return None


class LocalBlobStore(BlobStore):
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        path = self.root / check_key(key)
        assert path.resolve().is_relative_to(self.root)
        return path

    def put_file(self, key: str, path: Path) -> None:
        with open(path, "rb") as source:
            size = path.stat().st_size
            self.put_stream(key, source, ByteBound(size, f"{key} grew past {size} bytes while stored"))

    def put_stream(self, key: str, stream: BinaryIO, bound: ByteBound) -> int:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        # Write aside then rename: a reader never sees half a file, a failed upload leaves nothing.
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".incoming-", delete=False) as out:
            try:
                size = _copy_upload(stream, out, bound)
            except BaseException:
                os.unlink(out.name)
                raise
        os.replace(out.name, target)
        return size

    def list(self, prefix: str) -> dict[str, int]:
        base = self._path(prefix)
        if not base.is_dir():
            return {}
        return {
            p.relative_to(base).as_posix(): p.stat().st_size
            for p in base.rglob("*")
            if p.is_file() and not p.name.startswith(".incoming-")
        }

    def child_names(self, prefix: str) -> set[str]:
        base = self._path(prefix)
        return {entry.name for entry in base.iterdir()} if base.is_dir() else set()

    def get_file(self, key: str, path: Path) -> None:
        shutil.copyfile(self._path(key), path)

    def delete_prefix(self, prefix: str) -> None:
        shutil.rmtree(self._path(prefix), ignore_errors=True)


class S3BlobStore(BlobStore):
    """Blobs under `key_prefix/` in one bucket; credentials from the standard AWS chain."""

    def __init__(self, config: S3Config, bucket: str, key_prefix: str = "registry") -> None:
        self.bucket = bucket
        self.key_prefix = check_key(key_prefix)
        self._client: Any = make_s3_client(config)

    def _key(self, key: str) -> str:
        return f"{self.key_prefix}/{check_key(key)}"

    def put_file(self, key: str, path: Path) -> None:
        self._client.upload_file(str(path), self.bucket, self._key(key))

    def put_stream(self, key: str, stream: BinaryIO, bound: ByteBound) -> int:
        with tempfile.TemporaryFile() as spool:
            size = _copy_upload(stream, spool, bound)
            spool.seek(0)
            self._client.upload_fileobj(spool, self.bucket, self._key(key))
        return size

    def list(self, prefix: str) -> dict[str, int]:
        full = f"{self._key(prefix)}/"
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full)
        return {obj["Key"][len(full) :]: int(obj["Size"]) for page in pages for obj in page.get("Contents", [])}

    def child_names(self, prefix: str) -> set[str]:
        full = f"{self._key(prefix)}/"
        paginator = self._client.get_paginator("list_objects_v2")
        pages = list(paginator.paginate(Bucket=self.bucket, Prefix=full, Delimiter="/"))
        folders = [common["Prefix"] for page in pages for common in page.get("CommonPrefixes", [])]
        names = {folder[len(full) :].rstrip("/") for folder in folders}
        return names | {obj["Key"][len(full) :] for page in pages for obj in page.get("Contents", [])}

    def get_file(self, key: str, path: Path) -> None:
        self._client.download_file(self.bucket, self._key(key), str(path))

    def delete_prefix(self, prefix: str) -> None:
        keys = [{"Key": f"{self._key(prefix)}/{name}"} for name in self.list(prefix)]
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys[start : start + 1000]})

    def presigned_put_url(self, key: str, ttl_s: int) -> str | None:
        return self._client.generate_presigned_url(
            "put_object", Params={"Bucket": self.bucket, "Key": self._key(key)}, ExpiresIn=ttl_s
        )
