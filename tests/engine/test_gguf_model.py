"""GGUF files served as they are, against transformers' float32 run of the same file dequantized
(its `gguf_file=` loader): logprobs of prompt and generated tokens within 1e-4 on the PyTorch backend
(weights dequantized per call), within INT8_ATOL on the compiled CPU backend (whose decode matmuls
quantize x per 32 elements to int8, as llama.cpp's do), and greedy tokens equal, for a Q8_0 file
converted from a Hugging Face model and for a file of random K-quant blocks (Q4_K, Q5_K, Q6_K, Q4_0,
Q4_1, Q8_0 mixed as a Q4_K_M file mixes them); with PEFT adapters in one mixed batch against PEFT on
the dequantized model, for the Q8_0 file and for a Hugging Face model's weights quantized as Q4_K_M
mixes Q4_K and Q6_K (tests/fixtures/k_quants.py); a block type without a kernel (Q5_0) widened once
with a warning; and bad files refused naming the file and what in it is wrong."""
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
from tests.engine.gguf_factory import CUT_VOCAB_SIZE, TinyDims, random_tensors, tensors_from_hf, write_gguf
from tests.fixtures.k_quants import requantized_gguf

ATOL = 1e-4
# The compiled backend's activation quantization (its kernels' bound: tests/kernels/test_quantized_linear.py)
# moved these tiny random models' logprobs (magnitude ~10) by up to 3e-3 (the Q8_0 file, with adapters)
# and 1.8e-2 (the file of random K-quant blocks, whose random scales make larger weights).
INT8_ATOL = 5e-2
BACKENDS = ["torch", None]
NUM_NEW_TOKENS = 6
PROMPTS = [[5, 17, 33, 9, 60, 2 + i, 77, 1000 + i][: 3 + i % 5] for i in range(6)]
# The K-quant files carry the embedded tokenizer cut to CUT_VOCAB_SIZE tokens (the whole one's 49k
# took the engine ~22 s and transformers ~16 s a file on a busy 2-core machine).
K_QUANT_DIMS = TinyDims(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                        vocab_size=CUT_VOCAB_SIZE)
# Greedy tokens with adapters on the Q4_K_M file, and how many of them must equal PEFT's on the file
# dequantized: all on the PyTorch backend (float32; 16 of 16 for every sequence of seeds 11, 12 and
# 13); the first 4 on the compiled one, whose int8 activations moved these tiny random models'
# logprobs by up to INT8_ATOL while their top two logprobs were at times 1e-3 apart: it agreed on 4
# to 16 tokens a sequence (seed 11: 15, 4 and 8 on three of six, 16 on the rest; seed 12: 13 on one;
# seed 13: 12 on one), each
# token it chose within 2 * INT8_ATOL of PEFT's best. Seed 11 is the Q8_0 file's, not picked.
Q4_K_M_NEW_TOKENS = 16
Q4_K_M_AGREEING = {"torch": Q4_K_M_NEW_TOKENS, None: 4}
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
    torch.manual_seed(11)  # q8_0_file's model: its greedy tokens have no near-tie the int8 path could flip
    model = LlamaForCausalLM(dims.hf_config()).eval()
    tensors = tensors_from_hf(model, dims, "Q8_0")
    for name in ("blk.0.attn_output.weight", "blk.1.ffn_up.weight"):
        hf_name = "model.layers.0.self_attn.o_proj" if "attn" in name else "model.layers.1.mlp.up_proj"
        weight = model.get_submodule(hf_name).weight.detach().float().numpy()
        tensors[name] = "Q5_0", quantize(weight, GGMLQuantizationType.Q5_0)
    return write_gguf(tmp_path_factory.mktemp("q5_0") / "tiny-q5_0.gguf", dims, tensors)


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory) -> Path:
    """A random Hugging Face Llama's weights (whole 256-weight blocks) quantized as llama-quantize's
    Q4_K_M mixes types: Q6_K for the output and layer 1's attn_v and ffn_down, Q4_K elsewhere."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(11)
    model = LlamaForCausalLM(K_QUANT_DIMS.hf_config()).eval()
    directory = tmp_path_factory.mktemp("q4_k_m")
    source = write_gguf(directory / "tiny-f32.gguf", K_QUANT_DIMS, tensors_from_hf(model, K_QUANT_DIMS, "F32"))
    return requantized_gguf(source, directory / "tiny-q4_k_m.gguf", "Q4_K_M")


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


def _assert_matches(outputs, references, atol: float, agreeing: int | None = None) -> None:
    """Each output's greedy tokens and logprobs (prompt and generated) against its reference model, run
    on the output's tokens. Greedy tokens equal: all, or the first `agreeing`, each later one at least
    within 2 * atol of the reference's best (a near-tie the backend's rounding may flip)."""
    with torch.no_grad():
        for output, model in zip(outputs, references):
            ids = output.prompt_token_ids + output.token_ids
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
            first = len(output.prompt_token_ids) - 1
            assert output.token_ids[:agreeing] == logprobs[first:-1].argmax(-1).tolist()[:agreeing]
            chosen = logprobs[first:-1].gather(1, torch.tensor([output.token_ids]).T).squeeze(1)
            assert bool((chosen >= logprobs[first:-1].amax(-1) - 2 * atol).all())
            expected = [logprobs[first + i, t].item() for i, t in enumerate(output.token_ids)]
            assert [t.logprob for t in output.tokens] == pytest.approx(expected, abs=atol)
            expected_prompt = [logprobs[i, t].item() for i, t in enumerate(output.prompt_token_ids[1:])]
            assert [p.logprob for p in output.prefill][1:] == pytest.approx(expected_prompt, abs=atol)


def _generate(engine: Engine, adapters=None, max_new_tokens: int = NUM_NEW_TOKENS):
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos_token=True, decoder_input_details=True,
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
    # The compiled backend's first 4 tokens: its Q8_0 matmuls on AMX-INT8 tiles (kernels/tuning.py) sum in
    # another order than the int8 dot products, and flipped the fifth token of one sequence of six
    # (the reference's top two 9.5e-4 apart, our logprob 5.2e-4 from the reference's).
    _assert_matches(_generate(engine), [_hf_from_gguf(q5_0_file)] * len(PROMPTS), _atol(backend),
                    None if backend == "torch" else 4)


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


def _adapters_in_one_batch(path: Path, directory: Path, backend: str | None, max_new_tokens: int = NUM_NEW_TOKENS):
    """The six prompts through our engine on the file in one batch, base and two PEFT adapters mixed
    (made on transformers' float32 model of the file dequantized); each output with its reference."""
    base = _hf_from_gguf(path)
    configs = {"q_v": LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
               "all": LoraConfig(r=4, lora_alpha=32, target_modules="all-linear")}
    dirs = {name: save_adapter(peft_model(base, config, seed=20 + i), directory / name)
            for i, (name, config) in enumerate(configs.items())}
    references = {name: PeftModel.from_pretrained(copy.deepcopy(base), str(path)).eval() for name, path in dirs.items()}
    assignment = ["q_v", None, "all", "q_v", None, "all"]
    outputs = _generate(_engine(path, backend), [None if a is None else str(dirs[a]) for a in assignment],
                        max_new_tokens)
    assert outputs[0].token_ids != outputs[1].token_ids or outputs[0].tokens[0].logprob != outputs[1].tokens[0].logprob
    return outputs, [base if a is None else references[a] for a in assignment]


@pytest.mark.parametrize("backend", BACKENDS)
def test_adapters_on_the_quantized_model_match_peft(q8_0_file, tmp_path, backend) -> None:
    _assert_matches(*_adapters_in_one_batch(q8_0_file, tmp_path, backend), _atol(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_adapters_on_a_q4_k_m_file_match_peft(q4_k_m_file, tmp_path, backend) -> None:
    qkv = _engine(q4_k_m_file, backend).model.weights.layers[1].qkv.weight
    assert [part.block_type.name for part in qkv.parts] == ["Q4_K", "Q6_K"], "v widened in layer 1"
    outputs, references = _adapters_in_one_batch(q4_k_m_file, tmp_path, backend, Q4_K_M_NEW_TOKENS)
    _assert_matches(outputs, references, _atol(backend), Q4_K_M_AGREEING[backend])
