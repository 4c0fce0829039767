"""One memory arena for the intermediate buffers of every decode graph.

Why: a recorded graph (`decode_graph`) keeps every buffer its forward wrote, so a graph of N rows
held N rows of every activation of every layer, and graphs for each row count up to 32 held
hundreds of MB. A buffer a recorded call writes whole is only needed from that call to the last
one reading it: no value in it outlives a replay. So, as vLLM's CUDA graphs share one memory
pool, such buffers are laid out by their lifetimes in one arena that every graph shares (graphs
never run at the same time): a graph costs the most bytes alive at one of its calls, not the sum
of its buffers.

What stays a graph's own: its inputs, its output (read after the replay), the model's weights
and caches, and any buffer not made whole by a recorded call (an `empty` a later call fills in
part, a constant made without tensor inputs).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from atom_core.layers.graph_capture import Call, storage_key, tensors

ALIGN = 64  # bytes: what torch's CPU allocator gives every buffer, and a cache line


@attrs.frozen
class Slot:
    """A tensor of a recorded call, moved into the arena: where its storage starts and how it views it."""

    offset: int  # bytes from the arena's start to the storage's
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements, as the tensor had it in its own storage


def _map(value: Any, fn) -> Any:
    if isinstance(value, torch.Tensor | Slot):
        return fn(value)
    if isinstance(value, list | tuple):  # as `graph_capture.tensors` walks them
        items = [_map(v, fn) for v in value]
        kind: Any = type(value)
        return kind._make(items) if hasattr(kind, "_make") else kind(items)
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    return value


def plan(calls: list[Call], produced: set[int], keep: set[int]) -> tuple[list[Call], int]:
    """`calls` with the tensors of every `produced` buffer (but those in `keep`) as `Slot`s, and
    the arena bytes they need: two buffers share bytes only where no call falls between the first
    and last use of both."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    nbytes: dict[int, int] = {}
    for i, (_, args, kwargs) in enumerate(calls):
        for t in tensors((args, kwargs)):
            key = storage_key(t)
            if key in produced and key not in keep:
                first.setdefault(key, i)
                last[key] = i
                nbytes[key] = -(-t.untyped_storage().nbytes() // ALIGN) * ALIGN
    offsets: dict[int, int] = {}
    live: list[tuple[int, int, int]] = []  # (start, end, last call) of the buffers in use
    total = 0
    for key in sorted(first, key=first.__getitem__):
        now = first[key]
        live = sorted(b for b in live if b[2] >= now)  # a buffer read at `now` is still in use there
        offset = 0
        for start, end, _ in live:  # the lowest gap that fits
            if offset + nbytes[key] <= start:
                break
            offset = max(offset, end)
        live.append((offset, offset + nbytes[key], last[key]))
        offsets[key] = offset
        total = max(total, offset + nbytes[key])

    def slot(t: torch.Tensor) -> torch.Tensor | Slot:
        key = storage_key(t)
        if key not in offsets:
            return t
        return Slot(offsets[key], t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    return [(fn, _map(args, slot), _map(kwargs, slot)) for fn, args, kwargs in calls], total


def bind(template: list[Call], arena: torch.Tensor) -> list[Call]:
    """The calls of `template` with each `Slot` a view of `arena` (bytes)."""
    views: dict[Slot, torch.Tensor] = {}

    def view(value: torch.Tensor | Slot) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value
        if value not in views:
            itemsize = value.dtype.itemsize
            base = arena.view(value.dtype)  # the arena's bytes are a multiple of ALIGN, so of every itemsize
            views[value] = base.as_strided(value.size, value.stride, value.offset // itemsize + value.storage_offset)
        return views[value]

    return [(fn, _map(args, view), _map(kwargs, view)) for fn, args, kwargs in template]


class GraphArena:
    """The bytes every graph's planned buffers live in; grown (and the graphs rebound) as a larger one is added."""

    def __init__(self) -> None:
        self.arena: torch.Tensor | None = None
        self.templates: list[tuple[list[Call], Any]] = []  # (template, the graph to rebind)

    @property
    def nbytes(self) -> int:
        return 0 if self.arena is None else self.arena.numel()

    def add(self, template: list[Call], needs: int, graph: Any, device: torch.device) -> list[Call]:
        """Take a graph's planned calls; return them bound to the arena (`graph.calls` of the graphs
        added before is rebound if the arena grew)."""
        self.templates.append((template, graph))
        if needs > self.nbytes:
            self.arena = torch.empty(-(-needs // ALIGN) * ALIGN, dtype=torch.uint8, device=device)
            for other_template, other in self.templates[:-1]:
                other.calls = bind(other_template, self.arena)
        return bind(template, self.arena) if self.arena is not None else template
