"""Linear projections, `y = x @ weight.T + bias`, with the weight laid out once for its backend's
fastest matmul. `Backend.linear(weight, bias)` picks the form; each is a callable `x -> y`.

- `PlainLinear`: `F.linear` (MKL/oneDNN on CPU, cuBLAS on CUDA), the public path.
- `CompiledLinear`: a compiled matmul of the CPU ops (kernels/csrc/linear.cpp, amx_linear.cpp):
  `f32` (`vfmadd` on AVX2 and AVX-512 forms: MKL's sgemm, which F.linear calls, runs on its AVX2 path
  on AMD CPUs), `bf16` (`vdpbf16ps` in the AVX512-BF16 form; bf16 weights widened to float32 for
  `vfmadd` in the AVX2 and AVX-512 forms) or `amx` on AMX tiles, each at every batch size: the
  weight is held once, in its kernel's layout (a second copy in oneDNN's layout for prefill-sized
  batches once doubled the projections' memory; figures in docs/benchmarks.md).
Semantics of the compiled matmuls: `x @ weight.T` accumulated in float32 and rounded to x's dtype
once (`kernels.reference.linear`).

Every form takes the `Reads` of the op that follows the projection: the compiled matmuls request
them into cache while they compute (they are bound by arithmetic, decode attention by reading the KV
cache from memory; the LoRA op fetches its adapter pages itself); the library matmuls ignore them."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_ops, reference, tuning
from kernels.huge_pages import copy_to_huge_pages
from kernels.quantized import QuantizedTensor, QuantizedWeight

# Output columns per packed block, and the K multiple, of each kernel.
_AMX_BLOCK = 32
_BLOCK_COLUMNS = 16  # f32 and bf16
KINDS = ("amx", "bf16", "f32")
KIND_DTYPES = {"amx": torch.bfloat16, "bf16": torch.bfloat16, "f32": torch.float32}


@dataclass(frozen=True, slots=True)
class Reads:
    """Pages an op reads: page ids `pages[j]` (1-D int64) of `pools[j]` (a contiguous CPU tensor, its
    pages along dim 0)."""

    pools: tuple[torch.Tensor, ...] = ()
    pages: tuple[torch.Tensor, ...] = ()


NO_READS = Reads()


class PlainLinear:
    __slots__ = ("weight", "bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor, reads: Reads = NO_READS) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows `ids` of the weight (a tied embedding's lookup: `LlamaModel._embed`), in `dtype`
        (default: the weight's)."""
        return F.embedding(ids.reshape(-1), self.weight).to(dtype or self.weight.dtype)


@dataclass(frozen=True, slots=True)
class PackedLinear:
    """A weight `[out_features, in_features]` in the layout of one compiled kernel."""

    kind: str  # one of KINDS
    packed: torch.Tensor
    out_features: int


class CompiledLinear:
    """The compiled matmul over the packed weight, the only copy of the weight it holds."""

    __slots__ = ("compiled",)

    def __init__(self, compiled: PackedLinear) -> None:
        self.compiled = compiled

    def __call__(self, x: torch.Tensor, reads: Reads = NO_READS) -> torch.Tensor:
        return linear_packed(x, self.compiled, reads)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows `ids` of the weight, `[len(ids), in_features]`, gathered from the packed layout: a tied
        embedding's lookup reads the head's one copy (for a 128k vocabulary, 500 MB not held twice).
        `dtype`: the packed weight's (the model's), the only one it gives."""
        packed, ids = self.compiled.packed, ids.reshape(-1)
        if self.compiled.kind == "amx":  # packed[N/32][K/32][2][16 pairs][16 columns][2]
            n_block, half, column = ids // _AMX_BLOCK, ids % _AMX_BLOCK // 16, ids % 16
            picked = packed[n_block, :, half, :, column, :]  # [n, K/32, 16, 2]
        elif self.compiled.kind == "bf16":  # packed[N/16][K/2][16][2]
            picked = packed[ids // _BLOCK_COLUMNS, :, ids % _BLOCK_COLUMNS, :]  # [n, K/2, 2]
        else:  # f32: packed[N/16][K][16]
            picked = packed[ids // _BLOCK_COLUMNS, :, ids % _BLOCK_COLUMNS]  # [n, K]
        return picked.reshape(ids.shape[0], -1)


class DequantizingLinear:
    """A quantized weight (kernels/quantized.py) dequantized to float32 at each call, a part at a
    time, then multiplied: `kernels.reference.quantized_linear`'s semantics, for backends without a
    kernel over the blocks. Correct and slow: only the blocks stay resident."""

    __slots__ = ("weight", "bias")

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor, reads: Reads = NO_READS) -> torch.Tensor:
        x32 = x.float()
        y = torch.cat([x32 @ reference.dequantize(part).T for part in self.weight.parts], dim=1)
        return (y if self.bias is None else y + self.bias.float()).to(x.dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantized_rows(self.weight, ids, dtype)


def dequantized_rows(weight: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rows `ids` of a quantized weight dequantized where its blocks are (`kernels.reference.dequantize`,
    rounded once to `dtype`; default float32): an embedding's lookup reads only its rows' blocks."""
    return reference.dequantize(weight.selected_rows(ids)).to(dtype or torch.float32)


