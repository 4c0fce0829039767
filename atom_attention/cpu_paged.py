"""CPU paged attention through the C++ kernel in `csrc/` (see `cpu_kernels`).

Decode, and any step whose requests bring a few new tokens each, read K/V where they lie
in the pool: no gather, no padding, float32 accumulation. Long prompts keep torch's fused
attention (`TorchPagedAttention.varlen`), which is faster when many queries share keys.
"""

from __future__ import annotations

import torch

from atom_core.attention import AttentionMetadata
from atom_attention import cpu_kernels
from atom_attention.torch_paged import TorchPagedAttention

# Up to this many new tokens per request, the kernel serves the step (it rereads a
# request's K/V for each of its queries, so long prompts go to torch's fused attention).
KERNEL_MAX_QUERY_LEN = 8


class CpuPagedAttention(TorchPagedAttention):
    def __init__(self):
        self.ops = cpu_kernels.load()
        if self.ops is None:
            raise RuntimeError("Atom's C++ CPU attention kernel did not build; see the warning logged above")

    def prepare(self, meta: AttentionMetadata, block_size: int, null_block: int) -> None:
        pass  # the kernel reads the generic fields; nothing per step of its own

    def forward(
        self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # Every token's KV lands before any request reads (prompts of one batch may share a
        # block). Nothing reads past a request's written positions, so fresh blocks need no clearing.
        self.ops.write_kv(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping)
        if meta.max_seqlen_q <= KERNEL_MAX_QUERY_LEN:
            return self.ops.paged_attention(
                q, layer.k_cache, layer.v_cache, meta.block_tables, meta.context_lens, meta.query_start_loc,
                layer.scale,
            )
        return self.varlen(layer, q, k, v, meta)
