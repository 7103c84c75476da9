"""Adapter references: parse and validate `adapter_id` (+ `adapter_source`), and the `local` source.

Source inference (API.md section 3): `<repo>/<int>[@<int>]` is `pbase`, `s3://...` is `s3`,
anything else `hub`; `local` only when enabled. For the library (`allow_local=True`), a reference
that names an existing local directory is that directory, so `engine.generate(...,
adapters=["./my_adapter"])` works out of the box.

Ids are validated strictly before any source sees them, because they become file paths, cache
keys and object-store prefixes: no `..` segments, no absolute paths, no backslashes, no control
characters, bounded length. Local paths are checked by `LocalSource`: inside its root when it has
one (the server), any readable directory when it has none (the library)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from lora_runtime.adapters.peft_format import CONFIG_FILE
from lora_runtime.errors import AdapterNotFoundError, ValidationError

SOURCES = ("pbase", "hub", "s3", "local")
MAX_ID_LENGTH = 256

_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_PBASE = re.compile(rf"^(?P<repo>{_SEGMENT})/(?P<version>\d+)(?:@(?P<checkpoint>\d+))?$")
_HUB = re.compile(rf"^(?P<name>(?:{_SEGMENT}/)?{_SEGMENT})(?:@(?P<revision>[A-Za-z0-9._/-]+))?$")
_S3 = re.compile(r"^(?:s3://)?(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(?P<prefix>[^@]*))?$")


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """A validated reference. `adapter_id` is the id as the caller wrote it; `name` is what the
    source looks up: the hub repo (`org/name`), the pbase repo, `bucket/prefix` for s3, the path for
    local. `version` is pbase's version; `revision` the hub revision or pbase checkpoint."""

    source: str
    adapter_id: str
    name: str
    version: int | None = None
    revision: str | None = None


class AdapterSource(Protocol):
    """Where adapters come from. `resolve` returns a local directory holding the adapter's PEFT
    files (downloading it first if needed), or raises AdapterNotFoundError (404),
    AdapterAccessError (403) or AdapterUnavailableError (424)."""

    def resolve(self, ref: AdapterRef, api_token: str | None) -> Path: ...


def parse_adapter_ref(
    adapter_id: str, adapter_source: str | None = None, allow_local: bool = False
) -> AdapterRef:
    """Validate `adapter_id` and infer its source when `adapter_source` is None.

    Raises:
        ValidationError: naming `adapter_id` or `adapter_source`.
    """
    _check_common(adapter_id)
    if adapter_source is not None and adapter_source not in SOURCES:
        raise ValidationError(
            "adapter_source", f"must be one of {', '.join(SOURCES)}, got {adapter_source!r}"
        )
    if adapter_source == "local" and not allow_local:
        raise ValidationError("adapter_source", "local adapters are not enabled on this server")
    source = adapter_source or _infer_source(adapter_id, allow_local)
    if source != "local":
        _check_no_path_escape(adapter_id)
    parsers = {"pbase": _parse_pbase, "hub": _parse_hub, "s3": _parse_s3, "local": _parse_local}
    return parsers[source](adapter_id)


def _infer_source(adapter_id: str, allow_local: bool) -> str:
    looks_like_path = adapter_id.startswith(("/", "./", "../", "~"))
    if allow_local and (looks_like_path or Path(adapter_id).expanduser().is_dir()):
        return "local"
    if adapter_id.startswith("s3://"):
        return "s3"
    return "pbase" if _PBASE.match(adapter_id) else "hub"


def _check_common(adapter_id: object) -> None:
    if not isinstance(adapter_id, str) or not adapter_id:
        raise ValidationError("adapter_id", "must be a non-empty string")
    if len(adapter_id) > MAX_ID_LENGTH:
        raise ValidationError("adapter_id", f"must be at most {MAX_ID_LENGTH} characters")
    if "\\" in adapter_id or any(ord(char) < 32 or ord(char) == 127 for char in adapter_id):
        raise ValidationError("adapter_id", "must not contain backslashes or control characters")


def _check_no_path_escape(adapter_id: str) -> None:
    """Remote ids become paths in the download cache: they never leave it."""
    if adapter_id.startswith("/") or ".." in re.split(r"[/@]", adapter_id):
        raise ValidationError("adapter_id", "must not be an absolute path or contain '..' segments")


def _parse_pbase(adapter_id: str) -> AdapterRef:
    match = _PBASE.match(adapter_id)
    if match is None:
        raise ValidationError("adapter_id", "a pbase id is <repo>/<version>[@<checkpoint>]")
    return AdapterRef("pbase", adapter_id, match["repo"], int(match["version"]), match["checkpoint"])


def _parse_hub(adapter_id: str) -> AdapterRef:
    match = _HUB.match(adapter_id)
    if match is None:
        raise ValidationError("adapter_id", "a hub id is <organization>/<adapter_name>[@revision]")
    return AdapterRef("hub", adapter_id, match["name"], revision=match["revision"])


def _parse_s3(adapter_id: str) -> AdapterRef:
    match = _S3.match(adapter_id)
    prefix = (match["prefix"] or "").strip("/") if match else ""
    if match is None or "//" in prefix or not prefix:
        raise ValidationError("adapter_id", "an s3 id is s3://<bucket>/<prefix>")
    return AdapterRef("s3", adapter_id, f"{match['bucket']}/{prefix}")


def _parse_local(adapter_id: str) -> AdapterRef:
    return AdapterRef("local", adapter_id, adapter_id)


class LocalSource:
    """Adapters in local directories. With a `root` (the server), a reference is a relative path
    that must stay inside it; without one (the library), any path the process can read."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root.resolve() if root is not None else None

    def resolve(self, ref: AdapterRef, api_token: str | None = None) -> Path:
        assert ref.source == "local"
        path = Path(ref.name).expanduser()
        if self.root is not None:
            if path.is_absolute():
                raise ValidationError("adapter_id", "a local adapter id is relative to the adapter root")
            path = (self.root / path).resolve()
            if not path.is_relative_to(self.root):
                raise ValidationError("adapter_id", "a local adapter id must stay inside the adapter root")
        if not (path / CONFIG_FILE).is_file():
            raise AdapterNotFoundError(f"adapter {ref.adapter_id!r} not found: no {CONFIG_FILE} there")
        return path
