"""The default sampler: logits processing (grammar masks, min_tokens, logit bias, penalties),
greedy, temperature, min-p, top-k, top-p, and per-request seeds.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws from
`p` exactly. A seeded request draws its noise from a generator keyed by (seed, how many
tokens it has generated), so its noise does not depend on what else is in the batch, on
preemption, or on the order requests arrived; its tokens do not either wherever the
logits do not (batch-invariant kernels; see docs/usage.md, Sampling).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from atom_core.layers.ops import argmax


@attrs.define
class Penalties:
    """One row's penalties (`SamplingParams`) and the tokens they read."""

    repetition: float
    presence: float
    frequency: float
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@attrs.define
class SamplingMetadata:
    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    seeds: list[int | None]
    steps: list[int]  # tokens each request has generated so far
    min_ps: list[float] | None = None  # None: no row drops by min_p
    penalties: list[Penalties | None] | None = None  # None: no row has penalties
    # Per row the token ids added to (logit_bias), the ids it may not sample now (its stop ids
    # under min_tokens, the last token of a bad word the output is about to complete) and the
    # only ids it may sample (allowed_token_ids); None: no row has any.
    logit_biases: list[dict[int, float] | None] | None = None
    banned_token_ids: list[list[int] | None] | None = None
    allowed_token_ids: list[list[int] | None] | None = None
    # int32 [rows, ceil(vocab / 32)]: the tokens each row's grammar allows next (see
    # `structured_output.backend`); None: no row has a grammar.
    allowed_bitmask: torch.Tensor | None = None

    @classmethod
    def from_seqs(cls, seqs, vocab_size: int | None = None) -> SamplingMetadata:
        """Each sequence's settings; a grammar's mask is computed here, for the step about to
        sample (`vocab_size`, the logits' width, sizes it)."""
        seqs = list(seqs)
        params = [s.sampling_params for s in seqs]
        min_ps = [p.min_p for p in params]
        penalties = [
            Penalties(p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
                      s.prompt_token_ids, s.completion_token_ids) if p.has_penalties else None
            for s, p in zip(seqs, params)
        ]  # fmt: skip
        biases = [p.logit_bias for p in params]
        banned = [banned_now(s) for s in seqs]
        allowed = [p.allowed_token_ids for p in params]
        bitmask = None
        grammars = [getattr(s, "grammar", None) for s in seqs]
        if any(g is not None for g in grammars):
            from atom_core.structured_output.backend import allocate_bitmask

            assert vocab_size is not None, "a grammar's mask needs the logits' width"
            bitmask = allocate_bitmask(len(seqs), vocab_size)
            for row, grammar in enumerate(grammars):
                if grammar is not None:
                    grammar.fill_bitmask(bitmask, row)
        return cls(
            temperatures=[s.temperature for s in seqs],
            top_ks=[s.top_k for s in seqs],
            top_ps=[s.top_p for s in seqs],
            seeds=[p.seed for p in params],
            steps=[s.num_completion_tokens for s in seqs],
            min_ps=min_ps if any(min_ps) else None,
            penalties=penalties if any(x is not None for x in penalties) else None,
            logit_biases=biases if any(b is not None for b in biases) else None,
            banned_token_ids=banned if any(b for b in banned) else None,
            allowed_token_ids=allowed if any(a is not None for a in allowed) else None,
            allowed_bitmask=bitmask,
        )


def banned_now(seq: Any) -> list[int] | None:
    """The ids `seq` may not sample at its next token: its stop ids while under min_tokens, and
    the last token of each bad word whose other tokens end its output (vLLM's rules)."""
    banned = set(seq.min_tokens_stop_ids) if seq.num_completion_tokens < seq.sampling_params.min_tokens else set()
    if seq.bad_words_token_ids:
        output = seq.completion_token_ids
        for word in seq.bad_words_token_ids:
            head = len(word) - 1
            if head <= len(output) and (head == 0 or output[-head:] == word[:-1]):
                banned.add(word[-1])
    return sorted(banned) or None


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """float32 logits with everything but sampling applied, in vLLM's order: the grammar's
    mask, allowed_token_ids, the banned ids (min_tokens' stop ids, bad words), logit bias, then
    penalties. Every sampler calls this first (a plugin sampler too: a request's grammar and
    bias hold whichever samples it)."""
    if meta.allowed_bitmask is not None:
        from atom_core.structured_output.backend import apply_bitmask

        logits = apply_bitmask(logits, meta.allowed_bitmask)
    if meta.banned_token_ids is not None or meta.logit_biases is not None or meta.allowed_token_ids is not None:
        logits = logits.clone()
        dev = logits.device
        for row, allowed in enumerate(meta.allowed_token_ids or ()):
            if allowed is not None:
                keep = torch.tensor([t for t in allowed if t < logits.shape[-1]], dtype=torch.int64, device=dev)
                kept = logits[row, keep]
                logits[row] = float("-inf")
                logits[row, keep] = kept
        for row, banned in enumerate(meta.banned_token_ids or ()):
            if banned:
                logits[row, torch.tensor(banned, dtype=torch.int64, device=dev)] = float("-inf")
        for row, bias in enumerate(meta.logit_biases or ()):
            if bias:
                ids = torch.tensor([t for t in bias if t < logits.shape[-1]], dtype=torch.int64, device=dev)
                values = torch.tensor([v for t, v in bias.items() if t < logits.shape[-1]], dtype=logits.dtype)
                logits[row].index_add_(0, ids, values.to(dev))
    return apply_penalties(logits, meta.penalties)


