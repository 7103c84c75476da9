"""Plain PyTorch twins of every backend op: the tests' oracle. Each takes the step's plain inputs
(per-token adapter entries and their factors, the step's sequences) where the backends take their own plans.

Written for clarity, not speed: per-token and per-sequence loops, computed in fp32 and cast back."""
from __future__ import annotations

from typing import Sequence

import torch

from kernels.attention.plans import StepSequences
from kernels.quantized import QuantizedTensor, QuantizedWeight


LoraFactors = Sequence[tuple[torch.Tensor, torch.Tensor] | None]


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    token_entries: Sequence[int],
    slices: Sequence[tuple[int, int, LoraFactors]],
) -> None:
    """y[t, start:end] += (x[t] @ A.T) @ B.T for every slice (start, end, factors) with
    factors[e] = (A [rank, hidden_in], B [end - start, rank]) of entry e = token_entries[t] >= 0
    (None: entry e does not adapt the slice). y [T, total_out], x [T, hidden_in]; the delta of a
    token is summed in float32 and rounded into y once per slice."""
    for t, entry in enumerate(_ints(token_entries)):
        if entry < 0:
            continue
        for start, end, factors in slices:
            if factors[entry] is None:
                continue
            weight_a, weight_b = (w.float() for w in factors[entry])
            delta = (x[t].float() @ weight_a.T) @ weight_b.T
            y[t, start:end] = (y[t, start:end].float() + delta).to(y.dtype)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_cache[slot // block_size, slot % block_size] = k[t] for slot = slot_mapping[t] >= 0 (same for v):
    k, v [T, num_kv_heads, D], caches [num_blocks, block_size, num_kv_heads, D]."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = k[t]
            v_cache[slot // block_size, slot % block_size] = v[t]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    step: StepSequences,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens (the last q_len of its context) over its cached
    context. q [T, num_heads, D], caches [num_blocks, block_size, num_kv_heads, D] -> [T, num_heads, D].
    Query head h reads KV head h // (num_heads // num_kv_heads). With a `window` W, the token at
    position p sees keys p - W + 1 .. p only (HF's sliding-window mask); with a `softcap` c, scores s
    become c * tanh(s / c) before the softmax (Gemma 2)."""
    out = torch.empty_like(q)
    starts = step.query_start
    for b, seq_len in enumerate(step.seq_lens):
        positions = torch.arange(seq_len)
        blocks = torch.tensor(step.block_tables[b], dtype=torch.int64)[positions // step.block_size]
        keys = k_cache[blocks, positions % step.block_size].float()  # [seq_len, kv_heads, D]
        values = v_cache[blocks, positions % step.block_size].float()
        out[starts[b] : starts[b + 1]] = _causal_attention(
            q[starts[b] : starts[b + 1]].float(), keys, values, scale, window, softcap
        ).to(q.dtype)
    return out


def _causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window: int | None,
                      softcap: float | None) -> torch.Tensor:
    """q [q_len, H, D] are the last q_len positions of keys/values [seq_len, H_kv, D] -> [q_len, H, D]."""
    q_len, seq_len = q.shape[0], keys.shape[0]
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale  # [H, q_len, seq_len]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    key_pos = torch.arange(seq_len)[None, :]
    hidden = key_pos > query_pos
    if window is not None:
        hidden |= key_pos <= query_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * T(h * rsqrt(mean(h**2) + eps)) with h = x in fp32 and T = x.dtype (HF's roundings).

    x [rows, hidden]. With `residual` [rows, hidden]: first `residual += x` in place, and the norm
    reads that sum (the fused residual add of the decoder block). Returns a new tensor.
    """
    if residual is not None:
        residual.add_(x)
        x = residual
    h = x.float()
    normalised = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normalised.to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * width] -> silu(gate) * up [rows, width]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * width] -> gelu_tanh(gate) * up [rows, width] (Gemma's GeGLU, HF's
    `gelu_pytorch_tanh`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def rotate_qk(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
              num_kv_heads: int) -> None:
    """In place: the first R dims of the first num_heads + num_kv_heads heads of qkv [T, (H + 2 * Hkv) * D]
    (q then k) become x * cos[pos] + rotate_half(x) * sin[pos] (the Llama rotate-half layout over those R
    dims; the rest of each head kept, as Phi-3's partial rotary), cos/sin [P, R] with R <= D, `positions`
    [T] each token's row of them."""
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    rotary_dim = cos.shape[1]
    heads = qkv[:, : (num_heads + num_kv_heads) * head_dim].unflatten(-1, (num_heads + num_kv_heads, head_dim))
    qk = heads[..., :rotary_dim]
    half = rotary_dim // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    qk.copy_(qk * cos[positions].unsqueeze(1) + rotated * sin[positions].unsqueeze(1))


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Views q [T, H, D], k [T, Hkv, D], v [T, Hkv, D] of a fused projection's output."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    return (
        qkv[:, :q_size].unflatten(-1, (num_heads, head_dim)),
        qkv[:, q_size : q_size + kv_size].unflatten(-1, (num_kv_heads, head_dim)),
        qkv[:, q_size + kv_size :].unflatten(-1, (num_kv_heads, head_dim)),
    )


def rotary_store_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """`rotate_qk` in place, then `store_kv` of the rotated keys and the values."""
    rotate_qk(qkv, positions, cos, sin, num_heads, num_kv_heads)
    _, k, v = split_qkv(qkv, num_heads, num_kv_heads, k_cache.shape[-1])
    store_kv(k, v, k_cache, v_cache, slot_mapping)


def max_logsumexp(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scores [rows, vocab], any float dtype -> (row maxima, their first indices, row logsumexp), in float32."""
    scores = scores.float()
    values, indices = scores.max(dim=-1)
    return values, indices, torch.logsumexp(scores, dim=-1)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T, accumulated in float32 and rounded to x's dtype once."""
    return (x.float() @ weight.float().T).to(x.dtype)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [M, K] @ the dequantized weight [N, K].T, accumulated in float32 and rounded to x's dtype once."""
    dense = torch.cat([dequantize(part) for part in weight.parts])
    return (x.float() @ dense.T).to(x.dtype)


def dequantize(tensor: QuantizedTensor) -> torch.Tensor:
    """The weight [rows, cols] in float32, bit-exact with gguf's `gguf.quants.dequantize` (the block
    formats: kernels/quantized.py)."""
    blocks = tensor.data.reshape(tensor.num_blocks, tensor.block_type.block_bytes)
    values = _DEQUANTIZERS[tensor.block_type.name](blocks)  # [num_blocks, block_elements]
    return values.reshape(tensor.rows, tensor.cols)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The f16 at bytes start..start+1 of each block, widened: [num_blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> [..., 2, n]: the low nibbles, then the high ones."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-2)


def _dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _half(blocks, 0)


def _dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    quants = _nibbles(blocks[:, 2:]).flatten(1).to(torch.int8) - 8
    return _half(blocks, 0) * quants.float()


def _dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * _nibbles(blocks[:, 4:]).flatten(1).float() + _half(blocks, 2)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit mins of Q4_K/Q5_K blocks from their 12 bytes [n, 12]:
    bytes 0-3 hold scales 0-3 (low 6 bits), 4-7 mins 0-3; scales/mins 4-7 take their low 4 bits
    from the nibbles of bytes 8-11 and their top 2 bits from the top bits of bytes 0-3 / 4-7."""
    low_scales, low_mins, extra = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((low_scales & 0x3F, (extra & 0x0F) | ((low_scales >> 2) & 0x30)), dim=1)
    mins = torch.cat((low_mins & 0x3F, (extra >> 4) | ((low_mins >> 2) & 0x30)), dim=1)
    return scales.float(), mins.float()


def _k_affine(blocks: torch.Tensor, quants: torch.Tensor) -> torch.Tensor:
    """d * scale * q - dmin * min over the 8 sub-blocks of Q4_K/Q5_K; quants [n, 8, 32] -> [n, 256]."""
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    step = (_half(blocks, 0) * scales)[:, :, None]
    offset = (_half(blocks, 2) * mins)[:, :, None]
    return (step * quants.float() - offset).flatten(1)


def _dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    low = _nibbles(blocks[:, 16:].unflatten(1, (4, 32)))  # [n, 4, 2, 32]
    return _k_affine(blocks, low.flatten(1, 2))


def _dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    low = _nibbles(blocks[:, 48:].unflatten(1, (4, 32))).flatten(1, 2)  # [n, 8, 32]
    bits = torch.arange(8, dtype=torch.uint8)[None, :, None]
    high = (blocks[:, None, 16:48] >> bits) & 1  # [n, 8, 32]: bit s of qh is sub-block s's
    return _k_affine(blocks, low | (high << 4))


def _dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    low = _nibbles(blocks[:, :128].unflatten(1, (2, 64))).reshape(-1, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[None, None, :, None]
    high = ((blocks[:, 128:192].unflatten(1, (2, 1, 32)) >> shifts) & 3).reshape(-1, 8, 32)
    quants = ((low | (high << 4)).to(torch.int8) - 32).reshape(-1, 16, 16)
    step = _half(blocks, 208) * blocks[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    return (step[:, :, None] * quants.float()).flatten(1)


_DEQUANTIZERS = {
    "Q8_0": _dequantize_q8_0,
    "Q4_0": _dequantize_q4_0,
    "Q4_1": _dequantize_q4_1,
    "Q4_K": _dequantize_q4_k,
    "Q5_K": _dequantize_q5_k,
    "Q6_K": _dequantize_q6_k,
}


def _ints(values: Sequence[int] | torch.Tensor) -> list[int]:
    return values.tolist() if torch.is_tensor(values) else [int(v) for v in values]
