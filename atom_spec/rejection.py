"""Lossless verification of speculative drafts (rejection sampling, Leviathan et al. 2023).

Why the output is distributed exactly as the target's. At one position let p be the
target distribution (after temperature, top-k and top-p, as the plain sampler shapes it)
and q the distribution the draft d was drawn from. Accepting d with probability
min(1, p(d)/q(d)) emits x through acceptance with probability q(x) min(1, p(x)/q(x)) =
min(p(x), q(x)). A rejection happens with probability sum_x max(p(x) - q(x), 0), and then
x is drawn from max(p - q, 0) normalised, adding max(p(x) - q(x), 0). The two sum to
min(p, q) + max(p - q, 0) = p(x). When d is accepted, the next row of logits is the
target's own distribution given the prefix plus d, and the next draft was drawn from the
proposer's q given that same prefix, so the argument repeats position by position. After
a rejection the later drafts hang on a token that was not emitted and are dropped; when
every draft is accepted the bonus row is plain sampling from p. By induction every
emitted token is drawn from the target's conditional given the tokens before it.

Two conditions the argument needs from the caller:
- `q` must be the distribution the draft was really drawn from. A proposer that drafts
  by argmax (or any deterministic rule, e.g. n-gram lookup) passes `None`: q is then
  one-hot on d, acceptance has probability p(d), and a rejection draws from p with d
  removed, which is the same identity. Passing the draft model's softmax for an argmax
  draft is NOT lossless.
- the uniform and the noise used at a position must be independent of the draft: they
  come from this sampler's generator, or for a seeded request from a generator keyed by
  (seed, token index) that a proposer must not reuse for drafting.

Greedy requests (temperature 0 or top_k 1) are the limit of the above: a draft is kept
while it equals the target's argmax, and the token emitted after it is that argmax, so
the output is token for token what non-speculative greedy decoding gives.

Tokens are drawn with the exponential race (argmax of r / E, E ~ Exp(1)) as in
`atom_core.runner.sampler`, which samples from r without normalising it. For a seeded request
the position that emits token index t uses a generator seeded with `seed_for_step(seed, t)`:
first one uniform for the acceptance test (draft positions only), then the race's noise.
A request with no drafts therefore gets exactly the token `Sampler` would give it.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import torch

from atom_core.layers.ops import argmax
from atom_core.plugin_api import SamplingMetadata, processed_probs, seed_for_step

__all__ = ["RejectionSampler"]

# Seeds the unseeded stream apart from the Sampler's, which uses config.seed directly (two
# generators on one seed would hand both the same numbers), and from every seeded request's
# streams, whose token indices are never negative.
_GLOBAL_STREAM = -1


class RejectionSampler:
    """Checks each request's drafts against the target's logits and adds one target token."""

    def __init__(self, config: Any = None, generator: torch.Generator | None = None):
        """`generator` (optional) shares the plain Sampler's global stream; by default this
        sampler keeps its own, derived from `config.seed`."""
        seed = getattr(config, "seed", 0) or 0
        self.device = torch.device(getattr(config, "device", "cpu") or "cpu")
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed_for_step(seed, _GLOBAL_STREAM))
        self.generator = generator
        self._row_generator = torch.Generator(device=self.device)

    def __call__(
        self,
        logits: torch.Tensor,
        draft_token_ids: list[list[int]],
        draft_probs: list[torch.Tensor | None],
        meta: SamplingMetadata,
    ) -> list[list[int]]:
        """logits: [sum_i (n_i + 1), vocab], request i's rows for positions 0..n_i in turn.

        Returns per request the accepted drafts followed by one token from the target
        (length 1..n_i + 1).
        """
        num_reqs = len(draft_token_ids)
        vocab = logits.shape[-1]
        sizes, flat = [], []
        for ds in draft_token_ids:
            if ds and (min(ds) < 0 or max(ds) >= vocab):
                raise ValueError(f"draft token ids must be in [0, {vocab}), got {ds}")
            sizes.append(len(ds) + 1)
            flat.extend(ds)
            flat.append(-1)  # the bonus row: never equal to a draft
        _check(logits, draft_token_ids, draft_probs, meta, sizes)
        if not num_reqs:
            return []
        starts = list(accumulate(sizes, initial=0))[:-1]
        greedy = [t == 0 or k == 1 for t, k in zip(meta.temperatures, meta.top_ks)]
        if all(greedy):  # the common case, in plain lists: a few tensor ops cost more than the step's compares
            target = argmax(logits).tolist()
            out = []
            for s, ds in zip(starts, draft_token_ids):
                a = 0
                while a < len(ds) and ds[a] == target[s + a]:
                    a += 1
                out.append(ds[:a] + [target[s + a]])
            return out
        dev = logits.device
        total = len(flat)
        drafts = torch.tensor(flat, device=dev)
        seg = torch.repeat_interleave(torch.arange(num_reqs, device=dev), torch.tensor(sizes, device=dev))

        target = argmax(logits)  # the plain Sampler's argmax: the same first maximum on ties
        accept = target == drafts  # the greedy rule; sampled requests' rows are replaced below
        sampled = [i for i in range(num_reqs) if not greedy[i]]
        if sampled:
            rows, local, p = self._accept_sampled(logits, drafts, seg, greedy, sampled, sizes, draft_probs, meta)
            accept[rows] = local
        # First rejected row of each request (the bonus row counts as rejected): where its
        # target token goes, and how many drafts came before it.
        idx = torch.arange(total, device=dev)
        first = torch.full((num_reqs,), total, device=dev).scatter_reduce(
            0, seg, torch.where(accept, total, idx), reduce="amin"
        )
        final = target[first]
        num_accepted = (first - torch.tensor(starts, device=dev)).tolist()
        if sampled:
            final[sampled] = self._final_sampled(
                p, rows, first, drafts, sampled, num_accepted, sizes, draft_probs, meta
            )
        tokens = drafts.clone()
        tokens[first] = final
        out = tokens.tolist()
        return [out[s : s + a + 1] for s, a in zip(starts, num_accepted)]

    def _accept_sampled(self, logits, drafts, seg, greedy, sampled, sizes, draft_probs, meta):
        """For the sampled requests' rows: p, and whether each draft passes u * q(d) < p(d)."""
        dev = logits.device
        rows = (~torch.tensor(greedy, device=dev))[seg].nonzero().squeeze(1)
        temps = [meta.temperatures[i] for i in sampled for _ in range(sizes[i])]
        ks = [meta.top_ks[i] for i in sampled for _ in range(sizes[i])]
        ps = [meta.top_ps[i] for i in sampled for _ in range(sizes[i])]
        mps = [meta.min_ps[i] for i in sampled for _ in range(sizes[i])] if meta.min_ps else None
        p = processed_probs(logits[rows], temps, ks, ps, mps)
        p = p / p.sum(dim=-1, keepdim=True)  # top-p leaves the kept mass unnormalised
        d = drafts[rows]
        is_draft = d >= 0
        p_d = p.gather(1, d.clamp(min=0)[:, None]).squeeze(1)
        q_d = torch.ones_like(p_d)  # one-hot q: accept with probability p(d)
        u = torch.rand(len(rows), generator=self.generator, device=dev, dtype=p.dtype)
        # q(d) of the requests that brought q: one small gather each, in row order.
        with_q = [i for i in sampled if sizes[i] > 1 and draft_probs[i] is not None]
        if with_q:
            has_q = torch.zeros(len(sizes), dtype=torch.bool, device=dev)
            has_q[with_q] = True
            positions = torch.arange(max(sizes), device=dev)
            own = dict(zip(sampled, d[is_draft].split([sizes[i] - 1 for i in sampled])))
            q_parts = [draft_probs[i][positions[: sizes[i] - 1], own[i]] for i in with_q]
            q_d[has_q[seg[rows]] & is_draft] = torch.cat(q_parts).to(dtype=p.dtype)
        # Seeded requests: position j's uniform from the generator of token index steps + j.
        for i, offset in zip(sampled, accumulate((sizes[i] for i in sampled), initial=0)):
            if meta.seeds[i] is not None:
                for j in range(sizes[i] - 1):
                    self._row_generator.manual_seed(seed_for_step(meta.seeds[i], meta.steps[i] + j))
                    u[offset + j] = torch.rand((), generator=self._row_generator, device=dev, dtype=p.dtype)
        return rows, is_draft & (u * q_d < p_d), p

    def _final_sampled(self, p, rows, first, drafts, sampled, num_accepted, sizes, draft_probs, meta):
        """The token after the accepted drafts: from max(p - q, 0) after a rejection, from p
        at the bonus row."""
        dev = p.device
        inverse = torch.full((len(drafts),), -1, device=dev, dtype=torch.long)
        inverse[rows] = torch.arange(len(rows), device=dev)
        at = first[sampled]
        p_sel = p[inverse[at]]
        d = drafts[at]
        rejected = d >= 0
        q_sel = torch.zeros_like(p_sel)
        q_sel.scatter_(1, d.clamp(min=0)[:, None], rejected[:, None].to(p.dtype))  # one-hot q
        q_parts, q_rows = [], []
        for m, i in enumerate(sampled):
            a = num_accepted[i]
            if a < sizes[i] - 1 and draft_probs[i] is not None:
                q_parts.append(draft_probs[i][a])
                q_rows.append(m)
        if q_parts:
            q_sel[q_rows] = torch.stack(q_parts).to(dtype=p.dtype)
        dist = _residual(p_sel, q_sel)
        noise = torch.empty_like(dist).exponential_(generator=self.generator)
        for m, i in enumerate(sampled):
            if meta.seeds[i] is not None:
                a = num_accepted[i]
                self._row_generator.manual_seed(seed_for_step(meta.seeds[i], meta.steps[i] + a))
                if a < sizes[i] - 1:  # replay the acceptance uniform drawn at this position
                    torch.rand((), generator=self._row_generator, device=dev, dtype=p.dtype)
                noise[m].exponential_(generator=self._row_generator)
        return (dist / noise).argmax(dim=-1)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(p - q, 0), unnormalised (the race does not need it). A row that rounding left
    empty (p == q up to float error, where a rejection is a rounding artefact) falls back
    to p."""
    r = (p - q).clamp_(min=0)
    return torch.where(r.sum(dim=-1, keepdim=True) > 0, r, p)


def _check(logits, draft_token_ids, draft_probs, meta, sizes) -> None:
    """Shape errors here rather than as a wrong token later."""
    num_reqs = len(draft_token_ids)
    if logits.dim() != 2 or logits.shape[0] != sum(sizes):
        raise ValueError(
            f"logits must be [sum of (drafts + 1), vocab] = [{sum(sizes)}, vocab], got {list(logits.shape)}"
        )
    if len(draft_probs) != num_reqs or len(meta.temperatures) != num_reqs:
        raise ValueError(
            f"{num_reqs} requests of drafts, but {len(draft_probs)} draft_probs "
            f"and {len(meta.temperatures)} sampling metadata entries"
        )
    for i, q in enumerate(draft_probs):
        if q is not None and tuple(q.shape) != (sizes[i] - 1, logits.shape[1]):
            raise ValueError(f"draft_probs[{i}] must be [{sizes[i] - 1}, {logits.shape[1]}], got {list(q.shape)}")
