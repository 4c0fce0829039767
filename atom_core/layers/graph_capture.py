"""Recording one forward's kernel calls, for a decode graph to replay (`atom_core.runner.decode_graph`).

Why: at a few decode rows, a small model's step spends about as long in the Python that
dispatches its ~10 kernels a layer (module calls, views, checks) as in the kernels. A graph
(vLLM's CUDA graphs, done by hand) records one step's kernel calls with the buffers they wrote;
a later step of the same shape copies its inputs into the recorded inputs and makes just those
calls again, each writing the buffer it wrote before, so every later call reads this step's values.

Two kinds of call are recorded:

* an Atom kernel called through `launch` (it returns a new output and takes the buffer to
  write as a last `out` argument) or `launch_inplace` (it writes its arguments);
* every torch op the forward runs outside those kernels, seen by a `TorchDispatchMode`: an
  in-place op as it is, a functional one as its `.out` overload writing the tensor it returned
  (or, without one, computed anew and copied into it); composite ops as the ops they are made
  of; views and allocations are not replayed (they alias recorded buffers), nor ops without
  tensor inputs (their results are constants). An op whose output shape or control flow
  depends on values (`.item()`, `nonzero`) makes the capture fail: the step then runs eagerly.

A kernel called directly, not through `launch`, is not seen: the graph would replay without it
and read its stale output. `decode_graph` checks each graph once against an eager step before
trusting it, so such a forward falls back to eager instead of answering wrong.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class CaptureUnsupported(RuntimeError):
    """The forward did something a replay cannot repeat; the message names it."""


# ops that make a tensor without computing its values (a later recorded op writes them)
_ALLOCATIONS = {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}
# aliasing ops the dispatcher does not mark as views
_ALIASES = {aten._unsafe_view.default, aten.detach.default, aten.alias.default}
# ops whose results depend on values in a way a replay cannot follow: values read back to Python
# (`.item()`, `bool()`; `.tolist()` and `.numpy()` dispatch only the conj/neg resolution),
# tensors made from Python data (`torch.tensor(...)`: a replay would keep the recorded step's)
# and outputs shaped by values
_DATA_DEPENDENT = {
    aten._local_scalar_dense.default,
    aten.lift_fresh.default,
    aten.lift_fresh_copy.default,
    aten.is_nonzero.default,
    aten.resolve_conj.default,
    aten.resolve_neg.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.unique_consecutive.default,
    aten._unique2.default,
}


def _out_overload(func: torch._ops.OpOverload, outputs: int) -> tuple[torch._ops.OpOverload, list[str]] | None:
    """`func`'s out= twin and its out arguments' names: the overload taking the same arguments
    plus one tensor per output (`out`; `values, indices` for topk and sort)."""
    signature = [(a.name, str(a.type)) for a in func._schema.arguments]
    packet = func.overloadpacket
    for overload in packet.overloads():
        op = getattr(packet, overload)
        outs = [a.name for a in op._schema.arguments if a.is_out]
        if (
            len(outs) == outputs
            and (outputs > 1 or outs == ["out"])
            and [(a.name, str(a.type)) for a in op._schema.arguments if not a.is_out] == signature
        ):
            return op, outs
    return None


def _copy_into(result: torch.Tensor, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
    result.copy_(func(*args, **kwargs))


def tensors(values: Any) -> Iterator[torch.Tensor]:
    """The tensors in a call's arguments, nested lists, tuples and dicts included."""
    if isinstance(values, torch.Tensor):
        yield values
    elif isinstance(values, (list, tuple)):
        for v in values:
            yield from tensors(v)
    elif isinstance(values, dict):
        for v in values.values():
            yield from tensors(v)


def _has_tensor(values: Any) -> bool:
    return next(tensors(values), None) is not None


Call = tuple[Callable[..., Any], tuple, dict]


def storage_key(t: torch.Tensor) -> int:
    """Which buffer `t` lies in: tensors viewing the same storage share it."""
    return t.untyped_storage().data_ptr()


