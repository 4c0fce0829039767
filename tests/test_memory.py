"""`empty_resident`: a pool whose pages are mapped before the first step writes them."""

from __future__ import annotations

import ctypes
import sys

import pytest

torch = pytest.importorskip("torch")

from atom_core import memory  # noqa: E402
from atom_core.memory import HUGE_PAGE, empty_resident  # noqa: E402

PAGE = 4096


def resident_fraction(t: torch.Tensor) -> float:
    """Share of the tensor's pages the kernel has mapped (mincore), without touching them."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = t.data_ptr() - t.data_ptr() % PAGE
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = -(-length // PAGE)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, length, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) / pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shape_dtype_and_writable(dtype):
    t = empty_resident((2, 3, 5, 16, 8), dtype, "cpu")
    assert t.shape == (2, 3, 5, 16, 8) and t.dtype == dtype and t.is_contiguous()
    t.fill_(1.5)
    assert t.sum().item() == 1.5 * t.numel()


@pytest.mark.skipif(not sys.platform.startswith("linux") or memory._madvise() is None, reason="madvise is Linux-only")
def test_pages_are_mapped_before_first_write():
    fresh = torch.empty(((64 << 20) // 4,), dtype=torch.float32)
    assert resident_fraction(fresh) < 0.5  # what torch.empty gives: mapped on first write
    t = empty_resident(((64 << 20) // 4,), torch.float32, "cpu", wait=True)
    assert t.data_ptr() % HUGE_PAGE == 0
    assert resident_fraction(t) == 1.0
