"""CPU paged attention through the C++ kernel in `csrc/` (see `cpu_kernels`).

Every row reads K/V where they lie in the pool: no gather, no padding, float32
accumulation. The kernel walks a request with a few new tokens (decode, drafts to verify)
one token at a time, and tiles a long run of them (a prompt chunk) where it has a vector
path for the head dim and dtype (`ops.TILED_HEAD_DIMS`; float32, bfloat16, float16; on CPUs
with AMX its bfloat16 products run in AMX tiles); elsewhere long runs keep torch's fused
attention (`TorchPagedAttention.varlen`), which beats walking the keys once per token. A mixed
step splits at the first long row: decode rows come first in every batch.
"""

from __future__ import annotations

import numpy as np
import torch

from atom_attention import cpu_kernels
from atom_attention.mha.torch_paged import TorchPagedAttention
from atom_core.layers.graph_capture import launch, launch_inplace
from atom_core.plugin_api import AttentionMetadata

# Up to this many new tokens a request, the kernel walks the keys once per token (as in
# csrc/, kShortQuery); longer runs are tiled, or go to torch's fused attention.
KERNEL_MAX_QUERY_LEN = 8
TILED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CpuPagedAttention(TorchPagedAttention):
    def __init__(self):
        self.ops = cpu_kernels.load()
        if self.ops is None:
            raise RuntimeError("Atom's C++ CPU attention kernel did not build; see the warning logged above")

    def prepare(self, meta: AttentionMetadata, block_size: int, null_block: int) -> None:
        super().prepare_common(meta, block_size)
        # Where the kernel does not tile, it takes the leading rows with short queries and torch the rest.
        runs = np.diff(meta.query_start_loc_cpu)
        long_rows = np.flatnonzero(runs > KERNEL_MAX_QUERY_LEN)
        meta.extra["kernel_reqs"] = int(long_rows[0]) if len(long_rows) else meta.num_reqs

    def tiles(self, layer, q: torch.Tensor) -> bool:
        """Whether the kernel tiles this layer's long query runs: where it has a vector path
        for the head dim and cache dtype."""
        return q.shape[-1] in self.ops.TILED_HEAD_DIMS and layer.k_cache.dtype in TILED_DTYPES

    def forward(
        self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # Every token's KV lands before any request reads (prompts of one batch may share a
        # block). Nothing reads past a request's written positions, so fresh blocks need no clearing.
        launch_inplace(self.ops.write_kv, k, v, layer.k_cache, layer.v_cache, meta.slot_mapping)
        if meta.padded_block_tables is not None:
            return self.rectangular(layer, q, meta)
        nk = meta.extra["kernel_reqs"]
        if nk == meta.num_reqs or self.tiles(layer, q):
            return self._kernel(layer, q, meta, meta.num_reqs)
        # long runs the kernel does not tile: `varlen` (torch's fused attention, or the eager
        # path a layer with options needs)
        if nk == 0:
            return self.varlen(layer, q, k, v, meta)
        out = torch.empty_like(q)
        t = int(meta.query_start_loc_cpu[nk])
        out[:t] = self._kernel(layer, q[:t], meta, nk)
        return self.varlen(layer, q, k, v, meta, first_req=nk, out=out)

    def _kernel(self, layer, q: torch.Tensor, meta: AttentionMetadata, nk: int) -> torch.Tensor:
        if nk == meta.num_reqs:
            tables, lens, starts = meta.block_tables, meta.context_lens, meta.query_start_loc
        else:
            tables, lens, starts = meta.block_tables[:nk], meta.context_lens[:nk], meta.query_start_loc[: nk + 1]
        return launch(
            self.ops.paged_attention, q, layer.k_cache, layer.v_cache, tables, lens, starts, layer.scale,
            layer.sliding_window or 0, layer.logit_softcap or 0.0, layer.sinks,
        )  # fmt: skip
