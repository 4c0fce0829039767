"""`empty_resident`: a pool whose pages are mapped before the first step writes them."""

from __future__ import annotations

import resource
import sys

import pytest

torch = pytest.importorskip("torch")

from atom_core.memory import HUGE_PAGE, _madvise, empty_resident  # noqa: E402


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shape_dtype_and_writable(dtype):
    t = empty_resident((2, 3, 5, 16, 8), dtype, "cpu")
    assert t.shape == (2, 3, 5, 16, 8) and t.dtype == dtype and t.is_contiguous()
    t.fill_(1.5)
    assert t.sum().item() == 1.5 * t.numel()


@pytest.mark.skipif(not sys.platform.startswith("linux") or _madvise() is None, reason="madvise is Linux-only")
def test_pages_are_mapped_before_first_write():
    nbytes = 64 << 20
    t = empty_resident((nbytes // 4,), torch.float32, "cpu", wait=True)
    assert t.data_ptr() % HUGE_PAGE == 0
    before = minor_faults()
    t.fill_(2.0)
    faults = minor_faults() - before
    # lazily mapped, 64 MiB would fault 16384 times in 4 KiB pages
    assert faults < 1000, f"{faults} page faults writing a pool that should already be mapped"
