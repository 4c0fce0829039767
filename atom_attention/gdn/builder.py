"""Gated DeltaNet ("gdn"): per-request conv and recurrent state instead of a paged KV cache.

Each request that the engine admits is handed one per-request state group (a slot) by the
block manager; this builder owns, for every GDN layer, a conv-state pool
`[slots, conv_dim, K-1]` and a recurrent-state pool `[slots, Hv, Dk, Dv]`, sized through
`compute_per_req_cache_bytes` so the runner's KV budget pays for them first.

Per step, rows are decode rows and prompt chunks of any length (chunked prefill may cut a
prompt at any token). A row whose first position is 0 starts from zero state whatever its
slot holds (slots are reused by later requests and after preemption); any other row
continues from its slot's state, which the previous chunk or token left there.

With prefix caching, state checkpoints are further slots after the groups: a request that
resumes from a cached prefix starts from a checkpoint slot's state (read in place, no copy),
and a prompt row copies its state at the block boundaries the scheduler names into
checkpoint slots, running the delta rule piecewise up to each (`ScheduledBatch.state_loads`,
`state_saves`).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from atom_attention import cpu_kernels
from atom_attention.gdn import ops as gdn_ops
from atom_core.layers.graph_capture import launch
from atom_core.plugin_api import (
    STEP_ONLY,
    AttentionMetadata,
    AttentionMetadataBuilder,
    KVCacheTensor,
    ScheduledBatch,
    one_of,
)

_STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@attrs.define(kw_only=True)
class GDNMetadata:
    """The GDN view of one step (in `AttentionMetadata.extra["gdn"]`), rows in batch order."""

    # [num_reqs] state slot (per-request group) of each row; decode rows read `decode_slots`
    slots_cpu: np.ndarray = attrs.field(metadata={STEP_ONLY: True})
    # [num_reqs] slot a continuing row starts from: its own, or a checkpoint (prompt rows)
    init_slots_cpu: np.ndarray = attrs.field(metadata={STEP_ONLY: True})
    query_start_loc_cpu: np.ndarray  # [num_reqs + 1]
    has_initial_state_cpu: np.ndarray  # [num_reqs] bool: the row continues earlier tokens
    is_decode_cpu: np.ndarray  # [num_reqs] bool: one token continuing a state (batched step path)
    decode_rows: np.ndarray  # indices of decode rows
    prefill_rows: np.ndarray  # indices of prompt-chunk rows (run one request at a time)
    decode_token_idx: torch.Tensor  # [num_decode] token index of each decode row
    decode_slots: torch.Tensor  # [num_decode] their slots (int64, on device)
    # Prompt rows that save checkpoints: row -> [(tokens of the row before the boundary, checkpoint slot)].
    saves: dict[int, list[tuple[int, int]]] = attrs.field(factory=dict)


class GDNImpl:
    """Plain-torch kernels (`gdn_ops`): batched step for decode rows, chunked per prompt chunk."""

    def decode_step(self, q, k, v, g, beta, states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token for each decode row: `gdn_ops.recurrent_gated_delta_rule_step`'s contract."""
        return gdn_ops.recurrent_gated_delta_rule_step(q, k, v, g, beta, states, slots)

    def forward(
        self, layer, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """mixed_qkv [T, conv_dim] (pre-conv q|k|v), b and a [T, Hv] -> core output [T, Hv, Dv]."""
        gm: GDNMetadata = meta.extra["gdn"]
        n = mixed_qkv.shape[0]
        hk, hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
        key_dim = hk * dk
        weight = layer.conv1d.weight.squeeze(1)  # [C, K]
        bias = layer.conv1d.bias
        beta = b.sigmoid()
        g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
        out = mixed_qkv.new_empty(n, hv, dv)

        def split(x: torch.Tensor):
            t = x.shape[0]
            q, k, v = x.split([key_dim, key_dim, hv * dv], dim=-1)
            return q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv)

        if len(gm.decode_rows):
            idx, slots = gm.decode_token_idx, gm.decode_slots
            x = gdn_ops.causal_conv1d_update(mixed_qkv[idx], weight, bias, layer.conv_state, slots)
            q, k, v = split(x)
            out[idx] = self.decode_step(q, k, v, g[idx], beta[idx], layer.ssm_state, slots)
        cu = gm.query_start_loc_cpu
        for r in gm.prefill_rows:
            s, e, slot = int(cu[r]), int(cu[r + 1]), int(gm.slots_cpu[r])
            if e == s:
                continue
            init = int(gm.init_slots_cpu[r])
            cont = bool(gm.has_initial_state_cpu[r])
            conv0 = layer.conv_state[init] if cont else None
            saves = gm.saves.get(r, ())
            for offset, ckpt in saves:  # before the row's own slot is overwritten: it may be `init`
                layer.conv_state[ckpt].copy_(_conv_state_at(conv0, mixed_qkv[s:e], offset, weight.shape[-1]))
            x, conv = gdn_ops.causal_conv1d(mixed_qkv[s:e], weight, bias, conv0)
            layer.conv_state[slot].copy_(conv)
            q, k, v = split(x)
            state = layer.ssm_state[init] if cont else None
            start = 0
            # Piecewise up to each checkpoint boundary; the state is carried in float32 between pieces.
            for offset, ckpt in [*saves, (e - s, -1)]:
                if offset > start:
                    a, b = s + start, s + offset
                    out[a:b], state = gdn_ops.chunk_gated_delta_rule(
                        q[start:offset], k[start:offset], v[start:offset], g[a:b], beta[a:b], state
                    )
                    start = offset
                if ckpt != -1:
                    layer.ssm_state[ckpt].copy_(state)
            layer.ssm_state[slot].copy_(state)
        return out


