"""Adapter references: source inference (docs/api.md section 3), strict id validation, local source."""
from __future__ import annotations

from pathlib import Path

import pytest

from lora_runtime.adapters import AdapterRef, AdapterRequest, Caller, LocalSource, parse_adapter_ref
from lora_runtime.errors import AdapterNotFoundError, ValidationError


@pytest.mark.parametrize(
    ("adapter_id", "source", "expected"),
    [
        ("my-repo/3", None, AdapterRef("pbase", "my-repo/3", "my-repo", 3)),
        ("my-repo/3@12", None, AdapterRef("pbase", "my-repo/3@12", "my-repo", 3, "12")),
        ("s3://bucket-1/path/to/adapter", None, AdapterRef("s3", "s3://bucket-1/path/to/adapter", "bucket-1/path/to/adapter")),
        ("bucket-1/prefix", "s3", AdapterRef("s3", "bucket-1/prefix", "bucket-1/prefix")),
        ("org/adapter", None, AdapterRef("hub", "org/adapter", "org/adapter")),
        ("org/adapter@v1.0", None, AdapterRef("hub", "org/adapter@v1.0", "org/adapter", revision="v1.0")),
        ("org/3", "hub", AdapterRef("hub", "org/3", "org/3")),
        ("single-name", None, AdapterRef("hub", "single-name", "single-name")),
    ],
)
def test_source_inference_and_parsing(adapter_id: str, source: str | None, expected: AdapterRef) -> None:
    assert parse_adapter_ref(adapter_id, source) == expected


@pytest.mark.parametrize(
    ("adapter_id", "source"),
    [
        ("", None), ("../etc/passwd", None), ("org/../secrets", None), ("/abs/path", None),
        ("org\\name", None), ("org/na\nme", None), ("x" * 300, None), ("org/a/b", None),
        ("s3://bucket/../x", None), ("s3://bucket", None), ("s3://Bad_Bucket/x", None),
        ("repo/3@x", "pbase"), ("org/name", "pbase"), ("org/name@../x", None), (42, None),
    ],
)
def test_bad_ids_are_refused_naming_adapter_id(adapter_id, source) -> None:
    with pytest.raises(ValidationError) as raised:
        parse_adapter_ref(adapter_id, source)
    assert raised.value.field == "adapter_id"


def test_unknown_or_disabled_source_is_refused_naming_adapter_source() -> None:
    for source, allow_local in (("ftp", False), ("local", False)):
        with pytest.raises(ValidationError) as raised:
            parse_adapter_ref("org/name", source, allow_local=allow_local)
        assert raised.value.field == "adapter_source"


def _adapter_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")
    return path


def test_library_local_directory_works_out_of_the_box(tmp_path: Path, monkeypatch) -> None:
    adapter = _adapter_dir(tmp_path / "adapters" / "french")
    ref = parse_adapter_ref(str(adapter), allow_local=True)
    assert ref.source == "local" and LocalSource().resolve(ref, None) == adapter
    monkeypatch.chdir(tmp_path)
    relative = parse_adapter_ref("adapters/french", allow_local=True)
    assert relative.source == "local" and LocalSource().resolve(relative, None).resolve() == adapter
    missing = parse_adapter_ref("./adapters/none", allow_local=True)
    with pytest.raises(AdapterNotFoundError):
        LocalSource().resolve(missing, None)
    assert parse_adapter_ref("adapters/none", allow_local=True).source == "hub"


def test_local_source_with_root_stays_inside_it(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _adapter_dir(root / "team" / "a1")
    _adapter_dir(tmp_path / "outside")
    source = LocalSource(root)
    assert source.resolve(parse_adapter_ref("team/a1", "local", allow_local=True), None) == root / "team" / "a1"
    for escaping in ("../outside", str(tmp_path / "outside")):
        with pytest.raises(ValidationError):
            source.resolve(parse_adapter_ref(escaping, "local", allow_local=True), None)
    with pytest.raises(AdapterNotFoundError):
        source.resolve(parse_adapter_ref("team/none", "local", allow_local=True), None)


def test_every_spelling_of_an_adapter_is_one_key(tmp_path: Path) -> None:
    def key(adapter_id: str, source: str | None = None):
        ref = parse_adapter_ref(adapter_id, source, allow_local=source == "local")
        return AdapterRequest(ref, Caller("acme")).key

    assert len({key(spelling, "local") for spelling in ("tiny", "./tiny", "tiny/../tiny", "tiny/")}) == 1
    assert len({key(spelling, "s3") for spelling in ("s3://bucket/a/b", "bucket/a/b", "bucket/a/b/")}) == 1
    assert key("repo/1@03") == key("repo/1@3") != key("repo/1")
    assert key("tiny", "local") != key("tiny/other", "local")
    # The normalized path is what is looked up, and it still may not leave the root.
    root = tmp_path / "root"
    _adapter_dir(root / "tiny")
    _adapter_dir(tmp_path / "outside")
    source = LocalSource(root)
    assert source.resolve(parse_adapter_ref("x/../tiny", "local", allow_local=True), None) == root / "tiny"
    with pytest.raises(ValidationError):
        source.resolve(parse_adapter_ref("tiny/../../outside", "local", allow_local=True), None)
