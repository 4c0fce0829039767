"""The structured-output contract: a backend compiles a request's `StructuredOutputParams` into a
`Grammar`, which says before each token which tokens may come next and follows the ones that do.

Backends sit in the `structured_output_backends` registry (llguidance's is built in as
"guidance"; xgrammar or another can come as a plugin). The mask is data every backend can
fill: one int32 bitmask row per request, bit `t % 32` of word `t // 32` set where token `t` is
allowed (llguidance's and xgrammar's layout), applied to the logits with plain torch ops.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from atom_core.sampling_params import StructuredOutputParams

DEFAULT_BACKEND = "guidance"


class Grammar(ABC):
    """One request's matcher, advanced by every token the request keeps."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (int32, CPU, `bitmask_words(vocab)` wide)."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Follow `token_id`; False if the grammar does not allow it (the matcher is then spent)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the output is complete: nothing may follow (the request ends here)."""


class StructuredOutputBackend(ABC):
    """Built once per engine as `cls(tokenizer, vocab_size, eos_token_ids)`, on the first
    request that asks for it; `compile` is called at `add_request`."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids

    @abstractmethod
    def compile(self, params: StructuredOutputParams) -> Grammar:
        """A fresh matcher for one request; ValueError naming the problem for a bad grammar or schema."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """Every token allowed in every row (a row no grammar fills stays so)."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [rows, vocab] with every token a row's bitmask does not allow set to -inf."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, : logits.shape[-1]].bool()
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))
