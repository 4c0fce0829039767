"""CPU paged attention through the C++ kernel in `csrc/` (see `cpu_kernels`).

Decode rows, and any rows bringing a few new tokens each, read K/V where they lie in the
pool: no gather, no padding, float32 accumulation. Long prompt chunks keep torch's fused
attention (`TorchPagedAttention.varlen`), which is faster when many queries share keys. A
mixed step splits at the first long row: decode rows come first in every batch.
"""

from __future__ import annotations

import numpy as np
import torch

from atom_core.attention import AttentionMetadata
from atom_attention import cpu_kernels
from atom_attention.torch_paged import TorchPagedAttention

# Up to this many new tokens per request, the kernel serves the row (it rereads a
# request's K/V for each of its queries, so long prompts go to torch's fused attention).
KERNEL_MAX_QUERY_LEN = 8


class CpuPagedAttention(TorchPagedAttention):
    def __init__(self):
        self.ops = cpu_kernels.load()
        if self.ops is None:
            raise RuntimeError("Atom's C++ CPU attention kernel did not build; see the warning logged above")

    def prepare(self, meta: AttentionMetadata, block_size: int, null_block: int) -> None:
        super().prepare_common(meta, block_size)
        # The kernel takes the leading rows with short queries; torch takes the rest.
        long_rows = np.flatnonzero(np.diff(meta.query_start_loc_cpu) > KERNEL_MAX_QUERY_LEN)
        meta.extra["kernel_reqs"] = int(long_rows[0]) if len(long_rows) else meta.num_reqs

    def forward(
        self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # Every token's KV lands before any request reads (prompts of one batch may share a
        # block). Nothing reads past a request's written positions, so fresh blocks need no clearing.
        self.ops.write_kv(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping)
        if meta.padded_block_tables is not None:
            return self.rectangular(layer, q, meta)
        nk = meta.extra["kernel_reqs"]
        if nk == 0:
            return self.varlen(layer, q, k, v, meta)
        if nk == meta.num_reqs:
            return self._kernel(layer, q, meta, nk)
        out = torch.empty_like(q)
        t = int(meta.query_start_loc_cpu[nk])
        out[:t] = self._kernel(layer, q[:t], meta, nk)
        return self.varlen(layer, q, k, v, meta, first_req=nk, out=out)

    def _kernel(self, layer, q: torch.Tensor, meta: AttentionMetadata, nk: int) -> torch.Tensor:
        if nk == meta.num_reqs:
            tables, lens, starts = meta.block_tables, meta.context_lens, meta.query_start_loc
        else:
            tables, lens, starts = meta.block_tables[:nk], meta.context_lens[:nk], meta.query_start_loc[: nk + 1]
        return self.ops.paged_attention(q, layer.k_cache, layer.v_cache, tables, lens, starts, layer.scale)