class CpuGDNImpl(GDNImpl):
    """Decode rows through the C++ step (`csrc/gdn_cpu.cpp`): each state read from memory once
    and written once, where the torch step streams it three times; prompt chunks as `GDNImpl`."""

    def __init__(self):
        self.ops = cpu_kernels.load_gdn()
        if self.ops is None:
            raise RuntimeError("Atom's C++ GDN kernel did not build; see the warning logged above")

    def decode_step(self, q, k, v, g, beta, states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        q, k = gdn_ops.prep_qk(q, k, v.shape[1], True, None)
        f32 = [t.float().contiguous() for t in (v, g, beta)]
        return launch(self.ops.gdn_decode_step, q.contiguous(), k.contiguous(), *f32, states, slots).to(v.dtype)


def default_impl_cls(device: torch.device) -> type:
    """The C++ decode step on CPU when it builds; the torch step otherwise."""
    if device.type == "cpu" and cpu_kernels.load_gdn() is not None:
        return CpuGDNImpl
    return GDNImpl


def _conv_state_at(conv0: torch.Tensor | None, x: torch.Tensor, offset: int, kernel_size: int) -> torch.Tensor:
    """The conv state after the first `offset` tokens of `x` (the last K-1 pre-conv inputs),
    as `causal_conv1d` would return it for a row ending there."""
    k1 = kernel_size - 1
    tail = x[max(0, offset - k1) : offset].t()
    if conv0 is None:
        conv0 = x.new_zeros(x.shape[1], k1)
    return torch.cat((conv0.to(tail.dtype), tail), dim=-1)[:, -k1:]


@attrs.frozen(kw_only=True)
class GDNOptions:
    """The GDN builder's settings (`Config.additional_config`, or by name to `LLMEngine`)."""

    # Precision of the per-request state: "float32" (exact) or "bfloat16" (half the memory).
    gdn_state_dtype: str = attrs.field(default="float32", validator=one_of(("float32", "bfloat16")))


class GDNMetadataBuilder(AttentionMetadataBuilder):
    """No paged blocks; one conv + one recurrent state per GDN layer per request slot."""

    impl_cls: type | None = None  # None: `default_impl_cls(device)`
    options_class = GDNOptions

    def __init__(self, context, layers):
        super().__init__(context, layers)
        shapes = {(m.conv_dim, m.conv_kernel_size, m.num_v_heads, m.head_k_dim, m.head_v_dim) for m in self.layers}
        if len(shapes) != 1:
            raise ValueError(f"GDN layers of one model must share their state shapes; got {sorted(shapes)}")
        self.conv_dim, self.kernel_size, self.num_v_heads, self.head_k_dim, self.head_v_dim = shapes.pop()
        self.state_dtype = _STATE_DTYPES[self.options.gdn_state_dtype]
        self.impl = (self.impl_cls or default_impl_cls(self.device))()
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    @property
    def graph_safe(self) -> bool:  # type: ignore[override]
        """The C++ decode step reads its slots from a tensor; the torch step on CPU takes each
        slot's row as a Python value, which a replay would keep from the recorded step."""
        return isinstance(self.impl, CpuGDNImpl)

    def replayable(self, meta: AttentionMetadata) -> bool:
        """Steps whose rows all take the batched decode step (none loads or saves a checkpoint)."""
        return len(meta.extra["gdn"].prefill_rows) == 0

    def snapshot_state(self, meta: AttentionMetadata) -> Callable[[], None] | None:
        """A decode step advances its rows' conv and recurrent states in place: copies of those
        rows, and what writes them back."""
        slots = meta.extra["gdn"].decode_slots
        conv, ssm = self.conv_state[:, slots], self.ssm_state[:, slots]  # (indexing copies)

        def restore() -> None:
            self.conv_state[:, slots] = conv
            self.ssm_state[:, slots] = ssm

        return restore

    def compute_block_bytes(self) -> int:
        return 0

    def _conv_elems(self) -> int:
        return self.conv_dim * (self.kernel_size - 1)

    def _ssm_elems(self) -> int:
        return self.num_v_heads * self.head_k_dim * self.head_v_dim

    def compute_per_req_cache_bytes(self) -> int:
        return len(self.layers) * (self._conv_elems() + self._ssm_elems()) * self.state_dtype.itemsize

    def slots_per_req(self) -> int:
        # With speculative decoding a request also keeps the state after each of its k
        # drafts, so the state after the last accepted one can be kept.
        return 1 + self.config.num_speculative_tokens

    def _draft_slot(self, group: int, offset: int) -> int:
        """Slot holding group's state after the first `offset` (1..k) tokens of a draft row:
        past the groups and the checkpoints."""
        plan, k = self.plan, self.config.num_speculative_tokens
        return plan.num_state_groups + plan.num_state_checkpoints + group * k + offset - 1

    def commit_speculation(self, batch, num_accepted):
        spec = batch.scheduled_spec_decode_tokens
        for row, a in num_accepted.items():
            if a < len(spec[batch.req_ids[row]]):  # else the row's own slot already holds the last state
                group = batch.per_req_cache_groups[row]
                kept = self._draft_slot(group, a + 1)  # after the last token and the a accepted drafts
                self.conv_state[:, group].copy_(self.conv_state[:, kept])
                self.ssm_state[:, group].copy_(self.ssm_state[:, kept])

    def supports_state_checkpoints(self) -> bool:
        return True

    def allocate_per_req_cache(self, num_slots: int) -> dict[str, torch.Tensor]:
        n = len(self.layers)
        self.conv_state = torch.zeros(
            (n, num_slots, self.conv_dim, self.kernel_size - 1), dtype=self.state_dtype, device=self.device
        )
        self.ssm_state = torch.zeros(
            (n, num_slots, self.num_v_heads, self.head_k_dim, self.head_v_dim),
            dtype=self.state_dtype,
            device=self.device,
        )
        for i, m in enumerate(self.layers):
            m.conv_state, m.ssm_state, m.impl = self.conv_state[i], self.ssm_state[i], self.impl
        return {"gdn_conv_state": self.conv_state, "gdn_ssm_state": self.ssm_state}

    def build_kv_cache_tensor(self, layer_id, module):
        i = self._index.get(id(module))
        if i is None:
            return None
        module.conv_state, module.ssm_state, module.impl = self.conv_state[i], self.ssm_state[i], self.impl
        return KVCacheTensor(layer_num=layer_id, k_cache=module.conv_state, v_cache=module.ssm_state)

    def build(self, batch: ScheduledBatch) -> AttentionMetadata:
        meta = super().build(batch)
        slots = np.asarray(batch.per_req_cache_groups, dtype=np.int64)
        num_q = np.asarray(batch.num_scheduled_tokens, dtype=np.int64)
        if len(slots) != len(num_q) or (slots < 0).any():
            raise RuntimeError(
                f"every GDN request needs a per-request state group; got groups {slots.tolist()} for {len(num_q)} rows"
            )
        first = np.asarray(batch.num_computed_tokens, dtype=np.int64)
        cu = meta.query_start_loc_cpu
        has_init = first > 0
        is_decode = has_init & (num_q == 1)
        init_slots = slots
        saves: dict[int, list[tuple[int, int]]] = {}
        if batch.state_loads or batch.state_saves:
            init_slots = slots.copy()
            for r, ckpt in batch.state_loads.items():
                init_slots[r] = ckpt
                is_decode[r] = False  # the batched step updates a slot in place; this row reads another
            for r, points in batch.state_saves.items():
                saves[r] = [(position - int(first[r]), ckpt) for position, ckpt in points]
                is_decode[r] = False
        spec = batch.scheduled_spec_decode_tokens
        if spec:
            # A row verifying n drafts saves its state after each of its first n tokens.
            saves = dict(saves)
            for r, rid in enumerate(batch.req_ids):
                n = len(spec.get(rid, ()))
                if n:
                    saves[r] = [(j, self._draft_slot(int(slots[r]), j)) for j in range(1, n + 1)]
                    is_decode[r] = False
        decode_rows = np.flatnonzero(is_decode)
        meta.extra["gdn"] = GDNMetadata(
            slots_cpu=slots,
            init_slots_cpu=init_slots,
            saves=saves,
            query_start_loc_cpu=cu,
            has_initial_state_cpu=has_init,
            is_decode_cpu=is_decode,
            decode_rows=decode_rows,
            prefill_rows=np.flatnonzero(~is_decode),
            decode_token_idx=torch.from_numpy(cu[decode_rows]).to(self.device),
            decode_slots=torch.from_numpy(slots[decode_rows]).to(self.device),
        )
        return meta
