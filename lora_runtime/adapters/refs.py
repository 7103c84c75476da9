"""Adapter identity: parse and validate `adapter_id` (+ `adapter_source`) once where it enters, into
an `AdapterRequest` (what to load, for whom) whose `key` (`AdapterKey`) names the weights everywhere
after: the host cache, the scheduler, the device's adapter pages. Also the source protocol
(`AdapterSource`) and the `local` source.

Source inference (docs/api.md section 3): `<repo>/<int>[@<int>]` is `pbase`, `s3://...` is `s3`,
anything else `hub`; `local` only when enabled. For the library (`allow_local=True`), a reference
that names an existing local directory is that directory, so `engine.generate(...,
adapters=["./my_adapter"])` works out of the box.

Ids are validated strictly (by the patterns of `sources.ids`) before any source sees them, because
they become file paths, cache keys and object-store prefixes: no `..`, no absolute paths, no
backslashes, no control characters, bounded length. Local paths are checked by `LocalSource`:
inside its root when it has one (the server), any readable directory when it has none (the library)."""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from lora_runtime.adapters.merge_request import MergedAdapters
from lora_runtime.adapter_files import ADAPTER_CONFIG_FILE as CONFIG_FILE
from lora_runtime.adapters.sources import ids
from lora_runtime.errors import AdapterNotFoundError, ValidationError

SOURCES = ("pbase", "hub", "s3", "local")


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """A validated reference. `adapter_id` is the id as the caller wrote it; `name` is what the
    source looks up: the hub repo (`org/name`), the pbase repo, `bucket/prefix` for s3, the path for
    local (normalized). `version` is pbase's version; `revision` the hub revision or pbase checkpoint."""

    source: str
    adapter_id: str
    name: str
    version: int | None = None
    revision: str | None = None

    @property
    def identity(self) -> str:
        """The adapter whatever the spelling of its id: `s3://bucket/prefix` for `bucket/prefix/`,
        the normalized path for `./tiny` and `tiny/../tiny` (`tiny`), `repo/1@3` for `repo/1@03`."""
        if self.source == "s3":
            return f"s3://{self.name}"
        if self.source == "local":
            return self.name
        named = self.name if self.version is None else f"{self.name}/{self.version}"
        return named if self.revision is None else f"{named}@{self.revision}"


@dataclass(frozen=True, slots=True)
class Caller:
    """Who asks for an adapter: the tenant whose registry `pbase` ids are read in, and the caller's
    hub token (sent to the hub only; never part of a key, only its digest is)."""

    scope: str = ""
    api_token: str | None = None

    @property
    def credential(self) -> str:
        return hashlib.sha256(self.api_token.encode()).hexdigest()[:16] if self.api_token else ""


@dataclass(frozen=True, slots=True, order=True)
class AdapterKey:
    """What identifies an adapter's weights: its source and identity (`AdapterRef.identity`, the same
    for every spelling of one id; a merge: "merge" and its whole description), the tenant it was read for, a digest of the credential that read it (so a private
    adapter cached for one caller is never served to another on the strength of the cache alone),
    and what a mutable id named when it was read (`version`: a pbase version's blob ids), so the same
    id naming new content is a new key."""

    source: str
    scope: str
    credential: str
    version: str
    adapter_id: str

    def __str__(self) -> str:
        scope = f"{self.scope}/" if self.scope else ""
        return f"{scope}{self.source}:{self.adapter_id}"


@dataclass(frozen=True, slots=True)
class AdapterRequest:
    """One request's adapter, parsed: a reference or a merge, the caller, and the content key the
    server read for it (`version_key`, see `AdapterKey.version`). A merge's ids are parsed once,
    where the request enters (`parse_merged_ids`), into `parts`: its distinct ids' references, in
    `MergedAdapters.distinct_ids` order; the loader and the registry read them from there."""

    adapter: AdapterRef | MergedAdapters
    caller: Caller = Caller()
    version_key: str = ""
    parts: tuple[AdapterRef, ...] = ()

    @property
    def key(self) -> AdapterKey:
        if isinstance(self.adapter, MergedAdapters):
            merge = self.adapter
            described = repr((merge.ids, merge.weights, merge.merge_strategy, merge.density, merge.majority_sign_method))
            return AdapterKey("merge", self.caller.scope, self.caller.credential, self.version_key, described)
        return AdapterKey(self.adapter.source, self.caller.scope, self.caller.credential, self.version_key,
                          self.adapter.identity)

    def part_requests(self) -> dict[str, AdapterRequest]:
        """A merge's distinct ids -> the request for each, for the same caller."""
        assert isinstance(self.adapter, MergedAdapters) and len(self.parts) == len(self.adapter.distinct_ids)
        return {ref.adapter_id: AdapterRequest(ref, self.caller) for ref in self.parts}