def _whole(t: torch.Tensor) -> bool:
    """Whether `t` is its storage, every byte of it (a fresh output, not a view or a part)."""
    return (t._base is None and t.numel() > 0 and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())  # fmt: skip


class Recorder(TorchDispatchMode):
    """The calls of one forward, in order, as `(callable, args, kwargs)` a replay repeats."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []
        # buffers a recorded call made and wrote whole: their values never outlive a replay, so
        # a graph may lay them out anew (`graph_arena`)
        self.produced: set[int] = set()
        self._inside = 0  # > 0 while a launched kernel runs: its own torch ops are its business

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._inside or func in _ALLOCATIONS:
            return func(*args, **kwargs)
        if func in _DATA_DEPENDENT:
            raise CaptureUnsupported(f"{func} depends on tensor values")
        # A composite op (`to`, `reshape`, `contiguous`) may copy or alias: its parts are what run.
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:
                result = func.decompose(*args, **kwargs)
            if result is not NotImplemented:
                return result
        if func in _ALIASES or func.is_view:
            return func(*args, **kwargs)
        if not _has_tensor(args) and not _has_tensor(kwargs):  # a constant
            return func(*args, **kwargs)
        if func._schema.is_mutable:  # in place, or an out= call: repeated as it is
            result = func(*args, **kwargs)
            self.calls.append((func, args, kwargs))
            return result
        result = func(*args, **kwargs)
        outputs = (result,) if isinstance(result, torch.Tensor) else tuple(result)
        if not outputs or not all(isinstance(t, torch.Tensor) for t in outputs):
            raise CaptureUnsupported(f"{func} returns {type(result).__name__}, not tensors")
        self._produce(outputs, (args, kwargs))
        twin = _out_overload(func, len(outputs))
        if twin is not None:
            op, names = twin
            self.calls.append((op, args, {**kwargs, **dict(zip(names, outputs))}))
        elif len(outputs) == 1:  # computed anew and copied in (`_to_copy.out` takes no dtype, for one)
            self.calls.append((_copy_into, (result, func, args, kwargs), {}))
        else:
            raise CaptureUnsupported(f"{func} has no out= form for its {len(outputs)} outputs")
        return result

    def kernel(self, kernel: Callable[..., Any], args: tuple, returns_out: bool) -> Any:
        self._inside += 1
        try:
            result = kernel(*args)
        finally:
            self._inside -= 1
        if returns_out:
            self._produce((result,), args)
        self.calls.append((kernel, (*args, result) if returns_out else args, {}))
        return result

    def _produce(self, outputs: tuple[torch.Tensor, ...], inputs: Any) -> None:
        read = {storage_key(t) for t in tensors(inputs)}  # an output that is an input was not made here
        self.produced.update(key for t in outputs if _whole(t) and (key := storage_key(t)) not in read)


_recorder: Recorder | None = None


def recording() -> bool:
    """Whether a graph is being recorded (a layer skips checks that read tensor values then)."""
    return _recorder is not None


@contextmanager
def record() -> Iterator[Recorder]:
    """Record the calls made inside the block (one forward)."""
    global _recorder
    if _recorder is not None:
        raise RuntimeError("a graph is already being recorded")
    recorder = Recorder()
    _recorder = recorder
    try:
        with recorder:
            yield recorder
    finally:
        _recorder = None


def launch(kernel: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """`kernel(*args)`, a kernel that returns a new tensor and takes `out` after `args`
    (every argument before it given): recorded with the tensor it returned as that `out`."""
    recorder = _recorder
    if recorder is None:
        return kernel(*args)
    return recorder.kernel(kernel, args, True)


def launch_inplace(kernel: Callable[..., Any], *args: Any) -> Any:
    """`kernel(*args)`, a kernel that writes into its arguments: recorded as it is."""
    recorder = _recorder
    if recorder is None:
        return kernel(*args)
    return recorder.kernel(kernel, args, False)
