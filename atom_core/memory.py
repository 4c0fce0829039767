"""Host memory for long-lived pools: pages mapped ahead of use, in huge pages where Linux allows.

A KV pool is written a few rows at a time for the whole run. Left to fault in lazily,
each first write to a 4 KiB page traps in the middle of a step: on the VM we measure that
cost 6.5 ms of a 180 ms decode step (64 requests, SmolLM2) and about 1 s of a 10k-token
prefill. vLLM pays it at startup with `torch.zeros`. Here a background thread maps the
pool with one `madvise(MADV_POPULATE_WRITE)` call (the GIL is released meanwhile), over
2 MiB pages when transparent huge pages are on "madvise": startup does not wait, and
steps that run before it finishes simply fault as before.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import math
import sys
import threading

import torch

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels refuse it and pages fault lazily
HUGE_PAGE = 2 << 20


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def empty_resident(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, wait: bool = False
) -> torch.Tensor:
    """An uninitialised tensor whose pages are being mapped in the background (CPU, Linux).

    `wait` maps them before returning. Elsewhere, plain `torch.empty`.
    """
    device = torch.device(device)
    madvise = _madvise()
    if device.type != "cpu" or madvise is None:
        return torch.empty(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE  # huge pages need 2 MiB-aligned ranges
    address = raw.data_ptr() + start
    if nbytes:
        madvise(address, nbytes, MADV_HUGEPAGE)  # a hint: refused where THP is off

        stop = threading.Event()

        def populate(keep_alive: torch.Tensor = raw) -> None:  # the range stays mapped until done
            for offset in range(0, nbytes, POPULATE_CHUNK):
                if stop.is_set():
                    return
                madvise(address + offset, min(POPULATE_CHUNK, nbytes - offset), MADV_POPULATE_WRITE)

        if wait:
            populate()
        else:
            thread = threading.Thread(target=populate, name="atom-populate", daemon=True)
            _populating.append((thread, stop))
            thread.start()
    return raw[start : start + nbytes].view(dtype).view(shape)


# Mapping a pool of gigabytes takes seconds, in calls of POPULATE_CHUNK bytes. Each call
# holds the process's mmap lock, which the main thread's own mappings (a large tensor's
# allocation) wait for: in calls of 256 MiB, a one-question `atom generate` beside a 6 GB
# pool took 6.8 s to generate 16 tokens; in calls of 8 MiB, 0.4 s (0.24 s with no pool to
# map). A process that exits sooner stops its mapping threads between calls and waits for
# them: a daemon thread still inside madvise while the interpreter finalizes could otherwise
# die mid-call (seen as "terminate called without an active exception" at exit).
POPULATE_CHUNK = 4 * HUGE_PAGE
_populating: list[tuple[threading.Thread, threading.Event]] = []


@atexit.register
def _stop_populating() -> None:
    for _, stop in _populating:
        stop.set()
    for thread, _ in _populating:
        thread.join()
    _populating.clear()
