"""What a loaded model holds: each projection once (in its backend's layout, no second copy for large
batches), nothing of the checkpoint's files (no tensor a view of a mapped file, no mapping left), and
a checkpoint that lies about its tensors refused by name, naming the file."""
from __future__ import annotations

import logging
import struct
from pathlib import Path

import pytest
import torch

import kernels
from lora_runtime.checkpoint import empty_buffer
from lora_runtime.errors import ValidationError
from lora_runtime.loader import load_model
from tests.engine.factories import TINY_DIMS, save_tiny_model

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _held_tensors(obj: object, depth: int = 0) -> list[torch.Tensor]:
    """Every tensor an object of slots (a projection) holds, through its slotted parts."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth > 4 or obj is None or isinstance(obj, (str, int, float)):
        return []
    names = {name for cls in type(obj).__mro__ for name in getattr(cls, "__slots__", ())}
    return [t for name in names if hasattr(obj, name) for t in _held_tensors(getattr(obj, name), depth + 1)]


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)  # oneDNN's opaque tensors have no storage


def _mapped_ranges(files: list[Path]) -> list[tuple[int, int]]:
    """This process's memory mappings of `files` (/proc/self/maps)."""
    names = {str(path.resolve()) for path in files}
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] in names:
            begin, end = (int(value, 16) for value in fields[0].split("-"))
            ranges.append((begin, end))
    return ranges


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_each_projection_is_held_once_and_nothing_of_the_checkpoint(tmp_path, backend_name: str, dtype: str) -> None:
    """In the checkpoint's dtype (float32) and another (bf16), in the compiled kernels' layouts and
    plain: the layers' projections hold exactly the bytes of the checkpoint's projections in the model
    dtype (the AMX form once kept a oneDNN copy beside its own for large batches), and no mapping of
    the checkpoint is left (safetensors' own reader left the model's float32 tensors views of the
    mapped file, and the pages read resident with them)."""
    hf_model = save_tiny_model("llama-tied", tmp_path)
    model = load_model(tmp_path, dtype, "cpu", kernels.backend_for("cpu", backend_name))
    held = _bytes([t for layer in model.weights.layers for name in ("qkv", "o", "gate_up", "down")
                   for t in _held_tensors(getattr(layer, name))])
    expected = sum(param.numel() * getattr(torch, dtype).itemsize for name, param in hf_model.named_parameters()
                   if name.rsplit(".", 2)[-2] in PROJECTIONS)
    assert held == expected
    assert _mapped_ranges(list(tmp_path.glob("*.safetensors"))) == []


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_a_tied_embedding_is_held_once(tmp_path, backend_name: str) -> None:
    """A tied head and the embedding are one tensor in memory: in a kernel's layout the embedding's rows
    are read from the head (the head's packed copy once sat beside the plain embedding), plainly both
    are the same tensor; either way they are the checkpoint's rows."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(3)
    hf_model = AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY_DIMS, "vocab_size": 128}, tie_word_embeddings=True))
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    weights = load_model(tmp_path, "bfloat16", "cpu", kernels.backend_for("cpu", backend_name)).weights
    tensors = {t.data_ptr(): t for t in _held_tensors(weights.lm_head) + [weights.embed_tokens] if t is not None}
    assert _bytes(list(tensors.values())) == 128 * TINY_DIMS["hidden_size"] * 2
    ids = torch.tensor([5, 127, 0, 5, 64])
    expected = hf_model.model.embed_tokens.weight.detach()[ids].to(torch.bfloat16)
    rows = weights.lm_head.rows(ids) if weights.embed_tokens is None else weights.embed_tokens[ids]
    assert torch.equal(rows, expected)


def test_a_large_batch_computes_from_the_one_copy(tmp_path) -> None:
    """A prefill-sized batch (past the decode sizes the compiled kernels were tuned for) through a
    loaded projection: x @ W.T, from the same packed weight a decode step reads."""
    hf_model = save_tiny_model("llama", tmp_path)
    model = load_model(tmp_path, "bfloat16", "cpu", kernels.backend_for("cpu", "cpu"))
    down = model.weights.layers[0].down
    weight = hf_model.model.layers[0].mlp.down_proj.weight.detach().to(torch.bfloat16)
    x = torch.randn(300, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    expected = (x.float() @ weight.float().T).to(torch.bfloat16)
    torch.testing.assert_close(down(x), expected, atol=2e-2, rtol=1e-2)


def test_loading_writes_no_progress_where_nobody_watches(tmp_path, capfd) -> None:
    """Captured stderr is no terminal: no bar (tests and logs stay clean); at DEBUG the bar is shown."""
    save_tiny_model("llama", tmp_path)
    capfd.readouterr()  # transformers' own bar, while saving
    load_model(tmp_path, "float32", "cpu", kernels.backend_for("cpu", "torch"))
    assert capfd.readouterr().err == ""
    logger = logging.getLogger("lora_runtime.checkpoint")
    previous = logger.level
    try:
        logger.setLevel(logging.DEBUG)
        load_model(tmp_path, "float32", "cpu", kernels.backend_for("cpu", "torch"))
    finally:
        logger.setLevel(previous)
    assert f"loading {tmp_path.name}" in capfd.readouterr().err


def _write_raw(path: Path, header: bytes, data: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize("header,data,named", [
    (b'{"w": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 32]}}', b"\0" * 16, "data_offsets"),
    (b'{"w": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 30]}}', b"\0" * 32, "data_offsets"),
    (b'{"w": {"dtype": "C64", "shape": [4], "data_offsets": [0, 32]}}', b"\0" * 32, "'C64'"),
    (b'{"w": [1, 2]}', b"", "malformed"),
    (b"not json", b"", "header is not JSON"),
    (b"[1, 2]", b"", "header is not a JSON object"),
])
def test_a_checkpoint_that_lies_about_its_tensors_is_refused_naming_the_file(tmp_path, header, data, named) -> None:
    save_tiny_model("llama", tmp_path)
    _write_raw(tmp_path / "extra.safetensors", header, data)
    with pytest.raises(ValidationError) as error:
        load_model(tmp_path, "float32", "cpu", kernels.backend_for("cpu", "torch"))
    assert "extra.safetensors" in str(error.value) and named in str(error.value)


def test_an_index_naming_a_missing_shard_is_refused_by_its_name(tmp_path) -> None:
    save_tiny_model("llama", tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}')
    with pytest.raises(ValidationError, match="model-00001-of-00002.safetensors"):
        load_model(tmp_path, "float32", "cpu", kernels.backend_for("cpu", "torch"))


def _mapping_at(address: int) -> tuple[int, int] | None:
    for line in Path("/proc/self/maps").read_text().splitlines():
        begin, end = (int(value, 16) for value in line.split()[0].split("-"))
        if begin <= address < end:
            return begin, end
    return None


def test_a_read_buffer_is_returned_to_the_system_when_freed() -> None:
    """A weight's read buffer (freed once the backend has laid the weight out) is a mapping of its own,
    unmapped with the tensor: the allocator's heap kept 178 MiB of them after loading Llama-3.2-1B's
    shape."""
    buffer = empty_buffer((1024, 1024), torch.bfloat16)
    address = buffer.data_ptr()
    buffer.fill_(1.0)
    assert _mapping_at(address) is not None
    del buffer  # the kernel may have merged the mapping with a neighbour: its pages go all the same
    assert _mapping_at(address) is None and _mapping_at(address + 2**21 - 1) is None
