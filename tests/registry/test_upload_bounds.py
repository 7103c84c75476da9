"""The bounds of an upload (issue 41 item 2), through the upload service on SQLite and PostgreSQL:
files and checkpoints of one upload, the size of each file by its kind (weights by the base model's
shape, checked against files PEFT writes), the bytes of one upload and of a tenant's unfinished
uploads, a tenant's open uploads, and no PUT to a finished upload."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from lora_runtime.engine_info import AdapterLimits, BaseModelShape
from lora_runtime.errors import ValidationError
from server.errors import STATUS_OF_ERROR_TYPE
from server.registry.errors import PayloadTooLargeError, TooManyUploadsError, UploadNotFoundError
from server.registry.service import AdapterRegistry
from server.registry.upload_bounds import CONFIG_MAX_BYTES, weights_max_bytes
from server.registry.signing import UrlSigner
from server.registry.uploads import FileAdmission, UploadConfig, UploadService
from tests.registry.conftest import adapter_only, put_via_url

_LLAMA = dict(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
_SIGNER = UrlSigner(b"b" * 32)
_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _service(registry: AdapterRegistry, **bounds: int) -> UploadService:
    config = dataclasses.replace(UploadConfig(public_base_url="http://127.0.0.1:8080"), **bounds)
    return UploadService(registry, _SIGNER, config)


def _peft_weights_file(directory: Path, rank: int, safe_serialization: bool) -> Path:
    """PEFT's own weights file of a rank-`rank` LoRA on every projection of every layer, in float32."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(LlamaConfig(**_LLAMA)),
                           LoraConfig(r=rank, target_modules=_MODULES, init_lora_weights=False))
    model.save_pretrained(directory, safe_serialization=safe_serialization, save_embedding_layers=False)
    return directory / ("adapter_model.safetensors" if safe_serialization else "adapter_model.bin")


@pytest.mark.parametrize("safe_serialization", [True, False])
def test_the_weights_bound_holds_peft_files_at_the_largest_rank_and_not_at_twice_it(
    tmp_path: Path, safe_serialization: bool
) -> None:
    shape = BaseModelShape.from_hf_config("test/llama", _LLAMA)
    bound = weights_max_bytes(shape, AdapterLimits(max_rank=16))
    largest = _peft_weights_file(tmp_path / "r16", 16, safe_serialization).stat().st_size
    too_large = _peft_weights_file(tmp_path / "r32", 32, safe_serialization).stat().st_size
    assert largest <= bound < too_large
    assert weights_max_bytes(shape, AdapterLimits(max_rank=16, max_bytes=1000)) < largest  # max_bytes caps it


def test_an_upload_names_a_bounded_number_of_files_and_checkpoints(registry: AdapterRegistry) -> None:
    uploads = _service(registry, max_upload_files=8)
    checkpoint_files = [f"checkpoint-{n}/adapter_config.json" for n in range(6)]
    with pytest.raises(ValidationError, match="^files: an upload names at most 8 files, got 9"):
        uploads.start_upload("t1", "alice", "news", files=checkpoint_files)
    uploads = dataclasses.replace(uploads, registry=dataclasses.replace(registry, max_checkpoints=2))
    with pytest.raises(ValidationError, match="^files: a version has at most 2 checkpoint folders, got 3"):
        uploads.start_upload("t1", "alice", "news", files=checkpoint_files[:3])
    assert len(uploads.start_upload("t1", "alice", "news", files=checkpoint_files[:2]).presigned_urls) == 5


def test_each_file_is_bounded_by_its_kind(registry: AdapterRegistry, peft_files: dict[str, dict[str, bytes]]) -> None:
    uploads = _service(registry, weights_max_bytes=4096)
    urls = uploads.start_upload("t1", "alice", "news", files=["tokenizer.json"]).presigned_urls
    config_refusal = f"^adapter_config.json: an adapter config holds at most {CONFIG_MAX_BYTES}"
    with pytest.raises(PayloadTooLargeError, match=config_refusal):
        put_via_url(uploads, urls["adapter_config.json"], b" " * (CONFIG_MAX_BYTES + 1))
    with pytest.raises(PayloadTooLargeError, match="^adapter_model.bin: adapter weights .* at most 4096 bytes"):
        put_via_url(uploads, urls["adapter_model.bin"], b"\0" * 4097)
    assert put_via_url(uploads, urls["tokenizer.json"], b"{}" * 4096) == 8192  # tokenizers are larger
    assert put_via_url(uploads, urls["adapter_model.safetensors"], b"\0" * 4096) == 4096
    assert registry.blobs.list("uploads") == {f"{_upload_id(urls)}/tokenizer.json": 8192,
                                               f"{_upload_id(urls)}/adapter_model.safetensors": 4096}


