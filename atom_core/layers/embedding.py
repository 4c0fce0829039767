"""Embeddings whose table lives in another layer's kernel: a tied LM head's quantized weight
(`QuantizedEmbedding`) or its streaming kernel's tiled copy (`linear.StreamedEmbedding`).

Why one base: code that shares a model's token embedding (a draft model's proposer) accepts
any of them as it accepts `nn.Embedding`, and each checks its ids as `nn.Embedding` does
(the kernels' layouts would wrap a negative id or read a padding row instead of failing).
"""

from __future__ import annotations

import torch
from torch import nn

from atom_core.layers.graph_capture import recording
from atom_core.layers.quantized_weight import QuantizedWeight


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
        # a traced or recorded graph takes the engine's checked ids
        if flat.numel() and not (torch.compiler.is_compiling() or recording()):
            low, high = (int(v) for v in torch.aminmax(flat))
            if low < 0 or high >= self.num_embeddings:
                bad = low if low < 0 else high
                raise IndexError(f"token id {bad} is outside the embedding table's {self.num_embeddings} rows")
        return self.rows(flat).reshape(*ids.shape, self.embedding_dim)


def tied_embeddings(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) for each `nn.Embedding` of `model` and each other module sharing its
    weight (a tied LM head): where the embedding may read its rows from that module's kernel."""
    names = {id(m.weight): n for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    return [
        (names[id(m.weight)], m)
        for m in model.modules()
        if not isinstance(m, nn.Embedding) and getattr(m, "weight", None) is not None and id(m.weight) in names
    ]


def replace_embedding(model: nn.Module, name: str, embedding: LookupEmbedding) -> None:
    """Put `embedding` where `model`'s submodule `name` was."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, embedding)


class QuantizedEmbedding(LookupEmbedding):
    """An embedding tied to a quantized LM head: rows are dequantized as they are looked up.

    Keeps no float copy of the table; for a GGUF Q8_0 table the rows are exactly the file's.
    """

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype):
        super().__init__(*qw.shape)
        self.qw, self.dtype = qw, dtype

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qw.dequantize(self.dtype, rows=ids)