def apply_penalties(logits: torch.Tensor, penalties: list[Penalties | None] | None) -> torch.Tensor:
    """The raw float32 logits with each row's penalties applied (vLLM's order and formulas)."""
    if penalties is None:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for row, pen in zip(logits, penalties):
        if pen is None:
            continue
        out = torch.tensor(pen.output_token_ids, dtype=torch.int64, device=logits.device)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
        if pen.repetition != 1.0:
            seen = counts > 0
            seen[torch.tensor(pen.prompt_token_ids, dtype=torch.int64, device=logits.device)] = True
            hit = row[seen]
            row[seen] = torch.where(hit > 0, hit / pen.repetition, hit * pen.repetition)
        if pen.frequency or pen.presence:
            row -= pen.frequency * counts + pen.presence * (counts > 0).to(logits.dtype)
    return logits


def reads_argmax_only(sampler: Any) -> bool:
    """Whether `sampler`'s own class says a greedy row reads nothing of its logits but the
    argmax (`greedy_reads_argmax_only = True`): the runner may then hand it rows that are
    -inf wherever they cannot be the maximum (`layers/argmax_screen.py`). Not inherited: a
    subclass that masks or biases logits must not get such rows without saying so."""
    return vars(type(sampler)).get("greedy_reads_argmax_only", False) is True


class Sampler:
    greedy_reads_argmax_only = True  # see `reads_argmax_only`

    def __init__(self, config: Any = None):
        seed = getattr(config, "seed", 0) or 0
        self.device = torch.device(getattr(config, "device", "cpu") or "cpu")
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._row_generator = torch.Generator(device=self.device)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """logits: [num_reqs, vocab] in any float dtype -> one token id per request, from float32
        (widening is exact; `ops.argmax` reads float32 rows with AVX-512)."""
        logits = process_logits(logits.float(), meta)
        greedy_tokens = argmax(logits)
        greedy = [t == 0 or k == 1 for t, k in zip(meta.temperatures, meta.top_ks)]
        if all(greedy):
            return greedy_tokens
        dev = logits.device
        probs = processed_probs(logits, meta.temperatures, meta.top_ks, meta.top_ps, meta.min_ps)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, seed in enumerate(meta.seeds):
            if seed is not None and not greedy[i]:
                self._row_generator.manual_seed(seed_for_step(seed, meta.steps[i]))
                noise[i].exponential_(generator=self._row_generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(torch.tensor(greedy, device=dev), greedy_tokens, sampled)


def processed_probs(
    logits: torch.Tensor,
    temperatures: list[float],
    top_ks: list[int],
    top_ps: list[float],
    min_ps: list[float] | None = None,
) -> torch.Tensor:
    """The distribution each row samples from: temperature, then min-p, top-k and top-p.

    One function for every consumer (the Sampler, speculative decoding's rejection
    sampler), so that a verifier accepts against exactly the distribution the plain
    sampler would draw from. Rows with temperature 0 are scaled by 1 (their caller takes
    the argmax). Dropped tokens get 0. After top-p a row sums to the kept mass, not to 1:
    the exponential race does not need it normalised; divide by the row sum if you do.
    """
    dev, vocab = logits.device, logits.shape[-1]
    temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=dev, dtype=logits.dtype)
    logits = logits / temps[:, None]
    if min_ps is not None and any(min_ps):  # below min_p times the top token's probability
        probs = logits.softmax(dim=-1)
        floor = torch.tensor(min_ps, device=dev, dtype=probs.dtype)[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if any(0 < k < vocab for k in top_ks):
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=dev)
        top = logits.topk(int(ks.max()), dim=-1).values
        kth = top.gather(1, (ks - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if any(p < 1.0 for p in top_ps):
        ps = torch.tensor(top_ps, device=dev, dtype=probs.dtype)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        drop = sorted_p.cumsum(dim=-1) - sorted_p >= ps[:, None]
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    return probs


def seed_for_step(seed: int, step: int) -> int:
    """A 63-bit generator seed from (request seed, token index)."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    return x & (2**63 - 1)
