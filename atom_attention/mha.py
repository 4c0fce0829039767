"""Multi-head (and grouped-query) attention: split K/V pools, one pair of tensors for all layers."""

from __future__ import annotations

import numpy as np
import torch

from atom_core.attention import AttentionMetadata, AttentionMetadataBuilder, KVCacheTensor
from atom_core.scheduler import ScheduledBatch
from atom_attention.torch_paged import TorchPagedAttention


class MHAMetadataBuilder(AttentionMetadataBuilder):
    """Pool layout `[2, layers, blocks, kv_heads, block_size, head_dim]` (K then V).

    Heads before tokens inside a block, so a decode kernel multiplies whole blocks
    without a transpose.
    """

    impl_cls = TorchPagedAttention

    def __init__(self, runner, layers):
        super().__init__(runner, layers)
        shapes = {(m.num_kv_heads, m.head_dim) for m in self.layers}
        if len(shapes) != 1:
            raise ValueError(f"MHA layers of one model must share (kv_heads, head_dim); got {sorted(shapes)}")
        self.num_kv_heads, self.head_dim = shapes.pop()
        self.kv_cache: torch.Tensor | None = None
        self.impl = self.impl_cls()

    def compute_block_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * len(self.layers) * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def allocate_kv_cache_tensors(self, num_kv_heads, num_draft_layers):
        shape = (
            2,
            len(self.layers) + num_draft_layers,
            self.runner.num_kvcache_blocks,
            self.num_kv_heads,
            self.block_size,
            self.head_dim,
        )
        self.kv_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        return {"kv_cache": self.kv_cache}

    def build_kv_cache_tensor(self, layer_id, module):
        i = self._index.get(id(module))
        if i is None:
            return None
        module.k_cache = self.kv_cache[0, i]
        module.v_cache = self.kv_cache[1, i]
        module.impl = self.impl
        return KVCacheTensor(layer_num=layer_id, k_cache=module.k_cache, v_cache=module.v_cache)

    def build(self, batch: ScheduledBatch) -> AttentionMetadata:
        meta = super().build(batch)
        bs = self.block_size
        slots = meta.slot_mapping
        meta.extra["slot_block"] = slots // bs
        meta.extra["slot_offset"] = slots % bs
        if meta.max_seqlen_q == 1:
            # Decode: one work unit per (request, block); the kernel never pads a request
            # to the batch's longest context.
            ctx = meta.context_lens_cpu
            nblocks = (ctx + bs - 1) // bs
            req = np.repeat(np.arange(len(ctx)), nblocks)
            cu = np.zeros(len(ctx) + 1, dtype=np.int64)
            np.cumsum(nblocks, out=cu[1:])
            j = np.arange(int(cu[-1])) - cu[:-1][req]
            valid = np.minimum(ctx[req] - j * bs, bs)
            dev = self.device
            meta.extra["unit_req"] = torch.from_numpy(req).to(dev)
            meta.extra["unit_block"] = torch.from_numpy(meta.block_tables_cpu[req, j]).to(dev)
            mask = np.arange(bs)[None, :] >= valid[:, None]
            meta.extra["unit_mask"] = torch.from_numpy(mask).to(dev)
        return meta
