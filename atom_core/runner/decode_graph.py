"""Decode graphs: a step of a few decode rows replays the kernel calls of an earlier one.

vLLM captures CUDA graphs per decode batch size; on a CPU there is no driver to replay
launches, but the Python that issues them is what costs: about as long as the kernels at one
row on a small model. `ModelRunner` calls the model through `DecodeGraphs`, which

* for a step of N requests decoding one token each (N <= `Config.max_graph_capture_size`),
  the first time: runs the model eagerly while `graph_capture.record` writes down every
  kernel and torch op with the buffers it wrote (`StepGraph`);
* the second time: replays the graph, then runs the step eagerly as well, and keeps the graph
  only if the two hidden states are equal bit for bit (the replay first: an eager run would
  write the KV a missed kernel should have, and hide it; what the replay advanced in place,
  a builder's `snapshot_state`, is put back before the eager run); where they differ, or where the
  forward cannot be recorded, every step runs eagerly from then on, said once in the log;
* from then on: copies the step's inputs and attention metadata into the recorded tensors and
  replays.

A step of another shape, or whose metadata does not fit the recorded tensors (another
number of rows, a branch the recording did not take), runs eagerly. Only attention builders
that declare `graph_safe` take part.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import attrs
import numpy as np
import torch
from torch import nn

from atom_core.forward_context import get_forward_context
from atom_core.layers.graph_capture import Call, CaptureUnsupported, record, storage_key
from atom_core.runner.attention_builder import STEP_ONLY, AttentionMetadata, AttentionMetadataBuilder
from atom_core.runner.graph_arena import GraphArena, plan

logger = logging.getLogger("atom")


def _tensor_fields(meta: AttentionMetadata) -> list[tuple[str, torch.Tensor | None]]:
    fields = [(f.name, getattr(meta, f.name)) for f in attrs.fields(type(meta)) if f.name != "extra"]
    return [(name, value) for name, value in fields if value is None or isinstance(value, torch.Tensor)]


def _widen_block_tables(meta: AttentionMetadata, width: int) -> None:
    """Give `meta` block tables `width` wide, so that later steps' (longer) tables fit the recorded one."""
    tables = meta.block_tables
    if tables.shape[1] < width:
        wide = tables.new_zeros((tables.shape[0], width))
        wide[:, : tables.shape[1]] = tables
        meta.block_tables = wide


class StepGraph:
    """One recorded forward: its calls, the tensors they were given, and the output they wrote."""

    def __init__(self, calls: list[Call], inputs: tuple[torch.Tensor, ...], metas: dict[str, AttentionMetadata],
                 output: torch.Tensor):  # fmt: skip
        self.calls, self.inputs, self.metas, self.output = calls, inputs, metas, output
        self.checked = False

    def load(self, inputs: tuple[torch.Tensor, ...], metas: dict[str, AttentionMetadata]) -> bool:
        """Copy this step's inputs and metadata into the recorded tensors; False where they do not fit."""
        if metas.keys() != self.metas.keys():
            return False
        # keyed by the recorded tensor: the positions input is also the metadata's field, copied once
        copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {
            id(was): (was, now) for was, now in zip(self.inputs, inputs)
        }
        for kind, new in metas.items():
            old = self.metas[kind]
            for (name, was), (_, now) in zip(_tensor_fields(old), _tensor_fields(new)):
                if was is None or now is None:
                    if was is not now:
                        return False
                    continue
                recorded = id(was)
                if name == "block_tables" and now.shape[0] == was.shape[0] and now.shape[1] <= was.shape[1]:
                    was = was[:, : now.shape[1]]  # the columns past `now`'s keep older blocks: never read
                copies[recorded] = (was, now)
            if old.extra.keys() != new.extra.keys():
                return False
            for key, was in old.extra.items():
                if not _extra_fits(was, new.extra[key], copies):
                    return False
        if any(not isinstance(now, torch.Tensor) or was.shape != now.shape or was.dtype != now.dtype
               for was, now in copies.values()):  # fmt: skip
            return False
        for was, now in copies.values():
            if was.data_ptr() != now.data_ptr():
                was.copy_(now)
        return True

    def replay(self) -> torch.Tensor:
        for fn, args, kwargs in self.calls:
            fn(*args, **kwargs)
        return self.output


