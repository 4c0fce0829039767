"""The attention layer models place; the kernel behind it belongs to a builder."""

from __future__ import annotations

import torch
from torch import nn

from atom_core.forward_context import get_forward_context
from atom_core.layers.linear import shard_rows


class Attention(nn.Module):
    """Paged attention over this layer's slice of the KV pool.

    `attn_type` names the builder (from the "attention_builders" registry) that sizes,
    allocates and binds this layer's cache and supplies the kernel (`impl`).
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        layer_id: int,
        attn_type: str = "mha",
        *,
        sliding_window: int | None = None,
        sinks: bool = False,
        logit_softcap: float | None = None,
    ):
        """`sliding_window`: a query at position p sees keys p - window + 1 .. p (transformers'
        rule; None: every earlier key). `sinks`: a learned logit per head (the `sinks` parameter,
        loaded from the checkpoint) joins each softmax and is dropped (GPT-OSS).
        `logit_softcap`: scores become cap * tanh(score / cap) before the softmax (Gemma 2)."""
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens or None, got {sliding_window!r}")
        if logit_softcap is not None and not logit_softcap > 0:
            raise ValueError(f"logit_softcap must be positive or None, got {logit_softcap!r}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.layer_id = layer_id
        self.attn_type = attn_type
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        # float32 whatever the model's dtype, as the softmax it joins
        self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), requires_grad=False) if sinks else None
        if self.sinks is not None:
            shard_rows(self.sinks)  # tensor parallel: this rank's heads
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.impl = None

    @property
    def plain(self) -> bool:
        """Causal attention over every earlier key, none of the options above: the fast paths' case."""
        return self.sliding_window is None and self.sinks is None and self.logit_softcap is None

    @property
    def out_features(self) -> int:
        """Width of what `forward` returns per token (the compiled path's contract, `atom_core.runner.compile`)."""
        return self.num_heads * self.head_dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [tokens, heads * head_dim], k and v: [tokens, kv_heads * head_dim]."""
        if self.impl is None:
            raise RuntimeError(f"attention layer {self.layer_id} has no KV cache bound; run it through a ModelRunner")
        meta = get_forward_context().attn_metadata_by_type[self.attn_type]
        n, d = q.shape[0], self.head_dim
        out = self.impl.forward(
            self, q.view(n, self.num_heads, d), k.view(n, self.num_kv_heads, d), v.view(n, self.num_kv_heads, d), meta
        )
        return out.reshape(n, self.num_heads * d)

    def extra_repr(self) -> str:
        extra = "".join(
            f", {name}={value}"
            for name, value in (("sliding_window", self.sliding_window), ("logit_softcap", self.logit_softcap))
            if value is not None
        ) + (", sinks" if self.sinks is not None else "")
        return (
            f"type={self.attn_type}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, layer={self.layer_id}{extra}"
        )
