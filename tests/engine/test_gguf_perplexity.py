"""Model quality on a quantized GGUF file: our engine's perplexity over a fixed English text of 2,048
tokens (tests/fixtures/texts/declaration.txt: public-domain American documents) within 1% of
transformers' float32 run of the same file dequantized (its `gguf_file=` loader), for the embedded
SmolLM2-135M-Instruct re-quantized to Q8_0 and to Q4_K_M's mixture (tests/fixtures/k_quants.py:
Q4_K and Q6_K where rows are whole 256-weight blocks, Q8_0 and Q4_0 where they are not).

Ours runs as it serves by default (dtype "auto", the compiled backend: bf16 activations where this
CPU multiplies bf16 fast, int8 activation blocks in the quantized matmuls), so the 1% covers every
rounding of the serving path, not only the dequantization.

Slow: the real model's GGUF read four times (ours, transformers' config, tokenizer and weights) and
2,048 tokens through 30 layers twice took 7.5 minutes per file on a busy 2-core machine."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lora_runtime import Engine, EngineConfig, SamplingParams
from lora_runtime.embedded import gguf_path
from tests.fixtures.k_quants import requantized_gguf

TEXT = Path(__file__).resolve().parents[1] / "fixtures" / "texts" / "declaration.txt"
NUM_TOKENS = 2048
RELATIVE_TOLERANCE = 0.01  # the bound on perplexity
# A sane perplexity for a 135M instruction model on formal 18th-century English: far below the
# vocabulary's 49152 (a broken model), above 1 (a text it had memorised would say little).
PLAUSIBLE = (2.0, 60.0)


@pytest.fixture(scope="module")
def token_ids() -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path().parent, gguf_file=gguf_path().name)
    ids = tokenizer(TEXT.read_text(), add_special_tokens=False)["input_ids"]
    assert len(ids) >= NUM_TOKENS
    return ids[:NUM_TOKENS]


def perplexity_ours(path: Path, ids: list[int]) -> float:
    engine = Engine.from_config(EngineConfig(model=str(path)))
    params = SamplingParams(max_new_tokens=1, decoder_input_details=True)
    (output,) = engine.generate([ids], params)
    logprobs = [token.logprob for token in output.prefill[1:]]  # the first token has no context
    assert len(logprobs) == len(ids) - 1
    return math.exp(-sum(logprobs) / len(logprobs))


def perplexity_transformers(path: Path, ids: list[int]) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
    return math.exp(nll.item())


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["Q8_0", "Q4_K_M"])
def test_perplexity_within_one_percent_of_transformers(tmp_path, token_ids, scheme) -> None:
    path = requantized_gguf(gguf_path(), tmp_path / f"smollm2-135m-{scheme}.gguf", scheme)
    ours, theirs = perplexity_ours(path, token_ids), perplexity_transformers(path, token_ids)
    assert PLAUSIBLE[0] < theirs < PLAUSIBLE[1]
    assert ours == pytest.approx(theirs, rel=RELATIVE_TOLERANCE)
