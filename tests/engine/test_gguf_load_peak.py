"""The GGUF load's peak memory: gguf's reader keeps a numpy view per element of every metadata array
(Llama 3's tokenizer: ~400k strings, ~350 MB of objects) for as long as it lives, and our tensor reader
lives through the weights' load; it keeps only the scalar keys it reads, the tokenizer being
transformers' to read. Measured on a 2-layer Llama-3.2-1B-shape Q8_0 file: peak RSS 1838 -> 1286 MiB."""
from __future__ import annotations

import torch
from gguf import GGUFReader, GGUFValueType
from transformers import LlamaForCausalLM

from lora_runtime.gguf_model import GGUFTensors
from tests.engine.gguf_factory import TinyDims, tensors_from_hf, write_gguf


def test_the_tensor_reader_holds_no_metadata_array_but_every_scalar_key(tmp_path) -> None:
    dims = TinyDims()
    torch.manual_seed(3)
    tensors = tensors_from_hf(LlamaForCausalLM(dims.hf_config()).eval(), dims, "Q8_0")
    path = write_gguf(tmp_path / "tiny-q8_0.gguf", dims, tensors)
    fields = GGUFReader(path).fields
    arrays = {key for key, field in fields.items() if field.types[0] == GGUFValueType.ARRAY}
    assert "tokenizer.ggml.tokens" in arrays, "the file must carry the arrays this test is about"

    file = GGUFTensors(path, torch.float32, "cpu")

    kept = file._reader.fields
    assert set(kept) == set(fields) - arrays
    assert all(kept[key].contents() == fields[key].contents() for key in kept)


def test_the_config_is_read_once_per_file_version(tmp_path) -> None:
    """The memory budget and the load both need the config; each transformers read parses the whole
    metadata, so it is read once for a file, and again when the file changes."""
    import os

    from lora_runtime.gguf_model import gguf_config

    dims = TinyDims()
    torch.manual_seed(3)
    tensors = tensors_from_hf(LlamaForCausalLM(dims.hf_config()).eval(), dims, "Q8_0")
    path = write_gguf(tmp_path / "tiny-q8_0.gguf", dims, tensors)

    first = gguf_config(path)
    assert gguf_config(path) is first
    assert first.num_hidden_layers == dims.num_layers
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert gguf_config(path) is not first
