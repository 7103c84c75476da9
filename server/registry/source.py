"""The `pbase` adapter source: `repo/version[@checkpoint]` in the caller's tenant.

The registry is asked on every resolve, so a deleted version is never served from the local store
and another tenant's adapter is not found (its existence is not revealed). An archived version is
not served either (as Predibase hides archived versions from use) until it is unarchived: the
server asks `version_to_serve` again for every request, so weights already cached do not serve it.
Versions are immutable, so stored copies are keyed by the version's blob id.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lora_runtime.adapters.sources.download import AdapterStore, RemoteFile, select_adapter_files
from lora_runtime.adapters.sources.ids import parse_pbase_id
from lora_runtime.errors import AdapterNotFoundError
from server.registry import repos
from server.registry.blobs import BlobStore
from server.registry.errors import VersionNotFoundError
from server.registry.repos import SessionFactory, VersionInfo
from server.registry.service import version_prefix


def version_to_serve(sessions: SessionFactory, tenant_id: str, ref: str) -> tuple[VersionInfo, int | None]:
    """The version that pbase id `ref` names in `tenant_id`, and its checkpoint (None: the version's
    own adapter), when they may be served.

    Raises:
        ValidationError: a malformed id.
        AdapterNotFoundError: no such repo, version or checkpoint in this tenant, or an archived version.
    """
    adapter_id = parse_pbase_id(ref)
    try:
        version = repos.get_version(sessions, tenant_id, adapter_id.repo, adapter_id.version)
    except VersionNotFoundError:
        raise AdapterNotFoundError(f"adapter {ref!r} not found") from None
    if version.archived:
        raise AdapterNotFoundError(f"adapter {ref!r} is archived; unarchive the version to use it")
    checkpoint = adapter_id.checkpoint
    if checkpoint is not None and checkpoint not in version.checkpoints:
        raise AdapterNotFoundError(f"adapter {ref!r}: version has no checkpoint {checkpoint}")
    return version, checkpoint


@dataclass(frozen=True, slots=True)
class PbaseResolver:
    sessions: SessionFactory
    blobs: BlobStore
    store: AdapterStore

    def resolve(self, tenant_id: str, ref: str) -> Path:
        """Local directory of the adapter files of `ref` in `tenant_id`.

        Raises:
            ValidationError: a malformed id.
            AdapterNotFoundError: no such repo, version or checkpoint in this tenant, or an archived
                version.
        """
        version, checkpoint = version_to_serve(self.sessions, tenant_id, ref)
        prefix = version_prefix(version.blob_id, checkpoint)
        key = ("pbase", version.blob_id, prefix.rsplit("/", 1)[-1])
        return self.store.fetch(key, ref, lambda staging: self._download(prefix, ref, staging))

    def for_tenant(self, tenant_id: str) -> PbaseSource:
        return PbaseSource(self, tenant_id)

    def _download(self, prefix: str, ref: str, staging: Path) -> None:
        listed = [RemoteFile(name, size) for name, size in self.blobs.list(prefix).items()]
        for remote in select_adapter_files(listed, self.store.limits, ref):
            self.blobs.get_file(f"{prefix}/{remote.name}", staging / remote.name)


@dataclass(frozen=True, slots=True)
class PbaseSource:
    """An adapter source, `resolve(ref, api_token) -> Path`, bound to one request's tenant."""

    resolver: PbaseResolver
    tenant_id: str

    def resolve(self, ref: str, api_token: str | None) -> Path:
        return self.resolver.resolve(self.tenant_id, ref)
