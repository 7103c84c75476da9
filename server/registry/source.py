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

from lora_runtime.api import AdapterNotFoundError, AdapterRef, Caller
from lora_runtime.adapters.sources.download import AdapterStore, RemoteFile, select_adapter_files
from server.registry import repos
from server.registry.blobs import BlobStore
from server.registry.errors import VersionNotFoundError
from server.registry.repos import SessionFactory, VersionInfo
from server.registry.service import version_prefix


def version_to_serve(sessions: SessionFactory, tenant_id: str, ref: AdapterRef) -> tuple[VersionInfo, int | None]:
    """The version that pbase reference `ref` names in `tenant_id`, and its checkpoint (None: the
    version's own adapter), when they may be served.

    Raises:
        AdapterNotFoundError: no such repo, version or checkpoint in this tenant, or an archived version.
    """
    assert ref.source == "pbase" and ref.version is not None, ref
    try:
        version = repos.get_version(sessions, tenant_id, ref.name, ref.version)
    except VersionNotFoundError:
        raise AdapterNotFoundError(f"adapter {ref.adapter_id!r} not found") from None
    if version.archived:
        raise AdapterNotFoundError(f"adapter {ref.adapter_id!r} is archived; unarchive the version to use it")
    checkpoint = None if ref.revision is None else int(ref.revision)
    if checkpoint is not None and checkpoint not in version.checkpoints:
        raise AdapterNotFoundError(f"adapter {ref.adapter_id!r}: version has no checkpoint {checkpoint}")
    return version, checkpoint


@dataclass(frozen=True, slots=True)
class PbaseResolver:
    """The `pbase` `AdapterSource`: a registry version (or one of its checkpoints) of the caller's
    tenant (`caller.scope`); the caller's `api_token` plays no part."""

    sessions: SessionFactory
    blobs: BlobStore
    store: AdapterStore

    def resolve(self, ref: AdapterRef, caller: Caller) -> Path:
        """Local directory of the adapter files of `ref` in the tenant `caller.scope`.

        Raises:
            AdapterNotFoundError: no such repo, version or checkpoint in this tenant, or an archived
                version.
        """
        version, checkpoint = version_to_serve(self.sessions, caller.scope, ref)
        prefix = version_prefix(version.blob_id, checkpoint)
        key = ("pbase", version.blob_id, prefix.rsplit("/", 1)[-1])
        return self.store.fetch(key, ref.adapter_id, lambda staging: self._download(prefix, ref.adapter_id, staging))

    def _download(self, prefix: str, adapter_id: str, staging: Path) -> None:
        listed = [RemoteFile(name, size) for name, size in self.blobs.list(prefix).items()]
        for remote in select_adapter_files(listed, self.store.limits, adapter_id):
            self.blobs.get_file(f"{prefix}/{remote.name}", staging / remote.name)
