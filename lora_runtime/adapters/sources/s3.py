"""Adapters from S3 (or an S3-compatible store): `s3://bucket/prefix` holds one adapter's files.

Credentials come from the standard AWS configuration chain (environment, shared files, instance
roles); the endpoint URL, when not AWS itself, only from the operator. The prefix is listed with a
trailing `/` and a `/` delimiter, so `a/1` never picks up `a/10` or anything nested below `a/1/x/`.
Stored copies are keyed by the listing (names, sizes, ETags): a changed adapter is fetched again.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import botocore.loaders
import botocore.session
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from lora_runtime.adapters.refs import AdapterRef, Caller
from lora_runtime.adapter_files import copy_bounded
from lora_runtime.adapters.sources.download import AdapterStore, RemoteFile, select_adapter_files
from lora_runtime.adapters.sources.ids import S3Id
from lora_runtime.errors import (
    AdapterAccessError,
    AdapterInvalidError,
    AdapterNotFoundError,
    AdapterUnavailableError,
    EngineError,
)

logger = logging.getLogger(__name__)

_ACCESS_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "ExpiredToken"}
_NOT_FOUND_CODES = {"NoSuchBucket", "NoSuchKey", "404"}


@dataclass(frozen=True, slots=True)
class S3Config:
    endpoint_url: str | None = None  # None: AWS itself; otherwise an S3-compatible server
    region: str | None = None
    path_style: bool = False  # most S3-compatible servers need path-style addressing
    timeout_s: float = 30.0


def make_s3_client(config: S3Config) -> Any:
    """A boto3 S3 client with credentials from the standard AWS configuration chain."""
    options = Config(
        connect_timeout=config.timeout_s,
        read_timeout=config.timeout_s,
        retries={"max_attempts": 2},
        signature_version="s3v4",  # presigned URLs too: AWS retired the older signature
        s3={"addressing_style": "path" if config.path_style else "auto"},
    )
    botocore_session = botocore.session.get_session()
    botocore_session.register_component("data_loader", _shared_loader())
    return boto3.session.Session(botocore_session=botocore_session).client(
        "s3", endpoint_url=config.endpoint_url, region_name=config.region, config=options
    )


@functools.cache
def _shared_loader() -> botocore.loaders.Loader:
    """One loader per process: parsing botocore's service models again for every client costs ~0.3 s."""
    return botocore.loaders.create_loader()


class S3Source:
    """The `s3` `AdapterSource`: `s3://bucket/prefix` references, read with the server's own
    credentials (a caller's `api_token` is a hub token and never sent to S3)."""

    def __init__(self, config: S3Config, store: AdapterStore) -> None:
        self.store = store
        self._client = make_s3_client(config)

    def resolve(self, ref: AdapterRef, caller: Caller) -> Path:
        """Local directory holding the adapter's files; the same for every caller.

        Raises:
            AdapterNotFoundError / AdapterAccessError / AdapterInvalidError / AdapterUnavailableError.
        """
        assert ref.source == "s3", ref
        bucket, _, prefix = ref.name.partition("/")  # `name` is "bucket/prefix", the prefix without a trailing "/"
        s3_id = S3Id(bucket, prefix)
        try:
            listing = self._list(s3_id)
            files = select_adapter_files([remote for remote, _ in listing], self.store.limits, ref.adapter_id)
            key = ("s3", s3_id.bucket, _fingerprint(s3_id, listing))
            return self.store.fetch(key, ref.adapter_id, lambda staging: self._download(s3_id, files, staging))
        except (ClientError, BotoCoreError, OSError) as error:
            logger.warning("s3 fetch of %r failed: %s", ref.adapter_id, error)
            raise _typed_error(error, ref.adapter_id) from None

    def _list(self, s3_id: S3Id) -> list[tuple[RemoteFile, str]]:
        """The objects directly under `prefix/`, each with its ETag."""
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=s3_id.bucket, Prefix=f"{s3_id.prefix}/", Delimiter="/", PaginationConfig={"MaxItems": 1000}
        )
        listing = [
            (RemoteFile(obj["Key"][len(s3_id.prefix) + 1 :], int(obj["Size"])), str(obj.get("ETag", "")))
            for page in pages
            for obj in page.get("Contents", [])
        ]
        if not listing:
            raise AdapterNotFoundError(f"no adapter at s3 id {s3_id.bucket}/{s3_id.prefix}")
        return listing

    def _download(self, s3_id: S3Id, files: list[RemoteFile], staging: Path) -> None:
        for remote in files:
            body = self._client.get_object(Bucket=s3_id.bucket, Key=f"{s3_id.prefix}/{remote.name}")["Body"]
            with open(staging / remote.name, "wb") as out:
                limit = self.store.limits.max_total_bytes
                copy_bounded(body, out, limit, lambda: AdapterInvalidError(
                    f"adapter file {remote.name} is larger than {limit} bytes"))


def _fingerprint(s3_id: S3Id, listing: list[tuple[RemoteFile, str]]) -> str:
    """A store key part that changes whenever the prefix or any listed object changes."""
    digest = hashlib.sha256(s3_id.prefix.encode())
    for remote, etag in sorted(listing, key=lambda item: item[0].name):
        digest.update(f"\n{remote.name}\0{remote.size_bytes}\0{etag}".encode())
    return digest.hexdigest()[:40]


def _typed_error(error: Exception, adapter_id: str) -> EngineError:
    """The docs/api.md section 3 error for an S3 failure; messages name the id, never keys or endpoints."""
    if isinstance(error, NoCredentialsError):
        return AdapterAccessError(f"the server has no S3 credentials to read adapter {adapter_id!r}")
    if isinstance(error, ClientError):
        code = str(error.response.get("Error", {}).get("Code", ""))
        if code in _ACCESS_CODES:
            return AdapterAccessError(f"S3 refused access to adapter {adapter_id!r}")
        if code in _NOT_FOUND_CODES:
            return AdapterNotFoundError(f"S3 adapter {adapter_id!r} not found")
    return AdapterUnavailableError(f"S3 unavailable while fetching adapter {adapter_id!r}")
