"""The attention-builder contract: each attention type owns its KV cache layout.

The model runner never branches on attention type. Each builder declares its cache as a
`KVLayout` (`kv_layout()`, derived from the sizing hooks AMD ATOM's builders have:
`compute_block_bytes`, `compute_per_req_cache_bytes`, ...); the runner plans one
`KVPoolPlan` from all of them, hands it to each builder (`bind_pool`), lets each allocate
its tensors and bind them to the modules it recognises. A builder is made from a
`BuilderContext`, not from the runner. A new attention type (MLA, GDN, a ring buffer)
is a subclass registered through `atom_register_attention_builders`; scheduler, block
manager and runner stay untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from atom_core.config import Config
from atom_core.kv.layout import KVLayout, KVPoolPlan
from atom_core.plugins.options import plugin_options

# attrs field metadata key: a field of an `AttentionMetadata.extra` object that a `replayable`
# step never reads (prompt rows' bookkeeping); decode graphs neither compare nor copy it.
STEP_ONLY = "atom_step_only"

if TYPE_CHECKING:
    from atom_core.sched.batch import ScheduledBatch


@attrs.frozen
class BuilderContext:
    """What an attention builder is made from: the settings, the model's config, and where
    and in which dtype the cache lives."""

    config: Config
    hf_config: Any
    device: torch.device
    dtype: torch.dtype

    @property
    def block_size(self) -> int:
        return self.config.kv_cache_block_size

    @classmethod
    def without_engine(
        cls, hf_config: Any = None, *, dtype: torch.dtype, block_size: int = 16, device: str = "cpu", **settings: Any
    ) -> BuilderContext:
        """A context for a builder made outside a model runner (tests, benchmarks): a default
        `Config` with this block size and any other `settings`."""
        config = Config(kv_cache_block_size=block_size, **settings)
        return cls(config=config, hf_config=hf_config, device=torch.device(device), dtype=dtype)


@attrs.define
class KVCacheTensor:
    """One layer's view of the pool, as vLLM describes it."""

    layer_num: int
    k_cache: torch.Tensor | None = None
    v_cache: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


@attrs.define(kw_only=True)
class AttentionMetadata:
    """What every paged-attention kernel needs for one step.

    Rows are requests in batch order: decode rows first, then prompt chunks, each with
    its own query length (`query_start_loc`), so one step may mix both. Tensors live on
    the model's device; the `*_cpu` numpy twins let kernels loop over requests without a
    device sync.
    """

    positions: torch.Tensor  # [num_tokens] position of each scheduled token
    slot_mapping: torch.Tensor  # [num_tokens] pool slot (block * block_size + offset) its KV goes to
    block_tables: torch.Tensor  # [num_reqs, max_blocks], padded with 0 past each request's blocks
    context_lens: torch.Tensor  # [num_reqs] tokens in the KV cache once this step has written
    query_start_loc: torch.Tensor  # [num_reqs + 1] offsets of each request's tokens in the batch
    num_cached_tokens: torch.Tensor  # [num_reqs] prefix served by the cache (prefill)
    max_seqlen_q: int
    max_seqlen_k: int
    positions_cpu: np.ndarray
    slot_mapping_cpu: np.ndarray
    context_lens_cpu: np.ndarray
    query_start_loc_cpu: np.ndarray
    block_tables_cpu: np.ndarray
    # A padding policy's rectangular layout (spyre), None otherwise: every row's table is
    # `left_pad_blocks` padding blocks, then its own blocks, all rows equally wide; a
    # request's keys sit at padded positions [left_pad * block_size, tkv).
    padded_block_tables: torch.Tensor | None = None
    left_pad_blocks_cpu: np.ndarray | None = None
    tkvs_cpu: np.ndarray | None = None
    extra: dict[str, Any] = attrs.field(factory=dict)  # a builder's own per-step fields

    @property
    def num_reqs(self) -> int:
        return len(self.context_lens_cpu)


