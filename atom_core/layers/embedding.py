"""Embeddings whose table lives in another layer's kernel: a tied LM head's quantized weight
(`quant.QuantizedEmbedding`) or its streaming kernel's tiled copy (`linear.StreamedEmbedding`).

Why one base: code that shares a model's token embedding (a draft model's proposer) accepts
any of them as it accepts `nn.Embedding`, and each checks its ids as `nn.Embedding` does
(the kernels' layouts would wrap a negative id or read a padding row instead of failing).
"""

from __future__ import annotations

import torch
from torch import nn


class LookupEmbedding(nn.Module):
    """`num_embeddings` rows of `embedding_dim`; a subclass reads them (`rows`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of the 1-D `ids` (all within the table), [len(ids), embedding_dim]."""
        raise NotImplementedError

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() and not torch.compiler.is_compiling():  # a traced graph takes the engine's checked ids
            low, high = (int(v) for v in torch.aminmax(flat))
            if low < 0 or high >= self.num_embeddings:
                bad = low if low < 0 else high
                raise IndexError(f"token id {bad} is outside the embedding table's {self.num_embeddings} rows")
        return self.rows(flat).reshape(*ids.shape, self.embedding_dim)
