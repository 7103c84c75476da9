"""What a model served from a GGUF file holds: its tensors as the file stores them, nothing more. The
token embedding stays in its blocks (it was once widened to a dense table, 525 MB in bf16 for
Llama-3.2-1B's vocabulary beside the head's ~215 MB of Q6_K); tied, the head's one copy is the
embedding, and the rows a lookup reads are `gguf.quants.dequantize` of those rows, rounded once to the
model's dtype. In float32 (the file's norms are F32) the bytes held equal the file's tensor bytes, and
the memory budget's estimate of them (memory_budget.py); greedy tokens and logprobs against
transformers' float32 run of the file as tests/engine/test_gguf_model.py checks them."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from lora_runtime import Engine, EngineConfig
from lora_runtime.memory_budget import gguf_weights_bytes
from tests.engine.gguf_factory import TinyDims, tensors_from_hf, write_gguf
from tests.engine.test_gguf_model import BACKENDS, PROMPTS, _assert_matches, _atol, _generate, _hf_from_gguf

IDS = torch.tensor([0, 49151, 17, 1000, 17])


def held_storages(obj: object) -> dict[int, int]:
    """The bytes of each storage (by address) a model's weights reach through their slots, lists and
    tuples: a view counts its whole storage, a tensor held twice once."""
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        return {storage.data_ptr(): storage.nbytes()}
    if isinstance(obj, (list, tuple)):
        return {ptr: size for item in obj for ptr, size in held_storages(item).items()}
    names = {name for cls in type(obj).__mro__ for name in getattr(cls, "__slots__", ())}
    parts = [getattr(obj, name) for name in names if hasattr(obj, name)]
    return {ptr: size for part in parts for ptr, size in held_storages(part).items()}


def _file_tensor_bytes(path: Path) -> int:
    return sum(int(tensor.n_bytes) for tensor in GGUFReader(path).tensors)


@pytest.fixture(scope="module")
def tied_file(tmp_path_factory) -> Path:
    """A Q8_0 file without output.weight: llama.cpp's converter writes a tied model so."""
    from transformers import LlamaForCausalLM

    dims = TinyDims()
    torch.manual_seed(11)
    model = LlamaForCausalLM(dims.hf_config()).eval()
    tensors = tensors_from_hf(model, dims, "Q8_0")
    del tensors["output.weight"]
    return write_gguf(tmp_path_factory.mktemp("tied") / "tiny-tied-q8_0.gguf", dims, tensors)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tied_gguf_model_holds_the_files_tensors_and_no_dense_embedding(tied_file, backend) -> None:
    engine = Engine.from_config(EngineConfig(model=str(tied_file), dtype="float32", kernel_backend=backend))
    weights = engine.model.weights
    assert weights.embed_tokens is None, "tied: the head's blocks are the embedding"
    held = sum(held_storages(weights).values())
    assert held == _file_tensor_bytes(tied_file) == gguf_weights_bytes(tied_file, "float32")
    token_embd = next(tensor for tensor in GGUFReader(tied_file).tensors if tensor.name == "token_embd.weight")
    table = torch.from_numpy(np.ascontiguousarray(dequantize(token_embd.data, token_embd.tensor_type)))
    for dtype in (torch.float32, torch.bfloat16):
        rows = weights.lm_head.rows(IDS, dtype)
        assert torch.equal(rows, table[IDS].to(dtype)), "gguf's rows, rounded once"
    _assert_matches(_generate(engine), [_hf_from_gguf(tied_file)] * len(PROMPTS), _atol(backend))
