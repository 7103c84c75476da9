"""GGUF files of the families beyond Llama (qwen3, gemma3, phi3), written from a random transformers
model of each family as llama.cpp's converter lays them out (tests/engine/gguf_factory.py), served
as they are, against transformers' float32 run of the same file (its `gguf_file=` loader): logprobs
of prompt and generated tokens and greedy tokens, with test_gguf_model.py's tolerances (ATOL on the
PyTorch backend, INT8_ATOL on the compiled one), for a Q8_0 file and (PyTorch backend) for Q4_K_M's
mixture of it (Q4_K, Q6_K); a PEFT adapter in a mixed batch on Phi-3's fused projections; and files that ask
for what transformers' GGUF reader does not take, refused by name."""
from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel

from kernels.quantized import QuantizedWeight
from lora_runtime import Engine, EngineConfig
from lora_runtime.errors import ValidationError
from tests.adapters.peft_factory import peft_model, save_adapter
from tests.engine.gguf_factory import CUT_VOCAB_SIZE, TinyDims, random_hf_model, tensors_from_hf, write_gguf
from tests.engine.test_gguf_model import PROMPTS, _assert_matches, _atol, _generate
from tests.fixtures.k_quants import requantized_gguf

# The embedded tokenizer cut to CUT_VOCAB_SIZE tokens. Rows of 256 weights (whole Q4_K blocks).
# Qwen3's GGUF config reader keeps head_dim 128; Gemma 3's six layers reach its first full-attention
# layer (transformers' default pattern: five sliding, one full), its window shorter than the longer
# prompts plus their new tokens.
VOCAB = CUT_VOCAB_SIZE
FAMILY_DIMS = {
    "qwen3": TinyDims(hidden_size=256, intermediate_size=512, architecture="qwen3", head_size=128, vocab_size=VOCAB),
    "gemma3": TinyDims(hidden_size=256, intermediate_size=512, num_layers=6, architecture="gemma3", head_size=64,
                       sliding_window=5, vocab_size=VOCAB),
    "phi3": TinyDims(hidden_size=256, intermediate_size=512, architecture="phi3", vocab_size=VOCAB),
}
FAMILIES = list(FAMILY_DIMS)


