"""Gated DeltaNet ("gdn"): per-request conv and recurrent state instead of a paged KV cache.

Each request that the engine admits is handed one per-request state group (a slot) by the
block manager; this builder owns, for every GDN layer, a conv-state pool
`[slots, conv_dim, K-1]` and a recurrent-state pool `[slots, Hv, Dk, Dv]`, sized through
`compute_per_req_cache_bytes` so the runner's KV budget pays for them first.

Per step, rows are decode rows and prompt chunks of any length (chunked prefill may cut a
prompt at any token). A row whose first position is 0 starts from zero state whatever its
slot holds (slots are reused by later requests and after preemption); any other row
continues from its slot's state, which the previous chunk or token left there.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from atom_core.attention import AttentionMetadata, AttentionMetadataBuilder, KVCacheTensor
from atom_core.scheduler import ScheduledBatch
from atom_attention import gdn_ops

_STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@attrs.define(kw_only=True)
class GDNMetadata:
    """The GDN view of one step (in `AttentionMetadata.extra["gdn"]`), rows in batch order."""

    slots_cpu: np.ndarray  # [num_reqs] state slot (per-request group) of each row
    query_start_loc_cpu: np.ndarray  # [num_reqs + 1]
    has_initial_state_cpu: np.ndarray  # [num_reqs] bool: the row continues earlier tokens
    is_decode_cpu: np.ndarray  # [num_reqs] bool: one token continuing a state (batched step path)
    decode_rows: np.ndarray  # indices of decode rows
    prefill_rows: np.ndarray  # indices of prompt-chunk rows (run one request at a time)
    decode_token_idx: torch.Tensor  # [num_decode] token index of each decode row
    decode_slots: torch.Tensor  # [num_decode] their slots (int64, on device)


class GDNImpl:
    """Plain-torch kernels (`gdn_ops`): batched step for decode rows, chunked per prompt chunk."""

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
            out[idx] = gdn_ops.recurrent_gated_delta_rule_step(q, k, v, g[idx], beta[idx], layer.ssm_state, slots)
        cu = gm.query_start_loc_cpu
        for r in gm.prefill_rows:
            s, e, slot = int(cu[r]), int(cu[r + 1]), int(gm.slots_cpu[r])
            if e == s:
                continue
            cont = bool(gm.has_initial_state_cpu[r])
            x, conv = gdn_ops.causal_conv1d(mixed_qkv[s:e], weight, bias, layer.conv_state[slot] if cont else None)
            layer.conv_state[slot].copy_(conv)
            q, k, v = split(x)
            o, state = gdn_ops.chunk_gated_delta_rule(
                q, k, v, g[s:e], beta[s:e], layer.ssm_state[slot] if cont else None
            )
            layer.ssm_state[slot].copy_(state)
            out[s:e] = o
        return out


class GDNMetadataBuilder(AttentionMetadataBuilder):
    """No paged blocks; one conv + one recurrent state per GDN layer per request slot."""

    impl_cls: type | None = GDNImpl

    def __init__(self, runner, layers):
        super().__init__(runner, layers)
        shapes = {(m.conv_dim, m.conv_kernel_size, m.num_v_heads, m.head_k_dim, m.head_v_dim) for m in self.layers}
        if len(shapes) != 1:
            raise ValueError(f"GDN layers of one model must share their state shapes; got {sorted(shapes)}")
        self.conv_dim, self.kernel_size, self.num_v_heads, self.head_k_dim, self.head_v_dim = shapes.pop()
        name = getattr(self.config, "gdn_state_dtype", "float32")
        if name not in _STATE_DTYPES:
            raise ValueError(f"gdn_state_dtype {name!r} is not supported; choose one of {sorted(_STATE_DTYPES)}")
        self.state_dtype = _STATE_DTYPES[name]
        if getattr(self.config, "enable_prefix_caching", False):
            # A cached prefix would skip tokens whose effect on the recurrent state was never
            # computed for this request; that needs state checkpoints, which come later.
            raise ValueError("prefix caching is not supported yet with Gated DeltaNet (gdn) layers")
        self.impl = self.impl_cls()
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    def compute_block_bytes(self) -> int:
        return 0

    def _conv_elems(self) -> int:
        return self.conv_dim * (self.kernel_size - 1)

    def _ssm_elems(self) -> int:
        return self.num_v_heads * self.head_k_dim * self.head_v_dim

    def compute_per_req_cache_bytes(self) -> int:
        return len(self.layers) * (self._conv_elems() + self._ssm_elems()) * self.state_dtype.itemsize

    def slots_per_req(self) -> int:
        return 1

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
                f"every GDN request needs a per-request state group; got groups {slots.tolist()} "
                f"for {len(num_q)} rows"
            )
        first = np.asarray(batch.num_computed_tokens, dtype=np.int64)
        cu = meta.query_start_loc_cpu
        has_init = first > 0
        is_decode = has_init & (num_q == 1)
        decode_rows = np.flatnonzero(is_decode)
        meta.extra["gdn"] = GDNMetadata(
            slots_cpu=slots,
            query_start_loc_cpu=cu,
            has_initial_state_cpu=has_init,
            is_decode_cpu=is_decode,
            decode_rows=decode_rows,
            prefill_rows=np.flatnonzero(~is_decode),
            decode_token_idx=torch.from_numpy(cu[decode_rows]).to(self.device),
            decode_slots=torch.from_numpy(slots[decode_rows]).to(self.device),
        )
        return meta
