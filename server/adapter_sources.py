"""The engine's adapter sources, built from the operator's configuration (docs/api.md section 3).

Each source is an `AdapterSource`: `resolve(ref, caller) -> local PEFT directory`. `pbase` reads this
server's registry in the caller's tenant (`caller.scope`); `hub` asks the hub endpoint the operator
configured (none configured: 424 adapter_unavailable), with the caller's `api_token` only; `s3` reads
with the server's standard AWS credentials; `local` exists only with an adapter directory, and its ids
are relative to it. All downloads share one store under the data directory. Also the registry
services of the routes (`adapter_services`), on the same blobs as the `pbase` source.
"""
from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from pathlib import Path

from lora_runtime.api import (AdapterRef, AdapterRequest, AdapterSource, AdapterUnavailableError, Caller,
                              EngineInfo, LocalSource, MergedAdapters, ValidationError)
from lora_runtime.adapters.peft_format import load_peft_adapter
from lora_runtime.adapters.sources.download import AdapterStore
from lora_runtime.adapters.sources.s3 import S3Config
from server.config import ServerConfig
from server.db import Database
from server.registry.blobs import BlobStore, LocalBlobStore, S3BlobStore
from server.registry.models import RegistryBase
from server.registry.service import AdapterRegistry
from server.registry.signing import UrlSigner
from server.registry.source import PbaseResolver, version_to_serve
from server.registry.upload_bounds import StagingLedger, weights_max_bytes
from server.registry.uploads import UploadConfig, UploadService


def s3_config(config: ServerConfig) -> S3Config:
    # S3-compatible servers other than AWS need path-style addressing; AWS itself takes either.
    return S3Config(endpoint_url=config.s3_endpoint, region=config.s3_region,
                    path_style=config.s3_endpoint is not None)


def adapter_store(config: ServerConfig) -> AdapterStore:
    """The download store every source fills: `data_dir/adapters`."""
    return AdapterStore(config.data_dir / "adapters")


def registry_blobs(config: ServerConfig) -> BlobStore:
    """The registry's blobs: `data_dir/blobs`, or the configured bucket."""
    if config.registry_bucket:
        return S3BlobStore(s3_config(config), config.registry_bucket)
    return LocalBlobStore(config.data_dir / "blobs")


def build_adapter_sources(config: ServerConfig, pbase: PbaseResolver,
                          store: AdapterStore) -> dict[str, AdapterSource]:
    """The sources to pass as `Engine.from_config(..., adapter_sources=...)`."""
    return {
        "pbase": pbase,
        "hub": _hub_source(config, store),
        "s3": _s3_source(config, store),
        "local": DisabledLocalSource() if config.adapter_dir is None else LocalSource(config.adapter_dir),
    }


class UnconfiguredHubSource:
    """The `hub` source of a server started without `--hub-endpoint`: every hub id is unavailable."""

    def resolve(self, ref: AdapterRef, caller: Caller) -> Path:
        raise AdapterUnavailableError(
            f"hub adapter {ref.adapter_id!r} is unavailable: this server has no hub endpoint "
            "configured (the operator starts it with --hub-endpoint)")


class DisabledLocalSource:
    """The `local` source of a server started without an adapter directory: refused as input."""

    def resolve(self, ref: AdapterRef, caller: Caller) -> Path:
        raise ValidationError("adapter_source", "local adapters are not enabled on this server")


def _hub_source(config: ServerConfig, store: AdapterStore) -> AdapterSource:
    if config.hub_endpoint is None:
        return UnconfiguredHubSource()
    from lora_runtime.adapters.sources.hub import HubConfig, HubSource

    return HubSource(HubConfig(config.hub_endpoint), store)


def _s3_source(config: ServerConfig, store: AdapterStore) -> AdapterSource:
    from lora_runtime.adapters.sources.s3 import S3Source

    return S3Source(s3_config(config), store)


def engine_adapter_sources(config: ServerConfig, database: Database) -> dict[str, AdapterSource]:
    """The sources of the server's engine: the registry of `database` for `pbase`, the rest from
    `config`. Same blob location as `adapter_services`, which the app builds."""
    store = adapter_store(config)
    return build_adapter_sources(config, PbaseResolver(database.sessions, registry_blobs(config), store), store)


@dataclass(frozen=True, slots=True)
class AdapterServices:
    """The registry behind the `/v2/repos` and upload routes, validating uploads with the engine's
    own adapter loader, and the secret that signs upload URLs (new each start: URLs live an hour)."""

    registry: AdapterRegistry
    signer: UrlSigner
    weights_max_bytes: int  # of one uploaded weights file: the served model's (upload_bounds.weights_max_bytes)
    staging: StagingLedger = dataclasses.field(default_factory=StagingLedger)  # PUTs in flight, server-wide

    def with_current_versions(self, request: AdapterRequest | None) -> AdapterRequest | None:
        """`request` keyed by the blob ids of the pbase versions it names, read now: a deleted or
        archived version is not found even while its weights are cached, and a repo deleted and
        created again never serves the old weights under the same `repo/N`. Blocks (database)."""
        if request is None:
            return None
        blob_ids = [self._blob_id(request.caller.scope, ref) for ref in _pbase_refs(request)]
        return dataclasses.replace(request, version_key=",".join(blob_ids)) if blob_ids else request

    def _blob_id(self, tenant: str, ref: AdapterRef) -> str:
        version, _ = version_to_serve(self.registry.sessions, tenant, ref)
        return version.blob_id

    def uploads(self, config: ServerConfig, base_url: str) -> UploadService:
        """The upload service, its URLs starting with `config.public_url`, else `base_url`."""
        upload_config = UploadConfig(public_base_url=config.public_url or base_url,
                                     url_ttl_s=config.upload_url_ttl_s,
                                     max_upload_bytes=config.max_upload_bytes,
                                     max_upload_files=config.max_upload_files,
                                     max_open_uploads=config.max_open_uploads,
                                     max_staged_upload_bytes=config.max_staged_upload_bytes,
                                     weights_max_bytes=self.weights_max_bytes)
        return UploadService(self.registry, self.signer, upload_config, self.staging)


def _pbase_refs(request: AdapterRequest) -> list[AdapterRef]:
    """The pbase references a request names: the adapter itself, or those of a merge's parts."""
    refs = request.parts if isinstance(request.adapter, MergedAdapters) else (request.adapter,)
    return [ref for ref in refs if ref.source == "pbase"]


def adapter_services(config: ServerConfig, database: Database, engine: EngineInfo) -> AdapterServices:
    RegistryBase.metadata.create_all(database.engine)  # a no-op once the tables exist

    def validate(directory: Path) -> None:
        load_peft_adapter(directory, engine.adapter_shape, engine.adapter_limits)

    registry = AdapterRegistry(database.sessions, registry_blobs(config), validate, config.max_upload_checkpoints)
    return AdapterServices(registry, UrlSigner(secrets.token_bytes(32)),
                           weights_max_bytes(engine.adapter_shape, engine.adapter_limits))
