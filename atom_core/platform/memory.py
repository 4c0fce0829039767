"""Host memory for long-lived pools and streamed weights: pages mapped ahead of use, in huge pages where Linux allows.

A KV pool is written a few rows at a time for the whole run. Left to fault in lazily,
each first write to a 4 KiB page traps in the middle of a step (a measurable share of a
decode step, and of a long prefill: docs/kernels.md). vLLM pays it at startup with `torch.zeros`. Here a background thread maps the
pool with one `madvise(MADV_POPULATE_WRITE)` call (the GIL is released meanwhile), over
2 MiB pages when transparent huge pages are on "madvise": startup does not wait, and
steps that run before it finishes simply fault as before.

Weights that decode steps stream (`weight_arena`, `resident`) go into huge pages too: on
4 KiB pages a stream over SmolLM2's 538 MB of float32 weights crosses ~130k page edges a
step, each a TLB miss and a stop for the hardware prefetcher; on 2 MiB pages the stream
reads faster (docs/kernels.md has the measurements).
`ATOM_DISABLE_HUGE_PAGES=1` keeps every pool and weight on ordinary pages.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import ctypes
import functools
import math
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Iterator

import torch

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels refuse it and pages fault lazily
HUGE_PAGE = 2 << 20
PAGE = 4096  # the base page: what madvise's ranges align to


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
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str,
    wait: bool = False,
    block_dim: int | None = None,
) -> torch.Tensor:
    """An uninitialised tensor whose pages are being mapped in the background (CPU, Linux).

    `wait` maps them before returning. Elsewhere, plain `torch.empty`. `block_dim`: the
    dimension that numbers a KV pool's blocks; its pages are then mapped lowest blocks first,
    in every slice before that dimension (each layer's K and V, each head) at once, the order
    a block manager hands blocks out: the first requests write pages already mapped, where
    in address order they would wait for the last layers' (`populate_ranges`).
    """
    device = torch.device(device)
    madvise = _madvise()
    if device.type != "cpu" or madvise is None:
        return torch.empty(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    raw, start, mapping = _huge_region(nbytes)
    address = raw.data_ptr() + start
    if nbytes:
        stop = threading.Event()

        ranges = populate_ranges(shape, dtype.itemsize, block_dim)

        region = weakref.ref(mapping)  # alive while any tensor on it is
        del mapping

        def populate() -> None:
            """Map the ranges in order; stop once the region is gone (its engine was deleted),
            holding it only during each call, so the thread never keeps a pool alive."""
            if not wait:
                idle_priority()
            for offset, length in ranges:
                alive = region()
                if alive is None or stop.is_set():
                    return
                madvise(address + offset, length, MADV_POPULATE_WRITE)
                del alive

        if wait:
            populate()
        else:
            thread = threading.Thread(target=populate, name="atom-populate", daemon=True)
            _populating[:] = [(t, s) for t, s in _populating if t.is_alive()]
            _populating.append((thread, stop))
            thread.start()
    return raw[start : start + nbytes].view(dtype).view(shape)


def populate_ranges(shape: tuple[int, ...], itemsize: int, block_dim: int | None = None) -> list[tuple[int, int]]:
    """(offset, bytes) of the populate calls for a tensor of `shape`, in order, none over
    POPULATE_CHUNK: end to end, or with `block_dim` by rounds of blocks (a huge page's worth
    of each slice a round, every slice's share of a round before the next round), each
    range widened to whole 4 KiB pages (madvise takes page-aligned ranges; a page two
    ranges share is mapped by the first)."""
    nbytes = math.prod(shape) * itemsize
    if block_dim is None or nbytes == 0:
        return [(o, min(POPULATE_CHUNK, nbytes - o)) for o in range(0, nbytes, POPULATE_CHUNK)]
    slices, blocks = math.prod(shape[:block_dim]), shape[block_dim]
    block_bytes = math.prod(shape[block_dim + 1 :]) * itemsize
    per_round = max(1, min(HUGE_PAGE, POPULATE_CHUNK) // block_bytes)  # (nbytes > 0: block_bytes too)
    ranges = []
    for b0 in range(0, blocks, per_round):
        b1 = min(blocks, b0 + per_round)
        for i in range(slices):
            base = i * blocks * block_bytes
            start = base + b0 * block_bytes
            start -= start % PAGE
            end = min(nbytes, -(-(base + b1 * block_bytes) // PAGE) * PAGE)
            for o in range(start, end, POPULATE_CHUNK):  # (a block of more than a chunk)
                ranges.append((o, min(POPULATE_CHUNK, end - o)))
    return ranges


def idle_priority() -> None:
    """Run the calling thread, and the threads and processes it starts from now on, only on a
    core nothing else wants (SCHED_IDLE, Linux; elsewhere nothing changes).

    Mapping a pool of gigabytes takes a core for seconds (13 s for 5.9 GB on a 2-core VM,
    whose host backs each page on first touch); at normal priority it took that core from
    torch's threads, which wait for each other after every operation, and every step ran at
    a third of its speed until it was done. At idle priority it maps between steps, and a
    step that writes a page it has not reached yet faults it in, as without it. A kernel build
    in the background (`atom kernels --idle`) is the same case."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _huge_region(nbytes: int) -> tuple[torch.Tensor, int, mmap.mmap]:
    """Bytes, the 2 MiB-aligned offset in them where `nbytes` start, advised into huge pages
    (a hint: refused where THP is off), and the mapping they lie in (which lives exactly as
    long as some tensor on it). The unused head and tail are address space only.

    A private anonymous mapping of its own, not the heap: with `keep_freed_memory_mapped`
    glibc serves allocations up to 1 GiB from memory earlier work already faulted in on
    4 KiB pages, which the advice does not change, and keeps it when the tensor dies; an own
    mapping starts untouched and is unmapped with the last tensor that uses it.
    """
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds `mapping` for as long as it lives
    start = -raw.data_ptr() % HUGE_PAGE  # huge pages need 2 MiB-aligned ranges
    if nbytes and not os.environ.get("ATOM_DISABLE_HUGE_PAGES"):
        _madvise()(raw.data_ptr() + start, nbytes, MADV_HUGEPAGE)
    return raw, start, mapping


def release_freed_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc `malloc_trim`): after loading, the
    checkpoint's tensors that weights were copied out of (into kernels' layouts, the
    `weight_arena`) would otherwise stay mapped under `keep_freed_memory_mapped`'s threshold
    (SmolLM2 in float32: 1.9 GB resident after load, 1.46 GB trimmed)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class WeightArena:
    """Consecutive weights in shared regions of huge pages (most are smaller than one page).

    A region holds at least `REGION` bytes and lives as long as any tensor placed in it.
    """

    REGION = 64 << 20
    ALIGN = 64  # a cache line: a streamed row starts on one

    def __init__(self) -> None:
        self._raw: torch.Tensor | None = None
        self._next = self._end = 0

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of `t` in the arena (same shape, dtype and values)."""
        nbytes = t.numel() * t.element_size()
        offset = -self._next % self.ALIGN + self._next
        if self._raw is None or offset + nbytes > self._end:
            size = max(self.REGION, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
            self._raw, offset, _ = _huge_region(size)
            self._end = offset + size
        self._next = offset + nbytes
        out = self._raw[offset : offset + nbytes].view(t.dtype).view(t.shape)
        return out.copy_(t)


_arena: contextvars.ContextVar[WeightArena | None] = contextvars.ContextVar("atom_weight_arena", default=None)


@contextlib.contextmanager
def weight_arena(enabled: bool = True) -> Iterator[None]:
    """Within it, `resident` places weights in huge pages (unless not `enabled`: weights that
    will not be streamed would only pin their regions); the arena lets go of its last region at exit."""
    token = _arena.set(WeightArena() if enabled and _madvise() is not None else None)
    try:
        yield
    finally:
        _arena.reset(token)


def resident(t: torch.Tensor) -> torch.Tensor:
    """`t` moved into the current `weight_arena` (a CPU tensor a decode step streams), else `t` itself.

    Call it on weights the caller then holds alone (the original is freed): a copy beside a
    still-referenced original doubles its memory.
    """
    arena = _arena.get()
    if arena is None or t.device.type != "cpu" or t.numel() == 0:
        return t
    return arena.place(t.detach())


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


def keep_freed_memory_mapped() -> bool:
    """Stop glibc from returning large freed blocks to the OS after every op.

    Each decode step allocates and frees the same multi-megabyte temporaries; by default
    glibc unmaps them and the next step page-faults them back in, which cost more than
    the arithmetic (vLLM's CPU backend preloads tcmalloc for the same reason).
    """
    if sys.platform != "linux" or os.environ.get("ATOM_KEEP_MALLOC_DEFAULTS"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read free memory; set kv_cache_memory or num_kvcache_blocks")
