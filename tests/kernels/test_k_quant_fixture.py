"""The test K-quant quantizer (tests/fixtures/k_quants.py) against gguf's own decoder: every weight of
Q4_K and Q6_K blocks it writes decodes, by `gguf.quants.dequantize`, within half of its sub-block's
step (the step itself read from the block by gguf's own scale unpacking), over normal rows, a zero
row, an all-positive block and a row 30x larger; and the Q4_K_M mixture picks Q6_K as llama.cpp's
rule does (output, and attn_v/ffn_down of the first and last eighth of layers and every third one)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from tests.fixtures.k_quants import more_bits, q4_k_m_type, quantize_q4_k, quantize_q6_k


def _weights() -> np.ndarray:
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((7, 512)) * 0.05).astype(np.float32)
    weight[0] = 0.0
    weight[1, :256] = np.abs(weight[1, :256])
    weight[2] *= 30
    return weight


def _q4_k_steps(blocks: np.ndarray) -> np.ndarray:
    """Each weight's step d * sc[j], unpacked by gguf: [blocks, 256]."""
    blocks = blocks.reshape(-1, 144)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    scales, _ = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    return np.repeat(d * scales.astype(np.float32), 32, axis=1)


def _q6_k_steps(blocks: np.ndarray) -> np.ndarray:
    blocks = blocks.reshape(-1, 210)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    scales = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    return np.repeat(d * scales, 16, axis=1)


@pytest.mark.parametrize("type_name, quantize, steps", [("Q4_K", quantize_q4_k, _q4_k_steps),
                                                         ("Q6_K", quantize_q6_k, _q6_k_steps)])
def test_blocks_decode_by_gguf_within_half_a_step(type_name, quantize, steps) -> None:
    weight = _weights()
    blocks = quantize(weight)
    decoded = dequantize(blocks, GGMLQuantizationType[type_name]).reshape(weight.shape)
    step = steps(blocks).reshape(weight.shape)
    assert np.all(np.abs(decoded - weight) <= 0.5 * step + 1e-6)
    assert np.all(decoded[0] == 0.0)
    # Steps no coarser than the bits allow: the sub-block's range over 15 (Q4_K) or max |w| over 31 (Q6_K),
    # within the rounding up of the 6/8-bit sub-scales.
    assert np.abs(decoded - weight).max() <= np.abs(weight).max() / (15 if type_name == "Q4_K" else 31)


def test_q4_k_m_mixture_follows_llama_cpp_rule() -> None:
    assert [layer for layer in range(16) if more_bits(layer, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert q4_k_m_type("output.weight", 2048, 16, tied=False) == "Q6_K"
    assert q4_k_m_type("token_embd.weight", 2048, 16, tied=True) == "Q6_K"
    assert q4_k_m_type("token_embd.weight", 2048, 16, tied=False) == "Q4_K"
    assert q4_k_m_type("blk.4.attn_v.weight", 2048, 16, tied=True) == "Q6_K"
    assert q4_k_m_type("blk.5.ffn_down.weight", 8192, 16, tied=True) == "Q4_K"
    assert q4_k_m_type("blk.4.attn_q.weight", 2048, 16, tied=True) == "Q4_K"
    # Rows not of whole 256-weight blocks (SmolLM2-135M's 576): Q6_K -> Q8_0 as llama.cpp, Q4_K -> Q4_0.
    assert q4_k_m_type("blk.0.attn_v.weight", 576, 30, tied=True) == "Q8_0"
    assert q4_k_m_type("blk.5.attn_q.weight", 576, 30, tied=True) == "Q4_0"
