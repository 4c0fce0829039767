"""Multi-head latent attention (DeepSeek-V2/V3): the layer models place; the "mla" builder owns its cache.

The cache holds one latent row per token, `[c_kv | k_pe]` (`kv_lora_rank` +
`qk_rope_head_dim` values), shared by every head. `kv_b_proj` expands a latent into the
heads' `k_nope` and `v`; its two halves are W_UK and W_UV, which the kernel either folds
into the query and the output (absorbed) or applies to the latents (expanded).
"""

from __future__ import annotations

import torch
from torch import nn

from atom_core.forward_context import get_forward_context


class MLAAttention(nn.Module):
    """Paged attention over latent rows; `impl` (the builder's kernel) picks absorbed or expanded.

    `kv_b_proj` belongs to the model (checkpoint names stay the model's); this layer keeps
    a reference, not a submodule, and reads W_UK and W_UV as views of its weight.
    """

    def __init__(
        self,
        num_heads: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_lora_rank: int,
        scale: float,
        kv_b_proj: nn.Linear,
        layer_id: int,
        attn_type: str = "mla",
    ):
        super().__init__()
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.latent_dim = kv_lora_rank + qk_rope_head_dim
        self.scale = scale
        self._kv_b_proj = (kv_b_proj,)  # a tuple: not registered twice
        self.layer_id = layer_id
        self.attn_type = attn_type
        self.kv_cache: torch.Tensor | None = None  # [blocks, block_size, latent_dim], bound by the builder
        self.impl = None

    @property
    def kv_b_weight(self) -> torch.Tensor:
        """[heads * (qk_nope + v), kv_lora_rank]"""
        return self._kv_b_proj[0].weight

    @property
    def w_uk(self) -> torch.Tensor:
        """[heads, qk_nope, kv_lora_rank]: k_nope = W_UK c_kv."""
        w = self.kv_b_weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim]

    @property
    def w_uv(self) -> torch.Tensor:
        """[heads, v, kv_lora_rank]: v = W_UV c_kv."""
        w = self.kv_b_weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, self.qk_nope_head_dim :]

    @property
    def out_features(self) -> int:
        """Width of what `forward` returns per token (the compiled path's contract)."""
        return self.num_heads * self.v_head_dim

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """q_nope: [tokens, heads, qk_nope]; q_pe: [tokens, heads, qk_rope] (roped); c_kv: [tokens,
        kv_lora_rank] (normalised); k_pe: [tokens, qk_rope] (roped) -> [tokens, heads * v_head_dim]."""
        if self.impl is None:
            raise RuntimeError(f"MLA layer {self.layer_id} has no KV cache bound; run it through a ModelRunner")
        meta = get_forward_context().attn_metadata_by_type[self.attn_type]
        out = self.impl.forward(self, q_nope, q_pe, c_kv, k_pe, meta)
        return out.reshape(out.shape[0], self.num_heads * self.v_head_dim)

    def extra_repr(self) -> str:
        return (
            f"type={self.attn_type}, heads={self.num_heads}, latent={self.kv_lora_rank}+{self.qk_rope_head_dim}, "
            f"qk_nope={self.qk_nope_head_dim}, v={self.v_head_dim}, layer={self.layer_id}"
        )