# What a library caller may name as a request's adapter: an id (a local path works), a parsed
# reference, a merge, or a whole request; None (or "") for the base model. The service sends only
# `AdapterRequest`s (`EngineBackend.add_request`).
AdapterArgument = str | AdapterRef | MergedAdapters | AdapterRequest | None


class AdapterSource(Protocol):
    """Turns a validated reference into a local PEFT directory, for `caller`. Raises the typed
    adapter errors of `lora_runtime.errors` (not found, access, unavailable, invalid)."""

    def resolve(self, ref: AdapterRef, caller: Caller) -> Path: ...


def parse_adapter_ref(
    adapter_id: str, adapter_source: str | None = None, allow_local: bool = False
) -> AdapterRef:
    """Validate `adapter_id` and infer its source when `adapter_source` is None. The id patterns
    are those of `sources.ids`, the single place that defines them.

    Raises:
        ValidationError: naming `adapter_id` or `adapter_source`.
    """
    ids.check_common(adapter_id)
    if adapter_source is not None and adapter_source not in SOURCES:
        raise ValidationError(
            "adapter_source", f"must be one of {', '.join(SOURCES)}, got {adapter_source!r}"
        )
    if adapter_source == "local" and not allow_local:
        raise ValidationError("adapter_source", "local adapters are not enabled on this server")
    source = adapter_source or _infer_source(adapter_id, allow_local)
    parsers = {"pbase": _parse_pbase, "hub": _parse_hub, "s3": _parse_s3, "local": _parse_local}
    return parsers[source](adapter_id)


def parse_merged_ids(merge: MergedAdapters, allow_local: bool = False) -> tuple[AdapterRef, ...]:
    """A merge's distinct ids parsed, as `AdapterRequest.parts` holds them; a bad id is refused naming
    `merged_adapters.ids`."""
    return tuple(merged_id_ref(lambda: parse_adapter_ref(adapter_id, allow_local=allow_local))
                 for adapter_id in merge.distinct_ids)


def merged_id_ref(parse: Callable[[], AdapterRef]) -> AdapterRef:
    """`parse()`, the reference of one id of a merge, its ValidationError renamed to the merge's field."""
    try:
        return parse()
    except ValidationError as error:
        raise ValidationError("merged_adapters.ids", error.message) from None


def _infer_source(adapter_id: str, allow_local: bool) -> str:
    looks_like_path = adapter_id.startswith(("/", "./", "../", "~"))
    if allow_local and (looks_like_path or Path(adapter_id).expanduser().is_dir()):
        return "local"
    return ids.infer_source(adapter_id)


def _parse_pbase(adapter_id: str) -> AdapterRef:
    parsed = ids.parse_pbase_id(adapter_id)
    checkpoint = None if parsed.checkpoint is None else str(parsed.checkpoint)
    return AdapterRef("pbase", adapter_id, parsed.repo, parsed.version, checkpoint)


def _parse_hub(adapter_id: str) -> AdapterRef:
    parsed = ids.parse_hub_id(adapter_id)
    return AdapterRef("hub", adapter_id, parsed.repo_id, revision=parsed.revision)


def _parse_s3(adapter_id: str) -> AdapterRef:
    parsed = ids.parse_s3_id(adapter_id)
    return AdapterRef("s3", adapter_id, f"{parsed.bucket}/{parsed.prefix}")


def _parse_local(adapter_id: str) -> AdapterRef:
    # Normalized lexically, so that every spelling of one directory is one adapter (one key, one
    # load) and what is looked up is what the key names; `LocalSource` then checks where it lands.
    return AdapterRef("local", adapter_id, os.path.normpath(adapter_id))


class LocalSource:
    """Adapters in local directories. With a `root` (the server), a reference is a relative path
    that must stay inside it; without one (the library), any path the process can read."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root.resolve() if root is not None else None

    def resolve(self, ref: AdapterRef, caller: Caller = Caller()) -> Path:
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
