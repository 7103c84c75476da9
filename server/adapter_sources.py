"""The engine's adapter sources, built from the operator's configuration (docs/api.md section 3).

Each source is a `SourceResolver` `(ref, api_token, scope) -> local PEFT directory`; the scope is the
caller's tenant. `pbase` reads this server's registry in that tenant; `hub` asks the hub endpoint the
operator configured (none configured: 424 adapter_unavailable), with the caller's `api_token` only;
`s3` reads with the server's standard AWS credentials; `local` exists only with an adapter directory,
and its ids are relative to it. All downloads share one store under the data directory. Also the
registry services of the routes (`adapter_services`), on the same blobs as the `pbase` source.
"""
from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from pathlib import Path

from lora_runtime import Engine
from lora_runtime.adapters.manager import AdapterRequest, SourceResolver
from lora_runtime.adapters.merge import MergedAdapters
from lora_runtime.adapters.peft_format import load_peft_adapter
from lora_runtime.adapters.refs import AdapterRef, LocalSource
from lora_runtime.adapters.sources.download import AdapterStore
from lora_runtime.adapters.sources.ids import infer_source
from lora_runtime.adapters.sources.s3 import S3Config
from lora_runtime.errors import AdapterUnavailableError, ValidationError
from server.config import ServerConfig
from server.db import Database
from server.registry.blobs import BlobStore, LocalBlobStore, S3BlobStore
from server.registry.models import RegistryBase
from server.registry.service import AdapterRegistry
from server.registry.signing import UrlSigner
from server.registry.source import PbaseResolver, version_to_serve
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
                          store: AdapterStore) -> dict[str, SourceResolver]:
    """The resolvers to pass as `Engine.from_config(..., adapter_sources=...)`."""
    return {
        "pbase": lambda ref, api_token, scope: pbase.resolve(scope, ref.adapter_id),
        "hub": _hub_resolver(config, store),
        "s3": _s3_resolver(config, store),
        "local": _local_resolver(config.adapter_dir),
    }


def _hub_resolver(config: ServerConfig, store: AdapterStore) -> SourceResolver:
    if config.hub_endpoint is None:
        def unavailable(ref: AdapterRef, api_token: str | None, scope: str) -> Path:
            raise AdapterUnavailableError(
                f"hub adapter {ref.adapter_id!r} is unavailable: this server has no hub endpoint "
                "configured (the operator starts it with --hub-endpoint)")
        return unavailable
    from lora_runtime.adapters.sources.hub import HubConfig, HubSource

    hub = HubSource(HubConfig(config.hub_endpoint), store)
    return lambda ref, api_token, scope: hub.resolve(ref.adapter_id, api_token)


def _s3_resolver(config: ServerConfig, store: AdapterStore) -> SourceResolver:
    from lora_runtime.adapters.sources.s3 import S3Source

    s3 = S3Source(s3_config(config), store)
    # The caller's api_token is a hub token: S3 uses the server's own credentials only.
    return lambda ref, api_token, scope: s3.resolve(ref.adapter_id, None)


def _local_resolver(adapter_dir: Path | None) -> SourceResolver:
    if adapter_dir is None:
        def disabled(ref: AdapterRef, api_token: str | None, scope: str) -> Path:
            raise ValidationError("adapter_source", "local adapters are not enabled on this server")
        return disabled
    local = LocalSource(adapter_dir)
    return lambda ref, api_token, scope: local.resolve(ref, api_token)


def engine_adapter_sources(config: ServerConfig, database: Database) -> dict[str, SourceResolver]:
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

    def with_current_versions(self, request: AdapterRequest | None) -> AdapterRequest | None:
        """`request` keyed by the blob ids of the pbase versions it names, read now: a deleted or
        archived version is not found even while its weights are cached, and a repo deleted and
        created again never serves the old weights under the same `repo/N`. Blocks (database)."""
        if request is None:
            return None
        adapter = request.adapter
        if isinstance(adapter, MergedAdapters):
            pbase_ids = [adapter_id for adapter_id in adapter.ids if infer_source(adapter_id) == "pbase"]
        else:
            pbase_ids = [adapter.adapter_id] if adapter.source == "pbase" else []
        blob_ids = [self._blob_id(request.scope, adapter_id) for adapter_id in pbase_ids]
        return dataclasses.replace(request, version_key=",".join(blob_ids)) if blob_ids else request

    def _blob_id(self, tenant: str, adapter_id: str) -> str:
        version, _ = version_to_serve(self.registry.sessions, tenant, adapter_id)
        return version.blob_id

    def uploads(self, config: ServerConfig, base_url: str) -> UploadService:
        """The upload service, its URLs starting with `config.public_url`, else `base_url`."""
        upload_config = UploadConfig(public_base_url=config.public_url or base_url,
                                     url_ttl_s=config.upload_url_ttl_s,
                                     max_upload_bytes=config.max_upload_bytes)
        return UploadService(self.registry, self.signer, upload_config)


def adapter_services(config: ServerConfig, database: Database, engine: Engine) -> AdapterServices:
    RegistryBase.metadata.create_all(database.engine)  # a no-op once the tables exist

    def validate(directory: Path) -> None:
        load_peft_adapter(directory, engine.adapters.base_shape, engine.adapters.limits)

    registry = AdapterRegistry(database.sessions, registry_blobs(config), validate)
    return AdapterServices(registry, UrlSigner(secrets.token_bytes(32)))
