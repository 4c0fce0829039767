"""Multi-head (and grouped-query) attention: split K/V pools, one pair of tensors for all layers."""

from __future__ import annotations

import numpy as np
import torch

from atom_core.attention import AttentionMetadata, AttentionMetadataBuilder, KVCacheTensor
from atom_core.scheduler import ScheduledBatch
from atom_attention.torch_paged import TorchPagedAttention


# Decode chunks hold at most this many blocks; the size is picked per step.
MAX_CHUNK_BLOCKS = 16
# What one more chunk costs, in gathered blocks: small matrix products are inefficient.
CHUNK_OVERHEAD_BLOCKS = 2
# Up to this many requests, decode runs one fused attention call per request instead.
PER_REQUEST_DECODE_MAX = 4


def chunk_size(nblocks: np.ndarray) -> int:
    """The chunk size (in blocks) that gathers least, counting padding and per-chunk overhead."""
    sizes = np.arange(1, min(MAX_CHUNK_BLOCKS, int(nblocks.max())) + 1)
    nchunks = -(-nblocks[None, :] // sizes[:, None])  # [sizes, requests]
    cost = (nchunks * (sizes[:, None] + CHUNK_OVERHEAD_BLOCKS)).sum(axis=1)
    return int(sizes[np.argmin(cost)])


class MHAMetadataBuilder(AttentionMetadataBuilder):
    """Pool layout `[2, layers, kv_heads, blocks, block_size, head_dim]` (K then V).

    Heads outermost, so one head's run of blocks is a contiguous matrix once gathered.
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
        # One block past the pool stays zero: decode chunks pad with it (vLLM's null block).
        self.null_block = self.runner.num_kvcache_blocks
        shape = (
            2,
            len(self.layers) + num_draft_layers,
            self.num_kv_heads,
            self.null_block + 1,
            self.block_size,
            self.head_dim,
        )
        self.kv_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.kv_cache[:, :, :, self.null_block].zero_()
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
        bs, dev = self.block_size, self.device
        slots = meta.slot_mapping
        meta.extra["slot_block"] = slots // bs
        meta.extra["slot_offset"] = slots % bs
        fresh = meta.slot_mapping_cpu[meta.positions_cpu % bs == 0] // bs  # blocks getting their first token
        meta.extra["fresh_blocks"] = torch.from_numpy(fresh).to(dev)
        if meta.max_seqlen_q == 1 and meta.num_reqs > PER_REQUEST_DECODE_MAX:
            meta.extra.update(self._decode_chunks(meta))
        return meta

    def _decode_chunks(self, meta: AttentionMetadata) -> dict[str, torch.Tensor]:
        """Split each request's blocks into chunks of c blocks; padding stays under one chunk a request."""
        bs = self.block_size
        ctx = meta.context_lens_cpu
        nblocks = (ctx + bs - 1) // bs
        c = chunk_size(nblocks)
        nchunks = (nblocks + c - 1) // c
        req = np.repeat(np.arange(len(ctx)), nchunks)
        first = np.zeros(len(ctx) + 1, dtype=np.int64)
        np.cumsum(nchunks, out=first[1:])
        chunk_in_req = np.arange(len(req)) - first[:-1][req]
        block_idx = chunk_in_req[:, None] * c + np.arange(c)[None, :]  # [C, c] index into the request's table
        table = meta.block_tables_cpu
        blocks = table[req[:, None], np.minimum(block_idx, table.shape[1] - 1)]
        # Past a request's last block: the null block. Those slots are masked, and zeros
        # times a zero weight stay zero.
        blocks = np.where(block_idx < nblocks[req][:, None], blocks, self.null_block)
        token_pos = block_idx[:, :, None] * bs + np.arange(bs)[None, None, :]  # [C, c, bs]
        mask = (token_pos >= ctx[req][:, None, None]).reshape(len(req), c * bs)
        dev = self.device
        return {
            "chunk_req": torch.from_numpy(req).to(dev),
            "chunk_blocks": torch.from_numpy(blocks.reshape(-1)).to(dev),
            "chunk_mask": torch.from_numpy(mask).to(dev),
        }