def _upload_id(urls: dict[str, str]) -> str:
    return urls["adapter_config.json"].split("/")[-2]


def test_an_upload_and_a_tenant_stage_bounded_bytes(registry: AdapterRegistry) -> None:
    uploads = _service(registry, max_upload_bytes=10_000, max_staged_upload_bytes=15_000)
    first = uploads.start_upload("t1", "alice", "news", files=["tokenizer.json", "vocab.json"]).presigned_urls
    put_via_url(uploads, first["tokenizer.json"], b"x" * 6000)
    put_via_url(uploads, first["tokenizer.json"], b"x" * 6000)  # a file PUT again replaces its staged copy
    upload_refusal = "^vocab.json: the files of one upload together hold at most 10000 bytes, 6000"
    with pytest.raises(PayloadTooLargeError, match=upload_refusal):
        put_via_url(uploads, first["vocab.json"], b"x" * 4001)
    put_via_url(uploads, first["vocab.json"], b"x" * 4000)
    second = uploads.start_upload("t1", "alice", "other", files=["tokenizer.json"]).presigned_urls
    tenant_refusal = "^tokenizer.json: the staged files of tenant 't1'.* 15000 bytes, 10000"
    with pytest.raises(PayloadTooLargeError, match=tenant_refusal):
        put_via_url(uploads, second["tokenizer.json"], b"x" * 5001)
    another_tenant = uploads.start_upload("t2", "bob", "news", files=["tokenizer.json"]).presigned_urls
    assert put_via_url(uploads, another_tenant["tokenizer.json"], b"x" * 9000) == 9000


def test_bytes_of_puts_in_flight_are_reserved(registry: AdapterRegistry) -> None:
    """A PUT in flight holds its Content-Length, or without one its whole bound, until released."""
    uploads = _service(registry, max_staged_upload_bytes=100_000)
    urls = uploads.start_upload("t1", "alice", "news", files=["tokenizer.json", "vocab.json"]).presigned_urls
    declared = [_admit(uploads, urls["tokenizer.json"], 60_000), _admit(uploads, urls["vocab.json"], 40_000)]
    assert [a.bound.max_bytes for a in declared] == [60_000, 40_000]
    with pytest.raises(PayloadTooLargeError, match="staged files of tenant 't1'.* 100000 of them taken"):
        _admit(uploads, urls["adapter_config.json"], 1)
    for admission in declared:
        uploads.release(admission)
    undeclared = _admit(uploads, urls["tokenizer.json"])
    assert undeclared.bound.max_bytes == 100_000
    assert _admit(uploads, urls["vocab.json"]).bound.max_bytes == 0
    uploads.release(undeclared)
    assert _admit(uploads, urls["adapter_config.json"]).bound.max_bytes == CONFIG_MAX_BYTES


def _admit(uploads: UploadService, url: str, declared_bytes: int | None = None) -> FileAdmission:
    query = parse_qs(urlsplit(url).query)
    upload_id, name = urlsplit(url).path.split("/")[-2:]
    return uploads.admit_file(upload_id, name, query["expires"][0], query["signature"][0], declared_bytes)


def test_a_tenant_has_a_bounded_number_of_open_uploads(
    registry: AdapterRegistry, peft_files: dict[str, dict[str, bytes]]
) -> None:
    uploads = _service(registry, max_open_uploads=2)
    started = [uploads.start_upload("t1", "alice", "news") for _ in range(2)]
    with pytest.raises(TooManyUploadsError, match="^tenant 't1' has 2 uploads open") as refused:
        uploads.start_upload("t1", "alice", "news")
    assert refused.value.error_type == "too_many_uploads" and STATUS_OF_ERROR_TYPE[refused.value.error_type] == 429
    uploads.start_upload("t2", "bob", "news")  # another tenant's bound is its own
    for name, data in adapter_only(peft_files["a"]).items():
        put_via_url(uploads, started[0].presigned_urls[name], data)
    uploads.finish_upload("t1", started[0].upload_token)
    uploads.start_upload("t1", "alice", "news")  # a finished upload is no longer open


def test_a_finished_upload_takes_no_more_files(
    registry: AdapterRegistry, peft_files: dict[str, dict[str, bytes]]
) -> None:
    uploads = _service(registry)
    start = uploads.start_upload("t1", "alice", "news")
    for name, data in adapter_only(peft_files["a"]).items():
        put_via_url(uploads, start.presigned_urls[name], data)
    uploads.finish_upload("t1", start.upload_token)
    with pytest.raises(UploadNotFoundError):  # its URLs are still signed, but would stage files for ever
        put_via_url(uploads, start.presigned_urls["adapter_config.json"], b"{}")
    assert registry.blobs.list("uploads") == {}