@functools.cache
def _q8_0_file(directory: Path, family: str) -> Path:
    dims = FAMILY_DIMS[family]
    model = random_hf_model(dims, seed=7)
    return write_gguf(directory / f"tiny-{family}-q8_0.gguf", dims, tensors_from_hf(model, dims, "Q8_0"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(family, "Q8_0" or "Q4_K_M") -> the file, written on first use."""
    directory = tmp_path_factory.mktemp("families")

    def file(family: str, scheme: str) -> Path:
        q8_0 = _q8_0_file(directory, family)
        target = directory / f"tiny-{family}-q4_k_m.gguf"
        return q8_0 if scheme == "Q8_0" else target if target.exists() else requantized_gguf(q8_0, target, scheme)

    return file


@functools.cache
def _engine(path: Path, backend: str | None) -> Engine:
    return Engine.from_config(EngineConfig(model=str(path), dtype="float32", kernel_backend=backend))


@functools.cache
def _hf_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


# Greedy tokens equal to transformers' on the PyTorch backend (float32). On the compiled one, whose
# int8 activations move logprobs by up to INT8_ATOL, these random models' near-flat logits have top
# two 3e-4 to 7e-3 apart at some step (seeds 7 to 12, each family): it flipped greedy tokens of 1 to
# 3 families for 5 seeds of those 6, as early as the first new token. There each token it chose is
# held within 2 * INT8_ATOL of transformers' best, and every logprob within INT8_ATOL.
# Q4_K_M on the PyTorch backend only: its K-quant kernels are the Llama file's, tested in
# test_gguf_model.py, and the layouts here are the same for every block type.
AGREEING = {"torch": None, None: 0}


@pytest.mark.parametrize("scheme, backend", [("Q8_0", "torch"), ("Q8_0", None), ("Q4_K_M", "torch")])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_file_matches_transformers(files, family, scheme, backend) -> None:
    path = files(family, scheme)
    engine = _engine(path, backend)
    layer = engine.model.weights.layers[0]
    assert isinstance(layer.qkv.weight, QuantizedWeight) and isinstance(layer.gate_up.weight, QuantizedWeight)
    assert _hf_from_gguf(path).config.model_type == engine.model.shape.model_type
    outputs = _generate(engine)
    _assert_matches(outputs, [_hf_from_gguf(path)] * len(PROMPTS), _atol(backend), AGREEING[backend])
    assert len({tuple(o.token_ids) for o in outputs}) > 1, "distinct prompts must give distinct tokens"


def test_layouts_read_per_family(files) -> None:
    """What each family's layout adds to the Llama block, as read: Gemma 3's norms after both
    sublayers and per-head q/k norms (Qwen3's too); Phi-3's fused tensors, each one part."""
    qwen3, gemma3, phi3 = (_engine(files(family, "Q8_0"), "torch").model.weights.layers[0] for family in FAMILIES)
    assert qwen3.q_norm.shape == (128,) and qwen3.attention_out_norm is None
    assert gemma3.q_norm.shape == (64,) and gemma3.attention_out_norm is not None and gemma3.mlp_out_norm is not None
    assert len(phi3.qkv.weight.parts) == 1 and len(phi3.gate_up.weight.parts) == 1
    assert phi3.q_norm is None


def test_adapter_in_a_mixed_batch_on_phi3_matches_peft(files, tmp_path) -> None:
    """An adapter of every linear module of Phi-3 (its fused qkv_proj and gate_up_proj among them)
    beside requests without one, against PEFT on transformers' model of the same file."""
    path = files("phi3", "Q8_0")
    base = _hf_from_gguf(path)
    config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    adapter_dir = save_adapter(peft_model(base, config, seed=31), tmp_path / "phi3-all")
    reference = PeftModel.from_pretrained(copy.deepcopy(base), str(adapter_dir)).eval()
    with_adapter = [True, False, True, False, True, False]
    outputs = _generate(_engine(path, "torch"), [str(adapter_dir) if a else None for a in with_adapter])
    _assert_matches(outputs, [reference if a else base for a in with_adapter], _atol("torch"))


def _refusal(path: Path) -> str:
    with pytest.raises(ValidationError) as caught:
        Engine.from_config(EngineConfig(model=str(path), dtype="float32"))
    assert caught.value.field == "model" and str(path) in str(caught.value)
    return str(caught.value)


def test_rope_scaling_in_the_metadata_is_refused(tmp_path) -> None:
    """Gemma 3 4B and up: linear RoPE scaling, which transformers' GGUF config reader drops."""
    dims = TinyDims(architecture="gemma3", head_size=16, rope_scaling_factor=8.0, vocab_size=VOCAB)
    tensors = tensors_from_hf(random_hf_model(dims, seed=1), dims, "Q8_0")
    assert "gemma3.rope.scaling.type is 'linear'" in _refusal(write_gguf(tmp_path / "scaled.gguf", dims, tensors))


def test_longrope_factors_are_refused(tmp_path) -> None:
    """Phi-3's 128k files carry LongRoPE's factors as tensors that transformers' reader skips."""
    dims = TinyDims(architecture="phi3", vocab_size=VOCAB)
    tensors = tensors_from_hf(random_hf_model(dims, seed=1), dims, "Q8_0")
    tensors["rope_factors_long.weight"] = "F32", torch.ones(dims.head_dim // 2).numpy()
    assert "tensor rope_factors_long.weight" in _refusal(write_gguf(tmp_path / "longrope.gguf", dims, tensors))


def test_head_size_the_config_reader_does_not_take_is_refused(tmp_path) -> None:
    """A Qwen3 file whose attention.key_length is not the 128 transformers' Qwen3 reader assumes."""
    dims = TinyDims(architecture="qwen3", head_size=32, vocab_size=VOCAB)
    tensors = tensors_from_hf(random_hf_model(dims, seed=1), dims, "Q8_0")
    message = _refusal(write_gguf(tmp_path / "head-32.gguf", dims, tensors))
    assert "qwen3.attention.key_length is 32" in message and "head_dim 128" in message
