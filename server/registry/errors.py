"""Registry failures, each named by its wire `error_type` (docs/api.md section 6) as the engine's are;
`server/errors.py` maps the type to the HTTP status."""

from __future__ import annotations

from dataclasses import dataclass

from server.errors import ServiceError


class RegistryError(ServiceError):
    error_type = "bad_request"


class RepoNotFoundError(RegistryError):
    error_type = "not_found"


class VersionNotFoundError(RegistryError):
    error_type = "not_found"


class RepoExistsError(RegistryError):
    error_type = "conflict"


class UploadNotFoundError(RegistryError):
    """Unknown, expired, finished or another tenant's upload token."""

    error_type = "not_found"


class UploadSignatureError(RegistryError):
    """A signed upload URL whose signature does not match or whose time has passed."""

    error_type = "forbidden"


class PayloadTooLargeError(RegistryError):
    error_type = "payload_too_large"


class TooManyUploadsError(RegistryError):
    """The tenant already has as many upload sessions open as the server allows."""

    error_type = "too_many_uploads"


@dataclass(frozen=True, slots=True)
class ByteBound:
    """At most `max_bytes` may arrive; past them the refusal is a 413 whose message is `refusal`
    (which bound it was, so a client knows what to change)."""

    max_bytes: int
    refusal: str

    def error(self) -> PayloadTooLargeError:
        return PayloadTooLargeError(self.refusal)