class AttentionMetadataBuilder:
    """Base class: generic per-step metadata, no-op cache hooks.

    `layers` are the model's attention modules whose `attn_type` names this builder.
    Subclasses set `impl_cls`, the kernel object bound to each module; swapping it is how
    a faster kernel plugs in.
    """

    impl_cls: type | None = None
    # Whether decode graphs (atom_core/runner/decode_graph.py) may replay this builder's layers:
    # its kernels read a step's values only from the tensors of its `AttentionMetadata` (the
    # fields and `extra`; an attrs object in `extra` counts field by field, and a field marked
    # `metadata={STEP_ONLY: True}` is one a decode step never reads), and a step with the same
    # rows and query lengths takes the same path through them. A step run twice must leave
    # what one run leaves (paged KV is rewritten with the same values), or `snapshot_state`
    # must say what it advances (per-request state).
    graph_safe: bool = False
    # The builder's own settings: an attrs class read from `Config.additional_config`
    # (atom_core/plugins/options.py); `self.options` is its instance, None without one.
    options_class: type | None = None

    def __init__(self, context: BuilderContext, layers: list[torch.nn.Module]):
        self.context = context
        self.config = context.config
        self.options: Any = plugin_options(type(self), getattr(context.config, "additional_config", None))
        self.hf_config = context.hf_config
        self.block_size: int = context.block_size
        self.dtype: torch.dtype = context.dtype
        self.device: torch.device = context.device
        self.layers = list(layers)
        self._index = {id(m): i for i, m in enumerate(self.layers)}
        self.pool: KVPoolPlan | None = None  # set by `bind_pool` before anything is allocated

    def kv_layout(self) -> KVLayout:
        """This type's cache as data, for planning: from the sizing hooks below by default."""
        return KVLayout(
            block_bytes=self.compute_block_bytes(),
            state_bytes=self.compute_per_req_cache_bytes(),
            state_slots_per_request=self.slots_per_req(),
            state_checkpoints=self.supports_state_checkpoints(),
        )

    def bind_pool(self, plan: KVPoolPlan) -> None:
        """Called once the pool is planned, before `allocate_kv_cache_tensors`: the counts to allocate for."""
        self.pool = plan

    @property
    def plan(self) -> KVPoolPlan:
        if self.pool is None:
            raise RuntimeError(f"{type(self).__name__}: the KV pool is not planned yet (bind_pool)")
        return self.pool

    # -- KV pool (PR 659 hooks; defaults are no-ops) ---------------------------------

    def compute_block_bytes(self) -> int:
        """Bytes one KV block costs across this builder's layers."""
        return 0

    def allocate_kv_cache_tensors(self, num_kv_heads: int | None, num_draft_layers: int) -> dict[str, torch.Tensor]:
        """Allocate this builder's pool tensors for `self.plan.num_blocks` blocks."""
        return {}

    def build_kv_cache_tensor(self, layer_id: int, module: torch.nn.Module) -> KVCacheTensor | None:
        """Bind cache views to `module` if it is one of ours; None for a foreign module."""
        return None

    def compute_per_req_cache_bytes(self) -> int:
        """Bytes of per-request state (outside the paged pool) one slot costs."""
        return 0

    def slots_per_req(self) -> int:
        return 1

    def allocate_per_req_cache(self, num_slots: int) -> dict[str, torch.Tensor]:
        """Allocate `num_slots` slots of per-request state: `plan.num_state_groups` x `slots_per_req()`
        plus the state checkpoints. Slots 0..G-1 are the groups' own, the next ones the checkpoints
        (the numbers `ScheduledBatch.state_loads` / `state_saves` use), the rest the builder's."""
        return {}

    def supports_state_checkpoints(self) -> bool:
        """Whether this builder honours `ScheduledBatch.state_loads` and `state_saves`.

        A row listed in `state_loads` starts from that checkpoint slot's state instead of
        its group's; for each `(position, slot)` of a row in `state_saves`, the state after
        the sequence's first `position` tokens is copied into that slot. Prefix caching on a
        model with per-request state needs it: cached KV alone cannot rebuild the state.
        """
        return False

    def commit_speculation(self, batch: ScheduledBatch, num_accepted: dict[int, int]) -> None:
        """After verification: row -> drafts accepted, for each row of `batch` that carried drafts.

        Paged KV needs nothing (a rejected position is overwritten next step); a builder
        with per-request state keeps the state after the last accepted token here.
        """

    def replayable(self, meta: AttentionMetadata) -> bool:
        """Whether a decode graph may record or replay the step `meta` describes (every row one
        decode token, which the runner has checked): False where this builder still takes
        another path for some of its rows."""
        return True

    def snapshot_state(self, meta: AttentionMetadata) -> Callable[[], None] | None:
        """Called before a decode graph is recorded and before its first replay, each of
        which the same step's eager run may follow (a recording that fails part way; the check
        of a replay): what puts back the state that step advances in place (a per-request
        recurrence's rows), so that the eager run starts where the other did. None: a step
        rewrites only what it reads anew (paged KV)."""
        return None

    # -- per-step metadata -------------------------------------------------------------

    def build(self, batch: ScheduledBatch) -> AttentionMetadata:
        """Slot mapping, block tables, lengths and offsets for `batch`."""
        bs = self.block_size
        num_q = np.asarray(batch.num_scheduled_tokens, dtype=np.int64)
        ctx = np.asarray(batch.context_lens, dtype=np.int64)
        num_reqs = len(num_q)
        cu_q = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_q, out=cu_q[1:])
        total = int(cu_q[-1])
        req_of_token = np.repeat(np.arange(num_reqs), num_q)
        positions = np.arange(total, dtype=np.int64) - cu_q[:-1][req_of_token] + (ctx - num_q)[req_of_token]
        tables = batch.block_tables
        max_blocks = max(len(t) for t in tables)
        block_tables = np.zeros((num_reqs, max_blocks), dtype=np.int64)
        for i, table in enumerate(tables):
            block_tables[i, : len(table)] = table
        slot_mapping = block_tables[req_of_token, positions // bs] * bs + positions % bs
        if batch.pad_block is not None:
            # Cached positions a policy recomputes (spyre's boundary chunk) write to the padding
            # block: shared blocks are never written, and attention reads the cached copies.
            cached = np.asarray(batch.num_cached_tokens, dtype=np.int64)[req_of_token]
            redirect = positions < cached
            slot_mapping[redirect] = batch.pad_block * bs + positions[redirect] % bs
        dev = self.device

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(dev, non_blocking=True)

        meta = AttentionMetadata(
            positions=t(positions),
            slot_mapping=t(slot_mapping),
            block_tables=t(block_tables),
            context_lens=t(ctx),
            query_start_loc=t(cu_q),
            num_cached_tokens=t(np.asarray(batch.num_cached_tokens, dtype=np.int64)),
            max_seqlen_q=int(num_q.max()),
            max_seqlen_k=int(ctx.max()),
            positions_cpu=positions,
            slot_mapping_cpu=slot_mapping,
            context_lens_cpu=ctx,
            query_start_loc_cpu=cu_q,
            block_tables_cpu=block_tables,
        )
        if batch.left_pad_blocks is not None:
            pads = np.asarray(batch.left_pad_blocks, dtype=np.int64)
            nblocks = -(-ctx // bs)
            width = int((pads + nblocks).max())
            pad_block = batch.pad_block if batch.pad_block is not None else 0
            padded = np.full((num_reqs, width), pad_block, dtype=np.int64)
            for i in range(num_reqs):
                padded[i, pads[i] : pads[i] + nblocks[i]] = block_tables[i, : nblocks[i]]
            meta.padded_block_tables = t(padded)
            meta.left_pad_blocks_cpu = pads
            meta.tkvs_cpu = np.asarray(batch.tkvs, dtype=np.int64)
        return meta
