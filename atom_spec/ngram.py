"""Prompt lookup ("ngram"): draft the tokens that followed the last time the context's tail appeared.

No weights and no forward pass: for copy-heavy work (rewriting a passage, editing code,
answering from a document) the continuation is often already in the request's own tokens.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from atom_core.speculative import Drafts, ProposalInput, Proposer


def lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens after the earliest earlier occurrence of the longest matching suffix."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows starting before the suffix itself, with at least one token after them.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, runner, spec_config):
        super().__init__(runner, spec_config)
        self.min_n = spec_config.prompt_lookup_min
        self.max_n = spec_config.prompt_lookup_max

    def propose(self, inp: ProposalInput) -> list[Drafts | None]:
        out: list[Drafts | None] = []
        for seq, new, limit in zip(inp.seqs, inp.new_token_ids, inp.max_drafts):
            if not limit:
                out.append(None)
                continue
            tokens = np.asarray(seq.token_ids + list(new), dtype=np.int64)
            found = lookup(tokens, self.min_n, self.max_n, limit)
            out.append(Drafts(found) if found else None)
        return out
