"""Bad GGUF files refused before serving, with an error naming the file and the tensor or key: not a
GGUF file, a truncated one, an unknown architecture, a tensor type neither we nor gguf can read (named,
with the supported list), a tensor whose shape disagrees with the model's, a missing tensor."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lora_runtime import Engine, EngineConfig
from lora_runtime.errors import ValidationError
from tests.engine.gguf_factory import CUT_VOCAB_SIZE, TinyDims, tensors_from_hf, write_gguf

DIMS = TinyDims(vocab_size=CUT_VOCAB_SIZE)


@pytest.fixture(scope="module")
def good_tensors():
    from transformers import LlamaForCausalLM

    torch.manual_seed(2)
    return tensors_from_hf(LlamaForCausalLM(DIMS.hf_config()).eval(), DIMS, "Q8_0")


@pytest.fixture(scope="module")
def good_file(tmp_path_factory, good_tensors) -> Path:
    return write_gguf(tmp_path_factory.mktemp("good") / "good.gguf", DIMS, good_tensors)


def _refusal(path: Path) -> str:
    with pytest.raises(ValidationError) as caught:
        Engine.from_config(EngineConfig(model=str(path), dtype="float32"))
    assert caught.value.field == "model" and str(path) in str(caught.value)
    return str(caught.value)


def test_not_a_gguf_file(tmp_path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a GGUF file at all" * 10)
    assert "not a readable GGUF file" in _refusal(path)


def test_truncated_file(tmp_path, good_file) -> None:
    path = tmp_path / "truncated.gguf"
    path.write_bytes(good_file.read_bytes()[:-5000])
    assert "truncated" in _refusal(path)


def test_unknown_architecture(tmp_path, good_tensors) -> None:
    message = _refusal(write_gguf(tmp_path / "falcon.gguf", DIMS, good_tensors, architecture="falcon"))
    assert "general.architecture 'falcon'" in message and "llama" in message


def test_unsupported_tensor_type_named_with_the_supported_list(tmp_path, good_tensors) -> None:
    """Q8_1 (llama.cpp's activation type): neither our kernels nor gguf's dequantization read it."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    rows, cols = DIMS.projection_shape("ffn_up")
    block_weights, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1]
    q8_1 = np.random.default_rng(0).integers(0, 127, (rows, cols // block_weights * block_bytes), dtype=np.uint8)
    tensors = dict(good_tensors, **{"blk.1.ffn_up.weight": ("Q8_1", q8_1)})
    message = _refusal(write_gguf(tmp_path / "q8_1.gguf", DIMS, tensors))
    assert "blk.1.ffn_up.weight" in message and "Q8_1" in message and "Q4_K" in message and "Q8_0" in message


def test_tensor_shape_disagreeing_with_the_model(tmp_path, good_tensors) -> None:
    type_name, blocks = good_tensors["blk.0.attn_k.weight"]
    tensors = dict(good_tensors, **{"blk.0.attn_k.weight": (type_name, blocks[:-2])})
    message = _refusal(write_gguf(tmp_path / "short-k.gguf", DIMS, tensors))
    assert "blk.0.attn_k.weight" in message and "shape" in message


def test_tensor_size_disagreeing_with_its_type_and_shape(tmp_path, good_tensors) -> None:
    """The header says 64 float32 norm weights (256 bytes) where the file holds 32 before the next
    tensor: the reader would hand the norm the next tensor's bytes."""
    _, norm = good_tensors["blk.0.ffn_norm.weight"]
    tensors = dict(good_tensors, **{"blk.0.ffn_norm.weight": ("F32", norm[:32], (DIMS.hidden_size,))})
    message = _refusal(write_gguf(tmp_path / "short-norm.gguf", DIMS, tensors))
    assert "blk.0.ffn_norm.weight" in message and "needs 256 bytes" in message and "holds 128" in message


def test_missing_tensor(tmp_path, good_tensors) -> None:
    tensors = {name: tensor for name, tensor in good_tensors.items() if name != "blk.1.ffn_norm.weight"}
    message = _refusal(write_gguf(tmp_path / "no-norm.gguf", DIMS, tensors))
    assert "blk.1.ffn_norm.weight" in message and "missing" in message