class QuantizedLinear:
    """A quantized weight multiplied by the compiled CPU ops over its blocks (kernels/csrc/quantized.cpp):
    batches of up to `tuning.QUANTIZED_INT8_MAX_ROWS` rows by int8 dot products (x quantized per 32
    elements to int8 on the fly: `kernels.reference.quantized_linear` within x's quantization error),
    those within `tuning.quantized_amx_rows(type)` by the same arithmetic on AMX-INT8 tiles where the CPU
    has them (kernels/csrc/quantized_amx.cpp; this choice comes first),
    larger bf16 ones by the weights widened to bf16 32 rows at a time inside the compiled tiles
    (kernels/csrc/quantized_tiles.cpp), larger float32 ones by each part widened once per call for the
    library matmul. Only the blocks stay resident."""

    __slots__ = ("weight", "bias")

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor, reads: Reads = NO_READS) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.weight.shape[0], dtype=x.dtype)
        column = 0
        for part in self.weight.parts:
            _multiply_part(x, part, out[:, column : column + part.rows])
            column += part.rows
        return out if self.bias is None else out.add_(self.bias)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows `ids` of the weight dequantized by the compiled ops (`kernels.reference.dequantize`'s
        values bit for bit, rounded once to `dtype`; default float32): an embedding's lookup reads only
        its rows' blocks."""
        part = self.weight.selected_rows(ids)
        dtype = dtype or torch.float32
        out = torch.empty(part.rows, part.cols, dtype=dtype if dtype == torch.bfloat16 else torch.float32)
        cpu_ops.ops().dequantize_rows(out, part.data, part.block_type.ggml_type)
        return out.to(dtype)


def _multiply_part(x: torch.Tensor, part: QuantizedTensor, out: torch.Tensor) -> None:
    """out [M, part.rows] = x [M, K] @ the part's weight.T (x float32, bf16 or float16)."""
    ops = cpu_ops.ops()
    fewest, most = tuning.quantized_amx_rows(part.block_type.name)
    if fewest <= x.shape[0] <= most and ops.has_quantized_amx():
        ops.quantized_linear_amx(out, x, part.data, part.block_type.ggml_type)
        return
    if x.shape[0] <= tuning.QUANTIZED_INT8_MAX_ROWS or x.dtype not in (torch.float32, torch.bfloat16):
        ops.quantized_linear(out, x, part.data, part.block_type.ggml_type)
        return
    if x.dtype == torch.bfloat16:
        ops.quantized_linear_widened(out, x, part.data, part.block_type.ggml_type)
        return
    dense = torch.empty(part.rows, part.cols, dtype=x.dtype)
    ops.dequantize_rows(dense, part.data, part.block_type.ggml_type)
    out.copy_(F.linear(x, dense))


# each a callable (x [M, in], reads) -> [M, out]
LinearWeight = PlainLinear | CompiledLinear | DequantizingLinear | QuantizedLinear


def available_kinds() -> list[str]:
    """The compiled matmuls of the active form of the CPU ops, fastest first (bf16 ones, then f32)."""
    ops = cpu_ops.ops()
    return list(ops.linear_kernels()) if ops is not None else []


def pack_linear_weight(weight: torch.Tensor, kind: str | None = None) -> PackedLinear | None:
    """`weight` in the layout of `kind` (default: the fastest kernel here for its dtype that applies to
    its dimensions: the AMX tiles need multiples of 32, the register tiles of 16), or None where no such
    kernel applies (none in this CPU's form, another dtype or device, dimensions). The packed copy is on
    huge pages where the system has them (kernels/huge_pages.py: every decode step streams it)."""
    kinds = [k for k in available_kinds() if KIND_DTYPES[k] == weight.dtype]
    if weight.device.type != "cpu":
        return None
    if kind is not None:
        return _pack_as(weight, kind) if kind in kinds else None
    return next((packed for k in kinds if (packed := _pack_as(weight, k)) is not None), None)


def _pack_as(weight: torch.Tensor, kind: str) -> PackedLinear | None:
    """`weight` in the layout of `kind`, or None where its dimensions do not fit that layout."""
    out_features, in_features = weight.shape
    if kind == "amx":
        if out_features % _AMX_BLOCK or in_features % _AMX_BLOCK:
            return None
        # packed[N/32][K/32][2][16][16][2]: per block of 32 output columns and step of 32 along K, two
        # 16-column B tiles whose rows hold consecutive pairs of K:
        # n = ((n_block * 2 + half) * 16 + column), k = (k_step * 16 + pair) * 2 + element
        tiles = weight.view(out_features // _AMX_BLOCK, 2, 16, in_features // _AMX_BLOCK, 16, 2)
        return PackedLinear(kind, copy_to_huge_pages(tiles.permute(0, 3, 1, 4, 2, 5)), out_features)
    if out_features % _BLOCK_COLUMNS:
        return None
    if kind == "f32":
        # packed[N/16][K][16]: per block of 16 output columns, each k as one 64-byte row.
        blocks = weight.view(out_features // _BLOCK_COLUMNS, _BLOCK_COLUMNS, in_features)
        return PackedLinear(kind, copy_to_huge_pages(blocks.permute(0, 2, 1)), out_features)
    if in_features % 2:
        return None
    # packed[N/16][K/2][16][2]: per block of 16 output columns, each pair of K as one 64-byte vector.
    blocks = weight.view(out_features // _BLOCK_COLUMNS, _BLOCK_COLUMNS, in_features // 2, 2)
    return PackedLinear(kind, copy_to_huge_pages(blocks.permute(0, 2, 1, 3)), out_features)


def linear_packed(x: torch.Tensor, weight: PackedLinear, reads: Reads = NO_READS) -> torch.Tensor:
    """x [M, K] @ the packed [N, K] weight's transpose -> [M, N], in the kernel's dtype, requesting
    `reads` into cache meanwhile."""
    out = torch.empty(x.shape[0], weight.out_features, dtype=KIND_DTYPES[weight.kind])
    ops = cpu_ops.ops()
    run = {"amx": ops.amx_linear, "bf16": ops.bf16_linear, "f32": ops.f32_linear}[weight.kind]
    run(out, x.contiguous(), weight.packed, list(reads.pools), list(reads.pages))
    return out