def _extra_fits(was: Any, now: Any, copies: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether `now` (an `extra` value of this step) fits `was` (the recorded step's): a tensor
    is copied in, an attrs object field by field (but its `STEP_ONLY` fields), anything else
    is a value the recorded step branched on and must be equal."""
    if isinstance(was, torch.Tensor):
        copies[id(was)] = (was, now)
        return True
    if attrs.has(type(was)):
        return type(now) is type(was) and all(
            _extra_fits(getattr(was, f.name), getattr(now, f.name), copies)
            for f in attrs.fields(type(was))
            if not f.metadata.get(STEP_ONLY)
        )
    return _same(was, now)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


class DecodeGraphs:
    """`model(input_ids, positions)`, replaying a recorded graph for decode steps of up to `max_size` rows."""

    def __init__(self, model: Callable[..., torch.Tensor], max_size: int, max_blocks: int,
                 builders: dict[str, AttentionMetadataBuilder]):  # fmt: skip
        self.model, self.max_size, self.max_blocks, self.builders = model, max_size, max_blocks, builders
        self.graphs: dict[int, StepGraph | None] = {}  # rows -> graph (None: this size runs eagerly)
        self.arena = GraphArena()  # the graphs' intermediate buffers, shared
        self.replays = 0  # steps served by a replay (tests and benchmarks read it)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        metas: dict[str, AttentionMetadata] = ctx.attn_metadata_by_type
        n = input_ids.shape[0]
        if not (0 < n <= self.max_size and not ctx.context.is_prefill and metas
                and all(m.max_seqlen_q == 1 and m.num_reqs == n and m.padded_block_tables is None
                        and self.builders[kind].replayable(m) for kind, m in metas.items())):  # fmt: skip
            return self.model(input_ids, positions)
        if n not in self.graphs:
            return self._capture(n, input_ids, positions, metas)
        graph = self.graphs[n]
        if graph is None or not graph.load((input_ids, positions), metas):
            return self.model(input_ids, positions)
        if graph.checked:
            self.replays += 1
            return graph.replay()
        restores = self._snapshot(metas)
        replayed = graph.replay().clone()
        self._restore(restores)  # the state the replay advanced, back for the eager run
        eager = self.model(input_ids, positions)
        if torch.equal(replayed, eager):
            graph.checked = True
        else:
            self._off(n, "the decode graph of %d rows differed from the eager step (a kernel called past `launch`?)")
        return eager

    def _snapshot(self, metas: dict[str, AttentionMetadata]) -> list[Callable[[], None] | None]:
        """What puts back the state this step's rows advance in place (`snapshot_state`)."""
        return [self.builders[kind].snapshot_state(meta) for kind, meta in metas.items()]

    @staticmethod
    def _restore(restores: list[Callable[[], None] | None]) -> None:
        for restore in restores:
            if restore is not None:
                restore()

    def _off(self, n: int, why: str) -> None:
        """Every step eagerly from now on: what failed at one row count is the model's forward."""
        self.graphs[n], self.max_size = None, 0
        logger.warning("atom: " + why + "; decode steps run eagerly", n)

    def _capture(self, n: int, input_ids: torch.Tensor, positions: torch.Tensor,
                 metas: dict[str, AttentionMetadata]) -> torch.Tensor:  # fmt: skip
        for meta in metas.values():
            _widen_block_tables(meta, self.max_blocks)
        restores = self._snapshot(metas)
        try:
            with record() as recorder:
                output = self.model(input_ids, positions)
        except CaptureUnsupported as e:
            # the layers before the one that could not be recorded have run: put back the state
            # they advanced in place (a GDN layer's), or the eager run would advance it twice
            self._restore(restores)
            self._off(n, f"a decode step of %d rows cannot be recorded ({e})")
            return self.model(input_ids, positions)
        template, needs = plan(recorder.calls, recorder.produced, keep={storage_key(output)})
        graph = StepGraph([], (input_ids, positions), dict(metas), output)
        graph.calls = self.arena.add(template, needs, graph, output.device)
        self.graphs[n] = graph
        return output


def decode_graphs(model: nn.Module, run_model: Callable, config: Any, builders: dict[str, Any],
                  tensor_parallel: bool) -> Callable:  # fmt: skip
    """`run_model` behind decode graphs where they apply, else `run_model` itself (with one log line why)."""
    size = config.max_graph_capture_size
    if size == 0 or run_model is not model:  # off, or the compiled path
        return run_model
    why = None
    if tensor_parallel:
        why = "tensor parallel (collectives are not recorded)"
    elif config.speculative_config is not None:
        why = "speculative decoding (its proposer reads hidden states a replay does not keep)"
    elif unsafe := sorted(t for t, b in builders.items() if not getattr(b, "graph_safe", False)):
        why = f"attention builders {', '.join(unsafe)} are not graph_safe"
    if why:
        logger.info("atom: decode graphs off: %s", why)
        return run_model
    block_size = config.kv_cache_block_size
    return DecodeGraphs(run_model, size, -(-config.max_model_len // block_size), builders)
