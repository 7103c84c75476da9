"""Signed, expiring URLs: an HMAC-SHA256 over the path and the expiry time with a server secret.

A signed URL is its own authorization (docs/api.md section 1: upload URLs need no Authorization header),
so it names one path, ends at a fixed time, and cannot be altered without the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from urllib.parse import urlencode

from server.registry.errors import UploadSignatureError


class UrlSigner:
    def __init__(self, secret: bytes) -> None:
        assert len(secret) >= 32, "the signing secret must have at least 256 bits"
        self._secret = secret

    def signature(self, path: str, expires_at: int) -> str:
        message = f"{path}\n{expires_at}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def sign(self, base_url: str, path: str, ttl_s: int, now_s: float | None = None) -> str:
        """`base_url + path` with `expires` and `signature` query parameters."""
        expires_at = int((time.time() if now_s is None else now_s) + ttl_s)
        query = urlencode({"expires": expires_at, "signature": self.signature(path, expires_at)})
        return f"{base_url.rstrip('/')}{path}?{query}"

    def verify(self, path: str, expires: str, signature: str, now_s: float | None = None) -> None:
        """Raises UploadSignatureError unless `signature` signs `path` until `expires`, not yet passed."""
        if not (expires.isdigit() and len(expires) <= 12) or int(expires) < (time.time() if now_s is None else now_s):
            raise UploadSignatureError("the upload URL has expired")
        if not hmac.compare_digest(self.signature(path, int(expires)), signature):
            raise UploadSignatureError("the upload URL's signature does not match")
