"""Adapters from a Hugging Face hub at an endpoint the operator configures.

Every `resolve` asks the hub, with the caller's own token (anonymously without one), which commit the
requested revision is. That call is the access check: a caller only gets a stored copy of a private
or gated adapter after the hub has just told *that caller* the commit. The files are stored under the
commit hash, downloaded once with `snapshot_download` into a throw-away hub cache, so the library's
fallback to its cache on a 401 has no cache to fall back on.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx2
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile
from tqdm.auto import tqdm

from lora_runtime.adapters.refs import AdapterRef, Caller
from lora_runtime.adapters.sources.download import AdapterStore, RemoteFile, select_adapter_files
from lora_runtime.errors import AdapterAccessError, AdapterNotFoundError, AdapterUnavailableError, EngineError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HubConfig:
    endpoint: str  # e.g. "https://huggingface.co"; only ever from the operator's configuration
    timeout_s: float = 30.0


class HubSource:
    """The `hub` `AdapterSource`: `org/name[@revision]` references, read with the caller's token."""

    def __init__(self, config: HubConfig, store: AdapterStore) -> None:
        self.config = config
        self.store = store

    def resolve(self, ref: AdapterRef, caller: Caller) -> Path:
        """Local directory holding the adapter's files at the requested revision, as the hub shows
        them to `caller` (anonymously without an `api_token`).

        Raises:
            AdapterNotFoundError / AdapterAccessError / AdapterInvalidError / AdapterUnavailableError.
        """
        assert ref.source == "hub", ref
        token: str | bool = caller.api_token or False  # False: anonymous, never a token saved on this machine
        try:
            commit, files = self._list_adapter_files(ref, token)
            # Root-level repos ("gpt2") get their own top directory: no org's repo can collide.
            key = ("hub", *ref.name.split("/"), commit) if "/" in ref.name else ("hub-root", ref.name, commit)
            return self.store.fetch(
                key, ref.adapter_id, lambda staging: self._download(ref.name, commit, files, token, staging))
        except (HfHubHTTPError, httpx2.HTTPError, OSError) as error:
            logger.warning("hub fetch of %r failed: %s", ref.adapter_id, error)
            raise _typed_error(error, ref.adapter_id) from None

    def _list_adapter_files(self, ref: AdapterRef, token: str | bool) -> tuple[str, list[RemoteFile]]:
        """The commit `ref.revision` names (the caller's access check) and the adapter files there."""
        api = HfApi(endpoint=self.config.endpoint, token=token)
        info = api.model_info(ref.name, revision=ref.revision, timeout=self.config.timeout_s, token=token)
        assert info.sha is not None, "the hub answers revision info with the commit hash"
        tree = api.list_repo_tree(ref.name, revision=info.sha, token=token)
        listed = [RemoteFile(f.path, f.size) for f in tree if isinstance(f, RepoFile)]
        return info.sha, select_adapter_files(listed, self.store.limits, ref.adapter_id)

    def _download(self, repo_id: str, commit: str, files: list[RemoteFile], token: str | bool, staging: Path) -> None:
        with tempfile.TemporaryDirectory(dir=staging.parent) as scratch:
            snapshot_download(
                repo_id,
                revision=commit,
                endpoint=self.config.endpoint,
                token=token,
                allow_patterns=[f.name for f in files],
                cache_dir=Path(scratch) / "cache",
                local_dir=Path(scratch) / "files",
                etag_timeout=self.config.timeout_s,
                max_workers=2,
                tqdm_class=_SilentProgress,
            )
            for f in files:
                (Path(scratch) / "files" / f.name).rename(staging / f.name)


class _SilentProgress(tqdm):
    """Progress bars off for this call only: a server logs, it does not draw bars on stderr."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def _typed_error(error: Exception, adapter_id: str) -> EngineError:
    """The docs/api.md section 3 error for a hub failure; messages name the id, never URLs or tokens."""
    if isinstance(error, GatedRepoError):
        return AdapterAccessError(f"hub adapter {adapter_id!r} is gated: the api_token's account has no access")
    if isinstance(error, RevisionNotFoundError):
        return AdapterNotFoundError(f"hub adapter {adapter_id!r}: revision not found")
    if isinstance(error, RemoteEntryNotFoundError):
        return AdapterNotFoundError(f"hub adapter {adapter_id!r}: a listed file is missing on the hub")
    if isinstance(error, HfHubHTTPError) and error.response.status_code in (401, 403):
        # The hub answers 401 for private repos and, to anonymous callers, for missing ones too.
        return AdapterAccessError(
            f"hub adapter {adapter_id!r} is private or does not exist; pass parameters.api_token for private adapters"
        )
    if isinstance(error, RepositoryNotFoundError):
        return AdapterNotFoundError(f"hub adapter {adapter_id!r} not found")
    # Transport failures, hub 5xx answers, offline mode, local disk errors.
    return AdapterUnavailableError(f"hub unavailable while fetching adapter {adapter_id!r}")
