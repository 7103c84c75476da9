"""Registry failures, typed like `lora_runtime.errors` (an `error_type` and an HTTP status each) so
the server maps them to docs/api.md section 6 bodies the same way as engine errors."""

from __future__ import annotations

from dataclasses import dataclass

from lora_runtime.api import EngineError


class RegistryError(EngineError):
    error_type = "bad_request"
    status_code = 400


class RepoNotFoundError(RegistryError):
    error_type = "not_found"
    status_code = 404


class VersionNotFoundError(RegistryError):
    error_type = "not_found"
    status_code = 404


class RepoExistsError(RegistryError):
    error_type = "conflict"
    status_code = 409


class UploadNotFoundError(RegistryError):
    """Unknown, expired, finished or another tenant's upload token."""

    error_type = "not_found"
    status_code = 404


class UploadSignatureError(RegistryError):
    """A signed upload URL whose signature does not match or whose time has passed."""

    error_type = "forbidden"
    status_code = 403


class PayloadTooLargeError(RegistryError):
    error_type = "payload_too_large"
    status_code = 413


class TooManyUploadsError(RegistryError):
    """The tenant already has as many upload sessions open as the server allows."""

    error_type = "too_many_uploads"
    status_code = 429


@dataclass(frozen=True, slots=True)
class ByteBound:
    """At most `max_bytes` may arrive; past them the refusal is a 413 whose message is `refusal`
    (which bound it was, so a client knows what to change)."""

    max_bytes: int
    refusal: str

    def error(self) -> PayloadTooLargeError:
        return PayloadTooLargeError(self.refusal)
