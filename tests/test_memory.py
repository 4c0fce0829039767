"""`empty_resident`: a pool whose pages are mapped before the first step writes them."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import pytest

torch = pytest.importorskip("torch")

from conftest import require_kernel  # noqa: E402

from atom_core.platform import memory  # noqa: E402
from atom_core.platform.memory import HUGE_PAGE, empty_resident  # noqa: E402

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


@linux_only
def test_a_pool_is_mapped_in_the_background_at_idle_priority(monkeypatch):
    """The mapping thread runs only on a core nothing else wants: at normal priority it took a
    core from torch's threads, and every step until it finished ran at a third of its speed."""
    policies = []
    real = memory.idle_priority

    def spy() -> None:
        real()
        policies.append(os.sched_getscheduler(0))  # the calling thread's

    monkeypatch.setattr(memory, "idle_priority", spy)
    t = empty_resident((1 << 20,), torch.float32, "cpu")
    memory._populating[-1][0].join()
    assert policies == [os.SCHED_IDLE]
    assert resident_fraction(t.data_ptr(), t.numel() * t.element_size()) == 1.0
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's own priority is untouched
    empty_resident((1 << 10,), torch.float32, "cpu", wait=True)  # mapped by the caller: no change
    assert policies == [os.SCHED_IDLE] and os.sched_getscheduler(0) == os.SCHED_OTHER


def advised_huge(monkeypatch) -> list[tuple[int, int]]:
    """The ranges `memory` advises into huge pages from now on."""
    real, ranges = memory._madvise(), []

    def spy(address: int, nbytes: int, advice: int) -> int:
        if advice == memory.MADV_HUGEPAGE:
            ranges.append((address, nbytes))
        return real(address, nbytes, advice)

    monkeypatch.setattr(memory, "_madvise", lambda: spy)
    return ranges


