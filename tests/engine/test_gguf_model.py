"""GGUF files served as they are, against transformers' float32 run of the same file dequantized
(its `gguf_file=` loader): logprobs of prompt and generated tokens within 1e-4 on the PyTorch backend
(weights dequantized per call), within INT8_ATOL on the compiled CPU backend (whose decode matmuls
quantize x per 32 elements to int8, as llama.cpp's do), and greedy tokens equal, for a Q8_0 file converted from a Hugging Face model and for a file of random K-quant blocks
(Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q8_0 mixed as a Q4_K_M file mixes them); with PEFT adapters in one
mixed batch against PEFT on the dequantized model; a block type without a kernel (Q5_0) widened
once with a warning; and bad files refused naming the file and what in
it is wrong."""
from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel

from kernels.quantized import QuantizedWeight
from lora_runtime import Engine, EngineConfig, SamplingParams
from tests.adapters.peft_factory import peft_model, save_adapter
from tests.engine.gguf_factory import TinyDims, random_tensors, tensors_from_hf, write_gguf

ATOL = 1e-4
# The compiled backend's activation quantization (its kernels' bound: tests/kernels/test_quantized_linear.py)
# moved these tiny random models' logprobs (magnitude ~10) by up to 3e-3 (the Q8_0 file, with adapters)
# and 2.5e-2 (the file of random K-quant blocks, whose random scales make larger weights).
INT8_ATOL = 5e-2
BACKENDS = ["torch", None]
NUM_NEW_TOKENS = 6
PROMPTS = [[5, 17, 33, 9, 60, 2 + i, 77, 1000 + i][: 3 + i % 5] for i in range(6)]
K_QUANT_DIMS = TinyDims(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
K_QUANT_TYPES = {"token_embd": "Q4_K", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K",
                 "attn_output": "Q4_0", "ffn_gate": "Q4_K", "ffn_up": "Q4_1", "ffn_down": "Q8_0"}


@pytest.fixture(scope="module")
def q8_0_file(tmp_path_factory) -> Path:
    from transformers import LlamaForCausalLM

    dims = TinyDims()
    torch.manual_seed(11)
    model = LlamaForCausalLM(dims.hf_config()).eval()
    return write_gguf(tmp_path_factory.mktemp("q8_0") / "tiny-q8_0.gguf", dims, tensors_from_hf(model, dims, "Q8_0"))


@pytest.fixture(scope="module")
def q5_0_file(tmp_path_factory) -> Path:
    """A Q8_0 file whose o and up projections are Q5_0, as llama.cpp's Q4_K_M writes rows that are not
    whole 256-weight blocks: a type our kernels do not multiply, served widened."""
    from gguf import GGMLQuantizationType, quantize
    from transformers import LlamaForCausalLM

    dims = TinyDims()
    torch.manual_seed(11)  # q8_0_file's model
    model = LlamaForCausalLM(dims.hf_config()).eval()
    tensors = tensors_from_hf(model, dims, "Q8_0")
    for name in ("blk.0.attn_output.weight", "blk.1.ffn_up.weight"):
        hf_name = "model.layers.0.self_attn.o_proj" if "attn" in name else "model.layers.1.mlp.up_proj"
        weight = model.get_submodule(hf_name).weight.detach().float().numpy()
        tensors[name] = "Q5_0", quantize(weight, GGMLQuantizationType.Q5_0)
    return write_gguf(tmp_path_factory.mktemp("q5_0") / "tiny-q5_0.gguf", dims, tensors)


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("k-quants") / "tiny-k-quants.gguf"
    return write_gguf(path, K_QUANT_DIMS, random_tensors(K_QUANT_DIMS, K_QUANT_TYPES, seed=5))


@functools.cache
def _engine(path: Path, backend: str | None = None) -> Engine:
    """One engine per file and backend for the module (building the tokenizer from GGUF takes seconds)."""
    return Engine.from_config(EngineConfig(model=str(path), dtype="float32", kernel_backend=backend))


@functools.cache
def _hf_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def _atol(backend: str | None) -> float:
    return ATOL if backend == "torch" else INT8_ATOL


def _assert_matches(outputs, references, atol: float) -> None:
    """Each output's greedy tokens and logprobs (prompt and generated) against its reference model."""
    with torch.no_grad():
        for output, model in zip(outputs, references):
            ids = output.prompt_token_ids + output.token_ids
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
            first = len(output.prompt_token_ids) - 1
            # Greedy: each token the reference's argmax, or (where our logprobs are within atol of the
            # reference's) one whose reference logprob is within 2 atol of it: a tie that close is ours
            # to break either way (x's int8 quantization flips ties of ~1e-3 on these random models).
            steps = logprobs[first:-1]
            best = steps.max(-1).values
            chosen = steps.gather(-1, torch.tensor(output.token_ids)[:, None])[:, 0]
            assert (chosen >= best - 2 * atol).all() and (atol > ATOL or output.token_ids == steps.argmax(-1).tolist())
            expected = [logprobs[first + i, t].item() for i, t in enumerate(output.token_ids)]
            assert [t.logprob for t in output.tokens] == pytest.approx(expected, abs=atol)
            expected_prompt = [logprobs[i, t].item() for i, t in enumerate(output.prompt_token_ids[1:])]
            assert [p.logprob for p in output.prefill][1:] == pytest.approx(expected_prompt, abs=atol)


def _generate(engine: Engine, adapters=None):
    params = SamplingParams(max_new_tokens=NUM_NEW_TOKENS, ignore_eos_token=True, decoder_input_details=True,
                            details=True)
    return engine.generate(PROMPTS, params, adapters=adapters or [None] * len(PROMPTS))


@pytest.mark.parametrize("backend", BACKENDS)
def test_q8_0_file_matches_transformers(q8_0_file, backend) -> None:
    engine = _engine(q8_0_file, backend)
    assert isinstance(engine.model.weights.layers[0].qkv.weight, QuantizedWeight), "kept in its blocks"
    _assert_matches(_generate(engine), [_hf_from_gguf(q8_0_file)] * len(PROMPTS), _atol(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_types_without_a_kernel_are_widened_once_with_a_warning(q5_0_file, backend, caplog) -> None:
    with caplog.at_level("WARNING", logger="lora_runtime.gguf_model"):
        engine = Engine.from_config(EngineConfig(model=str(q5_0_file), dtype="float32", kernel_backend=backend))
    layers = engine.model.weights.layers

    def in_blocks(linear) -> bool:
        return isinstance(getattr(linear, "weight", None), QuantizedWeight)

    assert in_blocks(layers[0].qkv) and in_blocks(layers[1].o)
    assert not in_blocks(layers[0].o), "the whole projection widened"
    assert not in_blocks(layers[1].gate_up), "gate joins its widened up"
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) == 1 and "2 of Q5_0" in warnings[0] and str(q5_0_file) in warnings[0]
    _assert_matches(_generate(engine), [_hf_from_gguf(q5_0_file)] * len(PROMPTS), _atol(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_k_quant_file_matches_transformers(k_quant_file, backend) -> None:
    engine = _engine(k_quant_file, backend)
    qkv = engine.model.weights.layers[0].qkv.weight
    assert [part.block_type.name for part in qkv.parts] == ["Q4_K", "Q5_K", "Q6_K"]
    outputs = _generate(engine)
    _assert_matches(outputs, [_hf_from_gguf(k_quant_file)] * len(PROMPTS), _atol(backend))
    assert len({tuple(o.token_ids) for o in outputs}) > 1, "distinct prompts must give distinct tokens"


def test_tokenizer_and_chat_template_from_the_file(q8_0_file) -> None:
    from transformers import AutoTokenizer

    engine = _engine(q8_0_file)
    theirs = AutoTokenizer.from_pretrained(q8_0_file.parent, gguf_file=q8_0_file.name)
    messages = [{"role": "user", "content": "Hello there"}]
    ours = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHello there<|im_end|>" in ours
    assert engine.tokenizer("Hello there")["input_ids"] == theirs("Hello there")["input_ids"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_adapters_on_the_quantized_model_match_peft(q8_0_file, tmp_path, backend) -> None:
    base = _hf_from_gguf(q8_0_file)
    configs = {"q_v": LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
               "all": LoraConfig(r=4, lora_alpha=32, target_modules="all-linear")}
    dirs = {name: save_adapter(peft_model(base, config, seed=20 + i), tmp_path / name)
            for i, (name, config) in enumerate(configs.items())}
    references = {name: PeftModel.from_pretrained(copy.deepcopy(base), str(path)).eval() for name, path in dirs.items()}
    assignment = ["q_v", None, "all", "q_v", None, "all"]
    outputs = _generate(_engine(q8_0_file, backend), [None if a is None else str(dirs[a]) for a in assignment])
    _assert_matches(outputs, [base if a is None else references[a] for a in assignment], _atol(backend))
    assert outputs[0].token_ids != outputs[1].token_ids or outputs[0].tokens[0].logprob != outputs[1].tokens[0].logprob
