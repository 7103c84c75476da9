"""Memory on transparent huge pages (kernels/huge_pages.py): an ordinary tensor everywhere, and on a
Linux CPU a region the kernel was asked to back with huge pages (the `hg` flag of its mapping in
/proc/self/smaps), which the packed weights and the KV cache use."""
from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

import pytest
import torch

from kernels import reference
from kernels.huge_pages import HUGE_PAGE_BYTES, copy_to_huge_pages, empty_on_huge_pages
from kernels.linear import available_kinds, linear_packed, pack_linear_weight
from lora_runtime.models.architectures import ModelShape
from lora_runtime.models.llama import KVCacheTensors

LINUX_THP = sys.platform.startswith("linux") and Path("/sys/kernel/mm/transparent_hugepage").is_dir()
needs_thp = pytest.mark.skipif(not LINUX_THP, reason="transparent huge pages are a Linux feature, absent here")


def mapping_fields(address: int) -> dict[str, list[str]]:
    """The /proc/self/smaps fields (Rss, VmFlags, ...) of the mapping of this process that holds `address`."""
    fields: dict[str, list[str]] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            if fields is not None:
                return fields
            start, end = (int(bound, 16) for bound in head.split("-"))
            fields = {} if start <= address < end else None
        elif fields is not None:
            fields[head.rstrip(":")] = line.split()[1:]
    if fields is None:
        raise AssertionError(f"no mapping holds {address:#x}")
    return fields


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    return mapping_fields(address)["VmFlags"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 300, 576 * 16), (3, 5)])
def test_the_memory_is_an_ordinary_tensor(dtype, shape):
    """Above and below one huge page: the shape, the dtype, contiguity, and what is written reads back."""
    tensor = empty_on_huge_pages(shape, dtype, "cpu")
    assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
    values = torch.randn(shape).to(dtype)
    tensor.copy_(values)
    assert torch.equal(tensor, values)
    strided = values.transpose(0, 1)
    assert torch.equal(copy_to_huge_pages(strided), strided) and copy_to_huge_pages(strided).is_contiguous()


def test_other_devices_are_plain():
    meta = empty_on_huge_pages((64, 1 << 20), torch.float32, "meta")
    assert meta.device.type == "meta" and meta.shape == (64, 1 << 20)


@needs_thp
def test_a_large_tensor_is_aligned_and_advised_for_huge_pages():
    tensor = empty_on_huge_pages((8, 1024, 577), torch.bfloat16, "cpu")  # not a whole number of huge pages
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    assert "hg" in vm_flags(tensor.data_ptr()) and "hg" in vm_flags(tensor[-1, -1, -1].data_ptr())
    plain = mmap.mmap(-1, 4 << 20)  # a fresh mapping nobody advised: the flag tells them apart
    assert "hg" not in vm_flags(ctypes.addressof(ctypes.c_char.from_buffer(plain)))


@needs_thp
def test_the_memory_was_never_touched_before_the_advice():
    """A huge page is granted at the first touch of an advised region; memory the allocator hands back
    after another tensor used it is already faulted in with 4 KB pages, which the advice no longer
    changes. So the tensor has a mapping of its own, with nothing resident until it is written."""
    for _ in range(3):  # freed tensors of the same size, which an allocator would reuse
        used = torch.ones(3 << 20, dtype=torch.uint8)
        del used
    tensor = empty_on_huge_pages((3 << 20,), torch.uint8, "cpu")
    assert mapping_fields(tensor.data_ptr())["Rss"] == ["0", "kB"]
    tensor.fill_(7)
    assert int(mapping_fields(tensor.data_ptr())["Rss"][0]) >= 3 << 10 and bool((tensor == 7).all())


@needs_thp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_are_advised_and_still_multiply_right(dtype):
    kinds = [kind for kind in available_kinds() if pack_linear_weight(torch.zeros(32, 32, dtype=dtype), kind) is not None]
    if not kinds:
        pytest.skip(f"no compiled matmul for {dtype} in this CPU's form")
    weight = torch.randn(1536, 1024).to(dtype)  # 3-6 MB: above one huge page
    packed = pack_linear_weight(weight)
    assert "hg" in vm_flags(packed.packed.data_ptr())
    x = torch.randn(5, 1024).to(dtype)
    torch.testing.assert_close(linear_packed(x, packed), reference.linear(x, weight), rtol=2e-2, atol=2e-2)


@needs_thp
def test_the_kv_cache_is_advised_and_zeroed():
    shape = ModelShape("llama", 2, 576, 9, 3, 64, 1536, 100, 1e-5, 2048, True, False, False)
    caches = KVCacheTensors.allocate(shape, num_blocks=1024, block_size=16, dtype=torch.bfloat16, device="cpu")
    for cache in (*caches.key, *caches.value):
        assert "hg" in vm_flags(cache.data_ptr())
        assert cache.shape == (1024, 16, 3, 64) and not cache.any()
