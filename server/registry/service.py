"""The registry as one object: records (repos.py) plus the blobs they point at.

Blob layout: `adapters/<blob_id>/main/<file>` for a version's adapter and
`adapters/<blob_id>/checkpoint-<N>/<file>` for its checkpoints; `uploads/<upload_id>/...` for files
of an upload in progress.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from server.registry import repos
from server.registry.blobs import BlobStore
from server.registry.layout import MAX_CHECKPOINTS, AdapterValidator, read_layout
from server.registry.models import new_uuid
from server.registry.repos import RepoInfo, SessionFactory, VersionInfo


def version_prefix(blob_id: str, checkpoint: int | None = None) -> str:
    return f"adapters/{blob_id}/" + ("main" if checkpoint is None else f"checkpoint-{checkpoint}")


@dataclass(frozen=True, slots=True)
class AdapterRegistry:
    """Service functions for the repo and version routes; tenant ids come from the caller's token."""

    sessions: SessionFactory
    blobs: BlobStore
    validate: AdapterValidator  # the adapter loader's validation: raises on a bad or incompatible adapter
    max_checkpoints: int = MAX_CHECKPOINTS  # checkpoint folders of one version

    def create_version(
        self, tenant_id: str, created_by: str, repo: str, directory: Path, description: str = ""
    ) -> VersionInfo:
        """Validates the adapter(s) in `directory` and records them as the repo's next version.

        `directory` is modified in place (bin weights become safetensors). A bad adapter raises
        before anything is stored or recorded; the repo is created if missing.
        """
        repos.check_repo_name(repo)
        layout = read_layout(directory, self.validate, self.max_checkpoints)
        blob_id = new_uuid()
        try:
            self._store_adapter(layout.main, version_prefix(blob_id))
            for number, checkpoint_dir in layout.checkpoints.items():
                self._store_adapter(checkpoint_dir, version_prefix(blob_id, number))
            return repos.add_version(
                self.sessions,
                tenant_id,
                repo,
                created_by,
                blob_id,
                layout.base_model,
                checkpoints=tuple(layout.checkpoints),
                description=description,
            )
        except BaseException:
            self.blobs.delete_prefix(f"adapters/{blob_id}")
            raise

    def create_repo(
        self, tenant_id: str, name: str, created_by: str, description: str = "", exists_ok: bool = False
    ) -> RepoInfo:
        return repos.create_repo(self.sessions, tenant_id, name, created_by, description, exists_ok)

    def get_repo(self, tenant_id: str, name: str) -> RepoInfo:
        return repos.get_repo(self.sessions, tenant_id, name)

    def list_repos(self, tenant_id: str, limit: int = 100) -> list[RepoInfo]:
        return repos.list_repos(self.sessions, tenant_id, limit)

    def get_version(self, tenant_id: str, repo: str, tag: int) -> VersionInfo:
        return repos.get_version(self.sessions, tenant_id, repo, tag)

    def set_archived(self, tenant_id: str, repo: str, tag: int, archived: bool) -> VersionInfo:
        return repos.set_archived(self.sessions, tenant_id, repo, tag, archived)

    def delete_version(self, tenant_id: str, repo: str, tag: int) -> None:
        self.blobs.delete_prefix(f"adapters/{repos.delete_version(self.sessions, tenant_id, repo, tag)}")

    def delete_repo(self, tenant_id: str, name: str) -> None:
        for blob_id in repos.delete_repo(self.sessions, tenant_id, name):
            self.blobs.delete_prefix(f"adapters/{blob_id}")

    def _store_adapter(self, adapter_dir: Path, prefix: str) -> None:
        for path in sorted(adapter_dir.iterdir()):
            if path.is_file():
                self.blobs.put_file(f"{prefix}/{path.name}", path)
