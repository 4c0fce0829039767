"""Prompt lookup ("ngram"): draft the tokens that followed the last time the context's tail appeared.

No weights and no forward pass: for copy-heavy work (rewriting a passage, editing code,
answering from a document) the continuation is often already in the request's own tokens.
"""

from __future__ import annotations

import numpy as np

from atom_core.plugin_api import Drafts, ProposalInput, Proposer


def lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens after the earliest earlier occurrence of the longest matching suffix.

    A byte search over the ids as int64 (`bytes.find`, in C), kept to whole-token offsets:
    it runs for every drafting request every step, mostly finding nothing in free text,
    where numpy's windowed compare cost ~50 us a suffix length.
    """
    length = len(tokens)
    data = tokens.astype(np.int64, copy=False).tobytes()
    hay = data[: 8 * (length - 1)]  # a match must leave a token after it
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = data[8 * (length - n) :]
        pos = hay.find(suffix)
        while pos > 0 and pos % 8:  # a match straddling token boundaries: look further
            pos = hay.find(suffix, pos + 1)
        if pos >= 0:
            start = pos // 8 + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    skips_idle_steps = True  # reads only the request's tokens
    supports_tensor_parallel = True  # no model: rank 0 alone proposes

    def __init__(self, context, spec_config):
        super().__init__(context, spec_config)
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
