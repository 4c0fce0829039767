"""`empty_resident`: a pool whose pages are mapped before the first step writes them."""

from __future__ import annotations

import ctypes
import mmap
import sys

import pytest

torch = pytest.importorskip("torch")

from atom_core import memory  # noqa: E402
from atom_core.memory import HUGE_PAGE, empty_resident  # noqa: E402

PAGE = 4096


def resident_fraction(address: int, nbytes: int) -> float:
    """Share of the range's pages the kernel has mapped (mincore), without touching them."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = address - address % PAGE
    length = address + nbytes - start
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


linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or memory._madvise() is None, reason="madvise is Linux-only"
)


@linux_only
def test_populate_maps_a_fresh_mapping():
    nbytes = 16 << 20
    region = mmap.mmap(-1, nbytes)  # fresh anonymous memory: nothing mapped until written
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    assert resident_fraction(address, nbytes) < 0.5
    assert memory._madvise()(address, nbytes, memory.MADV_POPULATE_WRITE) == 0, "kernel older than 5.14?"
    assert resident_fraction(address, nbytes) == 1.0


@linux_only
def test_pool_is_populated_over_its_whole_range(monkeypatch):
    real, calls = memory._madvise(), []

    def spy(address: int, nbytes: int, advice: int) -> int:
        calls.append((address, nbytes, advice, real(address, nbytes, advice)))
        return calls[-1][-1]

    monkeypatch.setattr(memory, "_madvise", lambda: spy)
    t = empty_resident((3, 1 << 20), torch.float32, "cpu", wait=True)
    nbytes = t.numel() * t.element_size()
    assert t.data_ptr() % HUGE_PAGE == 0
    populated = [(a, n) for a, n, advice, rc in calls if advice == memory.MADV_POPULATE_WRITE and rc == 0]
    # In calls of at most POPULATE_CHUNK bytes (each holds the mmap lock), end to end over the tensor.
    assert all(n <= memory.POPULATE_CHUNK for _, n in populated)
    assert populated[0][0] == t.data_ptr() and sum(n for _, n in populated) == nbytes
    assert all(a + n == b for (a, n), (b, _) in zip(populated, populated[1:]))
    assert resident_fraction(t.data_ptr(), nbytes) == 1.0
