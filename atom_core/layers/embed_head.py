"""The vocabulary split across tensor-parallel ranks: the token embedding and the LM head.

Each rank holds `ceil(vocab / ranks)` rows (the last rank's tail padded with zeros). The
embedding looks up the ids in its range, zeros the others, and the ranks' rows are summed
(one all-reduce); the LM head computes its rows' logits and `gather_logits` joins them in
vocabulary order (vLLM's `VocabParallelEmbedding` and `ParallelLMHead`). One rank: a plain
table and a plain head.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from atom_core.distributed.communication import all_gather, all_reduce
from atom_core.distributed.parallel_state import get_tp_group
from atom_core.layers.checkpoint_slice import reads_slices
from atom_core.layers.linear import Linear


def vocab_range(num_embeddings: int) -> tuple[int, int, int]:
    """(first row, rows held, rows per rank) of this rank's part of the vocabulary."""
    tp = get_tp_group()
    per_rank = -(-num_embeddings // tp.world_size)
    start = tp.rank * per_rank
    return start, max(0, min(per_rank, num_embeddings - start)), per_rank


def vocab_rows(loaded: Any, num_embeddings: int, start: int, rows: int) -> Any:
    """This rank's rows of a whole-vocabulary checkpoint tensor (or `CheckpointSlice`, or GGUF's blocks)."""
    if loaded.shape[0] != num_embeddings:
        raise ValueError(f"the vocabulary has {num_embeddings} rows, the checkpoint tensor {tuple(loaded.shape)}")
    return loaded.narrow(0, start, rows)


def load_vocab_rows(param: nn.Parameter, loaded: torch.Tensor, num_embeddings: int, start: int, rows: int) -> None:
    """This rank's rows of a whole-vocabulary checkpoint tensor (the padding rows stay zero)."""
    with torch.no_grad():
        param.data[:rows].copy_(vocab_rows(loaded, num_embeddings, start, rows))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.start, self.rows, per_rank = vocab_range(num_embeddings)
        self.weight = nn.Parameter(torch.zeros(per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        reads_slices(self.weight)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: Any = None) -> None:
        load_vocab_rows(param, loaded, self.num_embeddings, self.start, self.rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if get_tp_group().world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(Linear):
    """This rank's rows of the output projection (`is_lm_head`); `gather_logits` joins every
    rank's logits into the whole vocabulary's."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False):
        self.num_embeddings = num_embeddings
        self.start, self.rows, per_rank = vocab_range(num_embeddings)
        super().__init__(embedding_dim, per_rank, bias=bias)
        with torch.no_grad():
            self.weight.zero_()
            if bias:
                self.bias.zero_()
        self.is_lm_head = True
        for param in self.parameters():
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
            reads_slices(param)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: Any = None) -> None:
        load_vocab_rows(param, loaded, self.num_embeddings, self.start, self.rows)

    def rank_part(self, loaded: Any, shard: Any = None) -> Any:
        """This rank's rows of the whole head's GGUF blocks, padded as the float weight is."""
        return vocab_rows(loaded, self.num_embeddings, self.start, self.rows).pad_rows(self.out_features)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[tokens, vocab]: every rank's logits in vocabulary order (the padding rows dropped)."""
        if get_tp_group().world_size == 1:
            return local[..., : self.num_embeddings]
        return all_gather(local, dim=-1)[..., : self.num_embeddings]


def vocab_embedding(num_embeddings: int, embedding_dim: int) -> nn.Module:
    """The token embedding: split across the ranks, or at one rank a plain `nn.Embedding` (which
    a streamed LM head tied to it may replace, `process_weights`)."""
    if get_tp_group().world_size == 1:
        return nn.Embedding(num_embeddings, embedding_dim)
    return VocabParallelEmbedding(num_embeddings, embedding_dim)


def lm_head(num_embeddings: int, embedding_dim: int, bias: bool = False) -> Linear:
    """The output projection: split across the ranks, or at one rank a plain `Linear`."""
    if get_tp_group().world_size == 1:
        return Linear(embedding_dim, num_embeddings, bias=bias)
    return ParallelLMHead(num_embeddings, embedding_dim, bias=bias)


def compute_logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """`head(hidden)`, every rank's vocabulary rows joined: [tokens, vocab]."""
    logits = head(hidden)
    return head.gather_logits(logits) if isinstance(head, ParallelLMHead) else logits
