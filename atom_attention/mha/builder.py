"""Multi-head (and grouped-query) attention: split K/V pools, one pair of tensors for all layers."""

from __future__ import annotations

import torch

from atom_attention import cpu_kernels
from atom_attention.mha.cpu_paged import CpuPagedAttention
from atom_attention.mha.torch_paged import TorchPagedAttention
from atom_core.plugin_api import (
    AttentionMetadata,
    AttentionMetadataBuilder,
    KVCacheTensor,
    ScheduledBatch,
    empty_resident,
)


def default_impl_cls(device: torch.device) -> type:
    """The C++ kernel on CPU when it builds; the portable torch path otherwise."""
    if device.type == "cpu" and cpu_kernels.load() is not None:
        return CpuPagedAttention
    return TorchPagedAttention


class MHAMetadataBuilder(AttentionMetadataBuilder):
    """Pool layout `[2, layers, kv_heads, blocks, block_size, head_dim]` (K then V).

    Heads outermost, so one head's run of blocks is a contiguous matrix once gathered.
    """

    impl_cls: type | None = None  # None: `default_impl_cls(device)`

    def __init__(self, context, layers):
        super().__init__(context, layers)
        shapes = {(m.num_kv_heads, m.head_dim) for m in self.layers}
        if len(shapes) != 1:
            raise ValueError(f"MHA layers of one model must share (kv_heads, head_dim); got {sorted(shapes)}")
        self.num_kv_heads, self.head_dim = shapes.pop()
        self.kv_cache: torch.Tensor | None = None
        self.impl = (self.impl_cls or default_impl_cls(self.device))()

    @property
    def graph_safe(self) -> bool:  # type: ignore[override]
        """The C++ kernel's decode reads only the metadata's tensors; the torch path slices by
        Python values, which a replay would keep from the recorded step."""
        return isinstance(self.impl, CpuPagedAttention)

    def compute_block_bytes(self) -> int:
        return 2 * len(self.layers) * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def allocate_kv_cache_tensors(self, num_kv_heads, num_draft_layers):
        # One block past the pool stays zero: decode chunks pad with it (vLLM's null block).
        self.null_block = self.plan.num_blocks
        shape = (
            2,
            len(self.layers) + num_draft_layers,
            self.num_kv_heads,
            self.null_block + 1,
            self.block_size,
            self.head_dim,
        )
        self.kv_cache = empty_resident(shape, self.dtype, self.device, block_dim=3)
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
        self.impl.prepare(meta, self.block_size, self.null_block)
        return meta
