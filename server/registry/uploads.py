"""The three-step upload of docs/api.md section 1 as service functions.

1. `start_upload`: opens an upload session and hands out one signed, expiring URL per file (presigned
   S3 URLs when the blob store is S3, else URLs to this server's `PUT` route), within the bounds on
   files and checkpoints of one upload and on the tenant's open uploads.
2. The client PUTs raw bytes to each URL, with no Authorization header: the URL is the authorization.
   This server's route admits a PUT (`admit_file`) with the tightest bound of `upload_bounds` and
   stores it (`store_file`), refused with 413 as the body passes the bound.
3. `finish_upload`: claims the session once, validates the files and records the next version.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import re
import secrets
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from lora_runtime.adapter_files import ADAPTER_CONFIG_FILE, BIN_FILE, SAFETENSORS_FILE
from lora_runtime.api import ValidationError
from server.registry.errors import ByteBound, PayloadTooLargeError, TooManyUploadsError, UploadNotFoundError
from server.registry.layout import check_upload_name
from server.registry.models import UploadSession, as_utc, utc_now
from server.registry.repos import VersionInfo, check_repo_name
from server.registry.service import AdapterRegistry
from server.registry.signing import UrlSigner
from server.registry.upload_bounds import (Reservation, StagingLedger, file_bound, remaining_bound, staged_bytes,
                                           tightest)

logger = logging.getLogger(__name__)

# The files the predibase SDK expects URLs for, whichever it has (docs/api.md section 1).
STANDARD_UPLOAD_FILES = (ADAPTER_CONFIG_FILE, BIN_FILE, SAFETENSORS_FILE)
UPLOAD_ROUTE = "/v2/adapters/upload/files"
UPLOAD_ID = re.compile(r"[0-9a-f]{48}")  # secrets.token_hex(24)
# States whose staged files count against the tenant (a `done` upload's files are deleted).
_STAGING_STATES = ("open", "finishing")


@dataclass(frozen=True, slots=True)
class UploadConfig:
    public_base_url: str  # how clients reach this server, for URLs to its own upload route
    url_ttl_s: int = 3600
    max_upload_bytes: int = 2 * 1024**3  # all files of one upload together
    max_upload_files: int = 256  # files one upload may name (checkpoint files included)
    max_open_uploads: int = 8  # per tenant: opened, neither finished nor expired
    max_staged_upload_bytes: int = 4 * 1024**3  # per tenant: the files of its unfinished uploads
    # One weights file: `upload_bounds.weights_max_bytes` of the served base model.
    weights_max_bytes: int = 2 * 1024**3


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
class FileAdmission:
    """A PUT let in: where its file goes, the bound it streams under, the bytes it holds reserved."""

    key: str
    bound: ByteBound
    reservation: Reservation


@dataclass(frozen=True, slots=True)
class UploadService:
    registry: AdapterRegistry
    signer: UrlSigner
    config: UploadConfig
    ledger: StagingLedger = field(default_factory=StagingLedger)  # the server's one, shared by requests

    def start_upload(
        self, tenant_id: str, created_by: str, repo: str, description: str = "", files: Sequence[str] = ()
    ) -> UploadStart:
        """Step 1. `files` may name more files (tokenizer files, `checkpoint-<N>/...`) than the standard three.

        Raises:
            ValidationError (422): a bad repo or file name, more files or checkpoints than allowed.
            TooManyUploadsError (429): the tenant has `max_open_uploads` uploads open already.
        """
        check_repo_name(repo)
        names = dict.fromkeys([*STANDARD_UPLOAD_FILES, *(check_upload_name(n) for n in files)])
        self._check_counts(names)
        upload_id = secrets.token_hex(24)
        with self.ledger.lock, self.registry.sessions() as session, session.begin():
            self._check_open_uploads(session, tenant_id)
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
        """Checks a signed URL to this server's upload route.

        Raises:
            UploadSignatureError (403): altered, for another path, or expired.
            ValidationError (422): not an adapter file name.
        """
        self.signer.verify(_route_path(upload_id, name), expires, signature)
        check_upload_name(name)

    def admit_file(
        self, upload_id: str, name: str, expires: str, signature: str, declared_bytes: int | None = None
    ) -> FileAdmission:
        """Step 2 on this server (`PUT {UPLOAD_ROUTE}/{upload_id}/{name}`), before the body is read:
        checks the URL and the upload, and reserves what the file may take: its Content-Length
        (`declared_bytes`) when it has one, else its whole bound. `release` it after.

        Raises:
            UploadSignatureError (403), ValidationError (422), UploadNotFoundError (404: the upload
            is finished or expired), PayloadTooLargeError (413: `declared_bytes` past the bound).
        """
        self.verify_upload_url(upload_id, name, expires, signature)
        upload = self._open_upload(upload_id)
        with self.ledger.lock:
            bound = self._put_bound(upload, name)
            if declared_bytes is not None and declared_bytes > bound.max_bytes:
                raise bound.error()
            reserved = bound.max_bytes if declared_bytes is None else declared_bytes
            reservation = self.ledger.reserve(Reservation(upload.tenant_id, upload_id, reserved))
        return FileAdmission(f"uploads/{upload_id}/{name}", dataclasses.replace(bound, max_bytes=reserved),
                             reservation)

    def store_file(self, admission: FileAdmission, body: BinaryIO) -> int:
        """Stores an admitted PUT's body; returns its size. Raises PayloadTooLargeError (413) as the
        body passes the admission's bound, naming the bound."""
        return self.registry.blobs.put_stream(admission.key, body, admission.bound)

    def release(self, admission: FileAdmission) -> None:
        self.ledger.release(admission.reservation)

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

    def _check_counts(self, names: Iterable[str]) -> None:
        names = list(names)
        if len(names) > self.config.max_upload_files:
            raise ValidationError(
                "files", f"an upload names at most {self.config.max_upload_files} files, got {len(names)}"
            )
        checkpoints = {name.split("/", 1)[0] for name in names if "/" in name}
        if len(checkpoints) > self.registry.max_checkpoints:
            raise ValidationError(
                "files",
                f"a version has at most {self.registry.max_checkpoints} checkpoint folders, got {len(checkpoints)}",
            )

    def _check_open_uploads(self, session: Session, tenant_id: str) -> None:
        num_open = session.scalar(
            select(func.count())
            .select_from(UploadSession)
            .where(UploadSession.tenant_id == tenant_id, UploadSession.state.in_(_STAGING_STATES))
            .where(UploadSession.expires_at >= utc_now())
        )
        if num_open is not None and num_open >= self.config.max_open_uploads:
            raise TooManyUploadsError(
                f"tenant {tenant_id!r} has {num_open} uploads open, the most this server allows: finish "
                f"one, or wait until one expires ({2 * self.config.url_ttl_s} s after it started)"
            )

    def _open_upload(self, upload_id: str) -> UploadSession:
        with self.registry.sessions() as session:
            upload = session.get(UploadSession, upload_id)
            if upload is None or upload.state != "open" or as_utc(upload.expires_at) < utc_now():
                raise UploadNotFoundError("the upload is finished, expired or unknown")
            session.expunge(upload)
        return upload

    def _put_bound(self, upload: UploadSession, name: str) -> ByteBound:
        """The tightest of the file's own bound, what is left of its upload's, and of its tenant's.
        Hold the ledger's lock. A file PUT again replaces its staged copy: that copy is not counted."""
        own = staged_bytes(self.registry.blobs.list(f"uploads/{upload.id}"), except_name=name)
        others = sum(staged_bytes(self.registry.blobs.list(f"uploads/{other}"))
                     for other in self._staging_upload_ids(upload.tenant_id) if other != upload.id)
        in_upload = own + self.ledger.reserved(upload.tenant_id, upload.id)
        in_tenant = own + others + self.ledger.reserved(upload.tenant_id)
        return tightest([
            file_bound(name, self.config.weights_max_bytes),
            remaining_bound(self.config.max_upload_bytes, in_upload, f"{name}: the files of one upload together"),
            remaining_bound(self.config.max_staged_upload_bytes, in_tenant,
                            f"{name}: the staged files of tenant {upload.tenant_id!r}'s unfinished uploads"),
        ])

    def _staging_upload_ids(self, tenant_id: str) -> list[str]:
        """The tenant's uploads that may hold staged files (expired ones too, until swept)."""
        with self.registry.sessions() as session:
            return list(session.scalars(
                select(UploadSession.id)
                .where(UploadSession.tenant_id == tenant_id, UploadSession.state.in_(_STAGING_STATES))
            ))

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
        """The staged files into `directory`, each within its own bound (files PUT straight to S3
        were not checked as they arrived) and all within `max_upload_bytes`."""
        staged = self.registry.blobs.list(f"uploads/{upload_id}")
        self._check_staged(staged)
        for name in staged:
            target = directory / check_upload_name(name)
            target.parent.mkdir(exist_ok=True)
            self.registry.blobs.get_file(f"uploads/{upload_id}/{name}", target)

    def _check_staged(self, staged: dict[str, int]) -> None:
        for name, size in staged.items():
            bound = file_bound(name, self.config.weights_max_bytes)
            if size > bound.max_bytes:
                raise bound.error()
        total = sum(staged.values())
        if total > self.config.max_upload_bytes:
            raise PayloadTooLargeError(
                f"the files of one upload together hold at most {self.config.max_upload_bytes} bytes, got {total}"
            )


def _route_path(upload_id: str, name: str) -> str:
    return f"{UPLOAD_ROUTE}/{upload_id}/{name}"
