"""Triton matmul over GGML quantized blocks read as stored (W8A16 / W4A16 / W6A16): `quantized_matmul`
and `TritonQuantizedLinear`, the Triton backend's form of a `kernels.quantized.QuantizedWeight`.

One program owns a tile of QUANTIZED_BLOCK_M rows of x by QUANTIZED_BLOCK_N output columns and walks
the reduction QUANTIZED_BLOCK_K (a multiple of 32) columns at a time: it reads the weight tile's bytes
straight from the blocks (the same bytes the CPU kernels read, kernels/quantized.py has the formats),
dequantizes them to float32 in registers, exactly as `kernels.reference.dequantize` does, rounds the
tile to x's dtype (fp16/bf16 tiles take the tensor cores; float32 tiles multiply with
input_precision="ieee") and accumulates in float32; the result is rounded to x's dtype once. Under
the interpreter both tiles stay float32 (`kernels.triton_utils.upcast_dot_inputs`).

Every element of the weight tile is found by its own byte address (quants) and its block's scale
addresses, so each type is a few gathers and bit operations on int32 (each byte widened first: on
uint8 the `q - 8` and `q - 32` of the formats would wrap); no layout is repacked. The f16 scales sit at
even byte offsets of every block (every block size is even), so the kernel reads them through a
float16 view of the same bytes, and Q8_0's quants and Q6_K's scales through an int8 view.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import tuning
from kernels.linear import NO_READS, Reads, dequantized_rows
from kernels.quantized import QuantizedTensor, QuantizedWeight
from kernels.triton_utils import upcast_dot_inputs

# GGUF type numbers (kernels.quantized.BLOCK_TYPES), the kernel's compile-time switch.
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14


@triton.jit
def _nibble(u8_ptr, byte_offset, high):
    """The low (high == 0) or high (high == 1) nibble of the byte at `byte_offset`, as int32."""
    byte = tl.load(u8_ptr + byte_offset).to(tl.int32)
    return (byte >> (4 * high)) & 0xF


@triton.jit
def _k_scale_min(u8_ptr, block, sub):
    """Q4_K/Q5_K: six-bit scale and min of sub-block `sub` (0..7) from the 12 bytes at block + 4:
    sub < 4 the low 6 bits of bytes sub / 4 + sub; sub >= 4 the nibbles of byte 8 + sub - 4 with the
    top 2 bits of bytes sub - 4 / sub (as int32 float-ready values)."""
    low = sub < 4
    first = tl.where(low, sub, sub - 4)
    scale_byte = tl.load(u8_ptr + block + 4 + first).to(tl.int32)
    min_byte = tl.load(u8_ptr + block + 8 + first).to(tl.int32)
    extra = tl.load(u8_ptr + block + 12 + first).to(tl.int32)
    scale = tl.where(low, scale_byte & 0x3F, (extra & 0x0F) | ((scale_byte >> 2) & 0x30))
    minimum = tl.where(low, min_byte & 0x3F, (extra >> 4) | ((min_byte >> 2) & 0x30))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def _dequantize_tile(u8_ptr, i8_ptr, f16_ptr, row_bytes, ns, ks, mask,
                     TYPE: tl.constexpr, BLOCK_ELEMENTS: tl.constexpr, BLOCK_BYTES: tl.constexpr):  # fmt: skip
    """The weight elements [ns, ks] (ns [BN, 1], ks [1, BK]) in float32, as kernels.reference.dequantize."""
    # byte offset of the element's block; masked elements read block 0 of row 0 and are zeroed after
    block = tl.where(mask, ns.to(tl.int64) * row_bytes + (ks // BLOCK_ELEMENTS) * BLOCK_BYTES, 0)
    j = ks % BLOCK_ELEMENTS  # the element's place in its block
    if TYPE == 8:  # Q8_0: d * q
        d = tl.load(f16_ptr + block // 2).to(tl.float32)
        values = tl.load(i8_ptr + block + 2 + j).to(tl.float32) * d
    elif TYPE == 2:  # Q4_0: d * (q - 8)
        d = tl.load(f16_ptr + block // 2).to(tl.float32)
        values = d * (_nibble(u8_ptr, block + 2 + j % 16, j // 16) - 8).to(tl.float32)
    elif TYPE == 3:  # Q4_1: d * q + m
        d = tl.load(f16_ptr + block // 2).to(tl.float32)
        m = tl.load(f16_ptr + block // 2 + 1).to(tl.float32)
        values = d * _nibble(u8_ptr, block + 4 + j % 16, j // 16).to(tl.float32) + m
    elif TYPE == 14:  # Q6_K: d * scale[j // 16] * (q - 32); ql, qh, scales, d at bytes 0, 128, 192, 208
        half, rest = j // 128, j % 128
        low = _nibble(u8_ptr, block + half * 64 + rest % 64, rest // 64)
        high = (tl.load(u8_ptr + block + 128 + half * 32 + rest % 32).to(tl.int32) >> (2 * (rest // 32))) & 3
        d = tl.load(f16_ptr + (block + 208) // 2).to(tl.float32)
        step = d * tl.load(i8_ptr + block + 192 + j // 16).to(tl.float32)
        values = step * ((low | (high << 4)) - 32).to(tl.float32)
    else:  # Q4_K / Q5_K: d * scale[s] * q - dmin * min[s] for sub-block s = j // 32
        sub, i = j // 32, j % 32
        if TYPE == 12:  # Q4_K: quants at byte 16
            quant = _nibble(u8_ptr, block + 16 + (sub // 2) * 32 + i, sub % 2)
        else:  # Q5_K: qh at byte 16, bit `sub` of qh[i] the fifth bit; quants at byte 48
            quant = _nibble(u8_ptr, block + 48 + (sub // 2) * 32 + i, sub % 2)
            quant = quant | (((tl.load(u8_ptr + block + 16 + i).to(tl.int32) >> sub) & 1) << 4)
        scale, minimum = _k_scale_min(u8_ptr, block, sub)
        d = tl.load(f16_ptr + block // 2).to(tl.float32)
        dmin = tl.load(f16_ptr + block // 2 + 1).to(tl.float32)
        values = (d * scale) * quant.to(tl.float32) - dmin * minimum
    return tl.where(mask, values, 0.0)


@triton.jit
def quantized_matmul_kernel(
    x_ptr, u8_ptr, i8_ptr, f16_ptr, out_ptr, num_rows, out_features, cols, row_bytes,
    stride_xm, stride_xk, stride_om, stride_on,
    TYPE: tl.constexpr, BLOCK_ELEMENTS: tl.constexpr, BLOCK_BYTES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """out[m, n] = sum_k x[m, k] * W[n, k], W the blocks dequantized; float32 sums, rounded once."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, n_mask = rows < num_rows, ns < out_features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, cols, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < cols
        x_tile = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                         mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        w_tile = _dequantize_tile(u8_ptr, i8_ptr, f16_ptr, row_bytes, ns[:, None], ks[None, :],
                                  n_mask[:, None] & k_mask[None, :], TYPE, BLOCK_ELEMENTS, BLOCK_BYTES)  # fmt: skip
        if UPCAST:
            x_tile = x_tile.to(tl.float32)
        else:
            w_tile = w_tile.to(x_tile.dtype)
        acc = tl.dot(x_tile, tl.trans(w_tile), acc=acc, input_precision="ieee")  # [BLOCK_M, BLOCK_N]
    out_ptrs = out_ptr + rows[:, None] * stride_om + ns[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def quantized_matmul(x: torch.Tensor, part: QuantizedTensor, out: torch.Tensor) -> None:
    """out [M, part.rows] (any strides) = (x [M, K] @ dequantize(part).T) in x's dtype; K = part.cols."""
    assert x.shape[1] == part.cols and out.shape == (x.shape[0], part.rows), "shapes of x, weight and out"
    if x.shape[0] == 0:
        return
    data = part.data.contiguous()  # every row's bytes even, so the float16 view sees each scale whole
    block = part.block_type
    grid = (triton.cdiv(x.shape[0], tuning.QUANTIZED_BLOCK_M), triton.cdiv(part.rows, tuning.QUANTIZED_BLOCK_N))
    quantized_matmul_kernel[grid](
        x, data, data.view(torch.int8), data.view(torch.float16), out, x.shape[0], part.rows, part.cols,
        data.shape[1], x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        TYPE=block.ggml_type, BLOCK_ELEMENTS=block.block_elements, BLOCK_BYTES=block.block_bytes,
        BLOCK_M=tuning.QUANTIZED_BLOCK_M, BLOCK_N=tuning.QUANTIZED_BLOCK_N, BLOCK_K=tuning.QUANTIZED_BLOCK_K,
        UPCAST=upcast_dot_inputs(),
    )  # fmt: skip


class TritonQuantizedLinear:
    """A quantized weight multiplied by `quantized_matmul`, a part at a time into its columns of the
    output: `kernels.reference.quantized_linear` with the weight tiles rounded to x's dtype. Only the
    blocks stay resident, on `device` (the GGUF reader and the quantizer leave them in host memory)."""

    __slots__ = ("weight", "bias")

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device) -> None:
        parts = tuple(QuantizedTensor(part.block_type, part.data.to(device), part.cols) for part in weight.parts)
        self.weight = QuantizedWeight(parts)
        self.bias = None if bias is None else bias.to(device)

    def __call__(self, x: torch.Tensor, reads: Reads = NO_READS) -> torch.Tensor:
        out = x.new_empty(x.shape[0], self.weight.shape[0])
        column = 0
        for part in self.weight.parts:
            quantized_matmul(x, part, out[:, column : column + part.rows])
            column += part.rows
        return out if self.bias is None else out.add_(self.bias)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantized_rows(self.weight, ids, dtype)
