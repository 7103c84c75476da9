"""Memory for the large tensors every step reads end to end (the packed weights, the KV cache): on a
Linux CPU, transparent huge pages.

A decode step streams every packed weight and the KV of every running sequence: with 4 KB pages
each 4 KB is a TLB entry, and the hardware prefetcher stops at each page's end. Measured on AMD
Zen 5 (bf16, one thread, workload W of `benchmarks.engine`; two engines in one process, runs
interleaved, four rounds): the weights and the KV cache on huge pages made the base model 2.4%
faster in every round (987 -> 1011 tokens per CPU-second, medians).

`madvise(MADV_HUGEPAGE)` asks for them where the system's policy is `madvise` (the common
default; `always` gives them anyway, `never` refuses them): the tensor is a fresh mapping of its
own, 2 MiB-aligned and advised before anything touches it, so its first writes fault in whole huge
pages where the kernel has them. The first such fault in a fragmented system can stall while the
kernel compacts memory (up to a second for a GiB, measured), which is why only tensors written
once, at start, live here: the adapter pools, written as adapters arrive, do not. Elsewhere (other devices and
systems, small tensors) it is plain `torch.empty`, and a refused advice leaves plain pages: the
hint changes speed, never contents.
"""
from __future__ import annotations

import math
import mmap
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty(shape, dtype, device), uninitialised and contiguous; on a Linux CPU, a mapping of
    its own, advised for transparent huge pages before its first touch."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not _maps_its_own(nbytes, device):
        return torch.empty(shape, dtype=dtype, device=device)
    # Not torch.empty: the allocator may hand back memory an earlier tensor already faulted in with
    # 4 KB pages, which the advice no longer changes (twenty 12 MB copies made in turn that way got
    # 12 MB of huge pages in all).
    advised = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    mapping = mmap.mmap(-1, advised + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive as long as any view
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, advised)
    except OSError:  # a kernel without transparent huge pages: plain pages, the same contents
        pass
    return raw[offset : offset + nbytes].view(dtype).view(shape)


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """torch.zeros(shape, dtype, device). Where `empty_on_huge_pages` maps memory of its own, the
    kernel's pages are zero already and committed only as they are first written: a KV cache sized to
    the memory left costs only what its requests use."""
    tensor = empty_on_huge_pages(shape, dtype, device)
    return tensor if _maps_its_own(math.prod(shape) * dtype.itemsize, device) else tensor.zero_()


def _maps_its_own(nbytes: int, device) -> bool:
    return torch.device(device).type == "cpu" and sys.platform.startswith("linux") and nbytes >= HUGE_PAGE_BYTES


def copy_to_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `tensor` on memory from `empty_on_huge_pages`."""
    out = empty_on_huge_pages(tuple(tensor.shape), tensor.dtype, tensor.device)
    return out.copy_(tensor)
