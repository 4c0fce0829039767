"""Log probabilities as vLLM reports them: log-softmax of the raw logits, float32.

Taken before temperature, top-k or top-p, so they measure the model (perplexity,
quantization quality), not the sampling settings.
"""

from __future__ import annotations

import torch

# One position's entry: the chosen token's log probability first, then the top n (a token
# in both appears once).
Logprobs = dict[int, float]


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[Logprobs]:
    """`logits`: [n, vocab] raw scores; `token_ids`: the token each row chose (or was given)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(token_ids, device=logp.device)[:, None])[:, 0].tolist()
    out: list[Logprobs] = [{t: c} for t, c in zip(token_ids, chosen)]
    if num_top:
        values, ids = logp.topk(num_top, dim=-1)
        for entry, vs, ts in zip(out, values.tolist(), ids.tolist()):
            for t, v in zip(ts, vs):
                entry.setdefault(t, v)
    return out