def inside(t: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    return any(a <= start and end <= a + n for a, n in ranges)


@linux_only
def test_weight_arena_packs_weights_into_huge_page_regions(monkeypatch):
    ranges = advised_huge(monkeypatch)
    small = [torch.randn(5, 7), torch.randn(96, 64).bfloat16(), torch.randint(0, 255, (33,), dtype=torch.uint8)]
    big = torch.randn(memory.WeightArena.REGION // 4 + 3)
    with memory.weight_arena():
        placed = [memory.resident(t) for t in small + [big]]
    for t, p in zip(small + [big], placed):
        assert torch.equal(t, p) and p.dtype == t.dtype and p.is_contiguous() and p.data_ptr() != t.data_ptr()
        assert p.data_ptr() % memory.WeightArena.ALIGN == 0 and inside(p, ranges)
    # Small weights share one region, 2 MiB-aligned; one larger than a region gets its own.
    regions = {p.untyped_storage().data_ptr() for p in placed[:3]}
    assert len(regions) == 1 and placed[3].untyped_storage().data_ptr() not in regions
    assert all(a % HUGE_PAGE == 0 for a, _ in ranges)
    placed[0].add_(1)  # a placed weight is its own memory
    assert torch.equal(placed[0], small[0] + 1) and torch.equal(placed[1], small[1])


def mapping_of(address: int) -> dict[str, int] | None:
    """The /proc/self/smaps entry (start, end and its kB fields) of the mapping holding `address`."""
    entry = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                if entry is not None and entry["start"] <= address < entry["end"]:
                    return entry
                start, end = (int(a, 16) for a in head[0].split("-"))
                entry = {"start": start, "end": end}
            elif entry is not None and len(head) == 3 and head[2] == "kB":
                entry[head[0].rstrip(":")] = int(head[1])
    return entry if entry is not None and entry["start"] <= address < entry["end"] else None


def thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


@linux_only
@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off here")
def test_arena_regions_get_huge_pages_even_after_the_heap_was_used():
    """The engine keeps freed memory mapped (`keep_freed_memory_mapped`): from the heap, a
    region would reuse pages already faulted in small. Its own mapping does not."""
    from atom_core.runner.model_runner import keep_freed_memory_mapped

    keep_freed_memory_mapped()
    junk = torch.ones(300 << 20, dtype=torch.uint8)  # what loading leaves behind
    del junk
    with memory.weight_arena():
        w = memory.resident(torch.randn(4 << 20))  # 16 MiB
    region = mapping_of(w.data_ptr())
    assert region is not None and region["AnonHugePages"] >= 2048, region


@linux_only
def test_a_region_is_unmapped_with_its_last_weight():
    import gc

    with memory.weight_arena():
        a, b = memory.resident(torch.randn(1000)), memory.resident(torch.randn(1000))
    address = a.data_ptr()
    assert mapping_of(address) is not None
    del a
    gc.collect()
    assert mapping_of(address) is not None and torch.isfinite(b).all()  # b still holds the region
    del b
    gc.collect()
    assert mapping_of(address) is None


def test_resident_outside_an_arena_is_the_tensor_itself():
    t = torch.randn(4, 4)
    assert memory.resident(t) is t


@linux_only
def test_huge_pages_can_be_switched_off(monkeypatch):
    ranges = advised_huge(monkeypatch)
    monkeypatch.setenv("ATOM_DISABLE_HUGE_PAGES", "1")
    with memory.weight_arena():
        p = memory.resident(torch.randn(64, 64))
    empty_resident((1 << 20,), torch.float32, "cpu", wait=True)
    assert p.shape == (64, 64) and not ranges


@linux_only
def test_loaded_weights_stream_from_huge_pages_once(tmp_path, monkeypatch):
    from model_utils import build_tiny_model

    from atom_core.engine.llm_engine import LLMEngine
    from atom_core.layers.gemm import StreamingGemm, gemv_ops
    from atom_core.layers.linear import Linear, StreamedEmbedding
    from atom_core.layers.quantized_gemm import StreamingGroupGemm

    require_kernel(gemv_ops())
    build_tiny_model("llama_tied_rope3", tmp_path)
    ranges = advised_huge(monkeypatch)
    engine = LLMEngine(tmp_path, dtype="float32", num_kvcache_blocks=16, max_model_len=64)
    model = engine.runner.model
    streamed = [m.gemm for m in model.modules() if isinstance(m, Linear)]
    streamed = [getattr(g, "inner", g) for g in streamed]
    assert streamed and all(isinstance(g, StreamingGemm) and inside(g.tiled, ranges) for g in streamed)
    # The tied embedding reads the LM head's tiled copy: the table is not held a third time.
    embedding = model.model.embed_tokens
    assert isinstance(embedding, StreamedEmbedding) and embedding.tiled is model.lm_head.gemm.inner.tiled
    screen = model.lm_head.gemm.kernel  # the greedy screen's 8-bit copy, made at load
    assert screen is not None and all(inside(t, ranges) for t in (screen.qweight, screen.scales, screen.mins))

    # 4-bit weights: the integer kernel's tiles.
    engine = LLMEngine(tmp_path, dtype="float32", quantization="int4", num_kvcache_blocks=16, max_model_len=64)
    kernels = [m.packed_weight for m in engine.runner.model.modules() if isinstance(m, Linear) and not m.is_lm_head]
    assert kernels and all(isinstance(k, StreamingGroupGemm) for k in kernels)
    assert all(inside(t, ranges) for k in kernels for t in (k.qweight, k.scales, k.mins))


def test_populate_ranges_cover_a_pool_lowest_blocks_first():
    """A KV pool [K/V, layers, heads, blocks, block_size, dim] is mapped a round of blocks at a
    time in every slice, so the blocks a block manager hands out first are mapped first."""
    shape, itemsize = (2, 3, 2, 10_000, 16, 8), 4  # blocks of 512 bytes: rounds of 4096 blocks
    block_bytes, blocks, slices = 16 * 8 * itemsize, 10_000, 2 * 3 * 2
    ranges = memory.populate_ranges(shape, itemsize, block_dim=3)
    nbytes = slices * blocks * block_bytes
    covered = bytearray(nbytes // PAGE)
    for offset, length in ranges:
        assert offset % PAGE == 0 and 0 < length <= memory.POPULATE_CHUNK and offset + length <= nbytes
        first, last = offset // PAGE, -(-(offset + length) // PAGE)
        covered[first:last] = b"\1" * (last - first)
    assert all(covered)
    # the round of each range (the blocks it starts in, within its slice): never decreasing,
    # and every slice has its share of a round before the next round starts
    rounds = [(offset % (blocks * block_bytes)) // block_bytes // 4096 for offset, _ in ranges]
    assert rounds == sorted(rounds) and set(rounds) == {0, 1, 2}
    assert rounds.count(0) == slices and {offset // (blocks * block_bytes) for offset, _ in ranges[:slices]} == set(
        range(slices)
    )
    # without a block dimension: end to end, as before
    plain = memory.populate_ranges(shape, itemsize)
    assert plain[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(plain, plain[1:]))
    assert sum(n for _, n in plain) == nbytes


@linux_only
def test_a_pool_with_a_block_dimension_is_mapped_whole():
    t = empty_resident((2, 3, 2, 5000, 16, 8), torch.float32, "cpu", wait=True, block_dim=3)
    assert resident_fraction(t.data_ptr(), t.numel() * t.element_size()) == 1.0
    t.fill_(2.0)
    assert t.sum().item() == 2.0 * t.numel()
