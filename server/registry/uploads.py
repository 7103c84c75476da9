"""The three-step upload of docs/api.md section 1 as service functions.

1. `start_upload`: opens an upload session and hands out one signed, expiring URL per file (presigned
   S3 URLs when the blob store is S3, else URLs to this server's `PUT` route for `receive_file`).
2. The client PUTs raw bytes to each URL, with no Authorization header: the URL is the authorization.
3. `finish_upload`: claims the session once, validates the files and records the next version.
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from sqlalchemy import select, update

from server.registry.errors import PayloadTooLargeError, UploadNotFoundError
from server.registry.layout import check_upload_name
from server.registry.models import UploadSession, as_utc, utc_now
from server.registry.repos import VersionInfo, check_repo_name
from server.registry.service import AdapterRegistry
from server.registry.signing import UrlSigner

logger = logging.getLogger(__name__)

# The files the predibase SDK expects URLs for, whichever it has (docs/api.md section 1).
STANDARD_UPLOAD_FILES = ("adapter_config.json", "adapter_model.bin", "adapter_model.safetensors")
UPLOAD_ROUTE = "/v2/adapters/upload/files"


@dataclass(frozen=True, slots=True)
class UploadConfig:
    public_base_url: str  # how clients reach this server, for URLs to its own upload route
    url_ttl_s: int = 3600
    max_upload_bytes: int = 2 * 1024**3  # all files of one upload together


@dataclass(frozen=True, slots=True)
class UploadStart:
    presigned_urls: dict[str, str]
    upload_token: str
    required_headers: dict[str, str] = field(default_factory=dict)

    def to_api(self) -> dict[str, object]:
        return {
            "presignedUrls": self.presigned_urls,
            "uploadToken": self.upload_token,
            "requiredHeaders": self.required_headers,
        }


@dataclass(frozen=True, slots=True)
class UploadService:
    registry: AdapterRegistry
    signer: UrlSigner
    config: UploadConfig

    def start_upload(
        self, tenant_id: str, created_by: str, repo: str, description: str = "", files: Sequence[str] = ()
    ) -> UploadStart:
        """Step 1. `files` may name more files (tokenizer files, `checkpoint-<N>/...`) than the standard three."""
        check_repo_name(repo)
        names = dict.fromkeys([*STANDARD_UPLOAD_FILES, *(check_upload_name(n) for n in files)])
        upload_id = secrets.token_hex(24)
        with self.registry.sessions() as session, session.begin():
            session.add(
                UploadSession(
                    id=upload_id,
                    tenant_id=tenant_id,
                    repo_name=repo,
                    description=description,
                    created_by=created_by,
                    expires_at=utc_now() + dt.timedelta(seconds=2 * self.config.url_ttl_s),
                )
            )
        return UploadStart({name: self._upload_url(upload_id, name) for name in names}, upload_id)

    def verify_upload_url(self, upload_id: str, name: str, expires: str, signature: str) -> None:
        """Checks a signed URL to this server's upload route; call it before reading the body.

        Raises:
            UploadSignatureError (403): altered, for another path, or expired.
            ValidationError (422): not an adapter file name.
        """
        self.signer.verify(_route_path(upload_id, name), expires, signature)
        check_upload_name(name)

    def receive_file(self, upload_id: str, name: str, expires: str, signature: str, body: BinaryIO) -> int:
        """Step 2 on this server: the `PUT {UPLOAD_ROUTE}/{upload_id}/{name}` route. Returns bytes stored.

        Raises:
            UploadSignatureError (403), ValidationError (422), PayloadTooLargeError (413).
        """
        self.verify_upload_url(upload_id, name, expires, signature)
        return self.registry.blobs.put_stream(f"uploads/{upload_id}/{name}", body, self.config.max_upload_bytes)

    def finish_upload(self, tenant_id: str, upload_token: str) -> VersionInfo:
        """Step 3: the uploaded files become the repo's next version, or nothing at all.

        Raises:
            UploadNotFoundError: unknown, expired, already finished or another tenant's token.
            AdapterInvalidError / AdapterIncompatibleError / PayloadTooLargeError: bad files; the
            session stays open so the client may upload corrected files and finish again.
        """
        upload = self._claim(tenant_id, upload_token)
        try:
            with tempfile.TemporaryDirectory(prefix="upload-") as scratch:
                self._download_upload(upload.id, Path(scratch))
                version = self.registry.create_version(
                    tenant_id, upload.created_by, upload.repo_name, Path(scratch), upload.description
                )
        except BaseException:
            self._set_state(upload.id, "open")
            raise
        self._set_state(upload.id, "done")
        self.registry.blobs.delete_prefix(f"uploads/{upload.id}")
        return version

    def _upload_url(self, upload_id: str, name: str) -> str:
        key = f"uploads/{upload_id}/{name}"
        presigned = self.registry.blobs.presigned_put_url(key, self.config.url_ttl_s)
        if presigned is not None:
            return presigned
        return self.signer.sign(self.config.public_base_url, _route_path(upload_id, name), self.config.url_ttl_s)

    def _claim(self, tenant_id: str, upload_token: str) -> UploadSession:
        """Moves the session from `open` to `finishing` atomically, so one token finishes once."""
        with self.registry.sessions() as session, session.begin():
            claimed = session.execute(
                update(UploadSession)
                .where(UploadSession.id == upload_token, UploadSession.tenant_id == tenant_id)
                .where(UploadSession.state == "open")
                .values(state="finishing")
            ).rowcount
            upload = session.scalars(select(UploadSession).where(UploadSession.id == upload_token)).one_or_none()
            if claimed != 1 or upload is None or as_utc(upload.expires_at) < utc_now():
                raise UploadNotFoundError("unknown, expired or finished upload token")
            session.expunge(upload)
        return upload

    def _set_state(self, upload_id: str, state: str) -> None:
        with self.registry.sessions() as session, session.begin():
            session.execute(update(UploadSession).where(UploadSession.id == upload_id).values(state=state))

    def _download_upload(self, upload_id: str, directory: Path) -> None:
        staged = self.registry.blobs.list(f"uploads/{upload_id}")
        if sum(staged.values()) > self.config.max_upload_bytes:
            raise PayloadTooLargeError(f"upload is larger than {self.config.max_upload_bytes} bytes")
        for name in staged:
            target = directory / check_upload_name(name)
            target.parent.mkdir(exist_ok=True)
            self.registry.blobs.get_file(f"uploads/{upload_id}/{name}", target)


def _route_path(upload_id: str, name: str) -> str:
    return f"{UPLOAD_ROUTE}/{upload_id}/{name}"
