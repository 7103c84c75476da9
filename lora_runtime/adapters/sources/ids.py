"""Strict parsing of adapter ids, done before an id touches a path or a URL.

Every id part becomes a path component in the local store or a segment of a hub / S3 URL, so each
part must match a narrow pattern: no `..`, no absolute paths, no backslashes, bounded length.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lora_runtime.errors import ValidationError

MAX_ADAPTER_ID_CHARS = 256

# A name part: starts with an alphanumeric, then alphanumerics, `.`, `_`, `-`; never `..` inside.
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,95})"
# The organization is optional: the hub also has root-level models ("gpt2").
_HUB_ID = re.compile(rf"(?:(?P<org>{_NAME})/)?(?P<name>{_NAME})(?:@(?P<revision>[A-Za-z0-9][A-Za-z0-9._/-]{{0,127}}))?")
_PBASE_ID = re.compile(rf"(?P<repo>{_NAME})/(?P<version>[1-9][0-9]{{0,8}})(?:@(?P<checkpoint>[0-9]{{1,9}}))?")
# S3 bucket names: 3-63 lowercase letters, digits, `.` and `-` (AWS naming rules, simplified).
_S3_ID = re.compile(
    r"(?:s3://)?(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/(?P<prefix>[A-Za-z0-9][A-Za-z0-9._/-]{0,199})"
)
_PBASE_FORM = re.compile(r"[^/@]+/[0-9]+(?:@[0-9]+)?")


@dataclass(frozen=True, slots=True)
class HubId:
    repo_id: str  # "org/name" (or "name")
    revision: str | None


@dataclass(frozen=True, slots=True)
class PbaseId:
    repo: str
    version: int
    checkpoint: int | None


@dataclass(frozen=True, slots=True)
class S3Id:
    bucket: str
    prefix: str  # never ends with "/"


def check_common(adapter_id: object) -> str:
    """What every id must be, local paths included: a bounded string without backslashes or
    control characters."""
    if not isinstance(adapter_id, str) or not adapter_id or len(adapter_id) > MAX_ADAPTER_ID_CHARS:
        raise ValidationError("adapter_id", f"must be a string of 1 to {MAX_ADAPTER_ID_CHARS} characters")
    if "\\" in adapter_id or any(ord(char) < 32 or ord(char) == 127 for char in adapter_id):
        raise ValidationError("adapter_id", "must not contain backslashes or control characters")
    return adapter_id


def check_remote(adapter_id: object) -> str:
    """A remote id: it becomes store paths and URL segments, so it never names a way out."""
    if ".." in check_common(adapter_id) or adapter_id.startswith("/"):
        raise ValidationError("adapter_id", "must not contain '..' or start with '/'")
    return adapter_id


def parse_hub_id(adapter_id: str) -> HubId:
    """`[org/]name` or `[org/]name@revision` (a branch, tag or commit hash)."""
    match = _HUB_ID.fullmatch(check_remote(adapter_id))
    if match is None:
        raise ValidationError("adapter_id", "a hub adapter id is 'organization/name' or 'organization/name@revision'")
    repo_id = match["name"] if match["org"] is None else f"{match['org']}/{match['name']}"
    return HubId(repo_id=repo_id, revision=match["revision"])


def parse_pbase_id(adapter_id: str) -> PbaseId:
    """`repo/version` or `repo/version@checkpoint`."""
    match = _PBASE_ID.fullmatch(check_remote(adapter_id))
    if match is None:
        raise ValidationError("adapter_id", "a registry adapter id is 'repo/version' or 'repo/version@checkpoint'")
    checkpoint = match["checkpoint"]
    return PbaseId(match["repo"], int(match["version"]), int(checkpoint) if checkpoint is not None else None)


def parse_s3_id(adapter_id: str) -> S3Id:
    """`s3://bucket/prefix` or `bucket/prefix`; a trailing `/` on the prefix is dropped."""
    match = _S3_ID.fullmatch(check_remote(adapter_id).rstrip("/"))
    if match is None or "//" in match["prefix"] or ".." in match["bucket"]:
        raise ValidationError("adapter_id", "an S3 adapter id is 's3://bucket/prefix'")
    return S3Id(bucket=match["bucket"], prefix=match["prefix"])


def infer_source(adapter_id: str) -> str:
    """The source an id names when the request gives none (docs/api.md section 3)."""
    if adapter_id.startswith("s3://"):
        return "s3"
    if _PBASE_FORM.fullmatch(adapter_id):
        return "pbase"
    return "hub"


def is_store_key_part(part: str) -> bool:
    """Whether `part` may be one path component of a local store key."""
    return re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}", part) is not None and ".." not in part
