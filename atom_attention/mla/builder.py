"""Multi-head latent attention: one latent row per token and layer, no per-head K or V.

Pool layout `[layers, blocks + 1, block_size, kv_lora_rank + qk_rope_head_dim]`: each row is
the normalised `c_kv` then the roped `k_pe`, exactly what `MLAAttention` caches. For
DeepSeek-V3 in bf16 that is 61 x 576 x 2 = 70,272 bytes a token, against 61 x 128 heads
x (192 + 128) x 2 = 4,997,120 for the expanded K/V. The block past the pool stays zero
(the torch decode's null block). The runner's `num_kv_heads` does not apply and is ignored.
"""

from __future__ import annotations

import torch

from atom_attention import cpu_kernels
from atom_attention.mla.paged import CpuMLAAttention, TorchMLAAttention
from atom_core.plugin_api import (
    AttentionMetadata,
    AttentionMetadataBuilder,
    KVCacheTensor,
    ScheduledBatch,
    empty_resident,
)


def default_impl_cls(device: torch.device) -> type:
    """The C++ latent kernel on CPU when it builds; the portable torch path otherwise."""
    if device.type == "cpu" and cpu_kernels.load() is not None:
        return CpuMLAAttention
    return TorchMLAAttention


class MLAMetadataBuilder(AttentionMetadataBuilder):
    impl_cls: type | None = None  # None: `default_impl_cls(device)`

    def __init__(self, context, layers):
        super().__init__(context, layers)
        dims = {m.latent_dim for m in self.layers}
        if len(dims) != 1:
            raise ValueError(f"MLA layers of one model must share the latent width; got {sorted(dims)}")
        self.latent_dim = dims.pop()
        self.kv_cache: torch.Tensor | None = None
        self.impl = (self.impl_cls or default_impl_cls(self.device))()

    @property
    def graph_safe(self) -> bool:  # type: ignore[override]
        """The C++ kernel's decode, as MHA's: every value it reads is a metadata tensor."""
        return isinstance(self.impl, CpuMLAAttention)

    def compute_block_bytes(self) -> int:
        return len(self.layers) * self.block_size * self.latent_dim * self.dtype.itemsize

    def allocate_kv_cache_tensors(self, num_kv_heads, num_draft_layers):
        self.null_block = self.plan.num_blocks
        shape = (len(self.layers) + num_draft_layers, self.null_block + 1, self.block_size, self.latent_dim)
        self.kv_cache = empty_resident(shape, self.dtype, self.device, block_dim=1)
        self.kv_cache[:, self.null_block].zero_()
        return {"mla_kv_cache": self.kv_cache}

    def build_kv_cache_tensor(self, layer_id, module):
        i = self._index.get(id(module))
        if i is None:
            return None
        module.kv_cache = self.kv_cache[i]
        module.impl = self.impl
        return KVCacheTensor(layer_num=layer_id, k_cache=module.kv_cache)

    def build(self, batch: ScheduledBatch) -> AttentionMetadata:
        meta = super().build(batch)
        self.impl.prepare(meta, self.block_size, self.null_block)
        return meta
