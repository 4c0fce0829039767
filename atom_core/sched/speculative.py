"""The speculative-decoding contract: a proposer drafts, a verifier accepts, the scheduler counts.

The core knows no proposer by name. `SpeculativeConfig.method` picks a class from the
"proposers" registry and `SpeculativeConfig.verifier` a rejection sampler from the
"samplers" registry (both registered by the `atom_spec` plugin, or a third party's).
Every step the runner verifies the drafts it scheduled, then hands the proposer a
`ProposalInput` describing the step and gets back up to k drafts per request. A draft
model's attention layers take their KV from the same builders and pool, under the same
block tables (`Proposer.draft_modules`); the block manager allocates k lookahead slots
past each sampling step's end for the positions a chained draft writes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

if TYPE_CHECKING:  # `import atom_core` loads no torch (the scheduler imports this module)
    import torch

    from atom_core.sched.batch import ScheduledBatch
    from atom_core.sequence import Sequence

logger = logging.getLogger("atom")


@attrs.define
class Drafts:
    """One request's proposal: token ids and, where the proposer has them, their distributions."""

    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), vocab]; None = a one-hot draft (n-gram)


@attrs.define(kw_only=True)
class ProposalInput:
    """What one step tells the proposer.

    Two views of the step. The *drafting rows* (`seqs`, `new_token_ids`, `max_drafts`,
    `batch_rows`) are the requests that sampled, in batch order: they get
    drafts. The *batch rows* (`query_start_loc`, `verified_end`, `next_token_ids`, one
    entry per row of `batch`, middle prompt chunks included) say which tokens the target
    computed and kept, so a proposer with KV layers of its own can run them over every
    verified token of the step, shifted by one: position p with the token at p + 1.

    `hidden_states` holds the target's final hidden state for every token the step ran
    (rows of `batch.scheduled_tokens`); `aux_hidden_states` the outputs of the decoder
    layers the proposer named in `aux_hidden_layers`, in that order. Drafting row i's last
    verified token (the one whose successor was sampled) sits at
    `verified_end[batch_rows[i]] - 1` in those tensors; tokens of a row from `verified_end`
    on were rejected drafts: their KV is overwritten next step.

    The runner calls `propose` after every step, also when no row samples or none wants
    drafts (`max_drafts` all 0), so that draft KV never falls behind the target's (unless
    the proposer sets `skips_idle_steps`).
    """

    seqs: list[Sequence]
    new_token_ids: list[list[int]]  # emitted this step: accepted drafts, then the target's token
    max_drafts: list[int]  # drafts worth proposing per row (0: none), at most k
    batch: ScheduledBatch
    batch_rows: list[int]  # each seq's row in `batch`
    input_ids: torch.Tensor
    positions: torch.Tensor
    hidden_states: torch.Tensor
    aux_hidden_states: list[torch.Tensor] = attrs.field(factory=list)
    # Per row of `batch`: its tokens are [query_start_loc[r], query_start_loc[r + 1]) of the
    # step's tensors, the verified ones [query_start_loc[r], verified_end[r]) (every token
    # of a row without drafts), and `next_token_ids[r]` is the token after the last verified
    # one: the next prompt token of a middle chunk, the token just emitted for a row that sampled.
    query_start_loc: np.ndarray = attrs.field(factory=lambda: np.zeros(1, dtype=np.int64))
    verified_end: np.ndarray = attrs.field(factory=lambda: np.zeros(0, dtype=np.int64))
    next_token_ids: list[int] = attrs.field(factory=list)


class Proposer:
    """Base class of a speculative-decoding method.

    Subclasses implement `propose`. One with weights loads them in `__init__` from
    `spec_config.model` (or the target checkpoint) and returns the modules holding its
    attention layers from `draft_modules` (each with a `layer_id` past the target's, so
    the builders give it a KV layer of its own; `num_draft_layers` counts them); one
    that reads the target's intermediate hidden states names the decoder layers whose
    outputs it wants in `aux_hidden_layers`.
    """

    num_draft_layers: int = 0
    aux_hidden_layers: tuple[int, ...] = ()
    # True for a proposer with nothing to keep up to date (no KV layers, no state fed
    # token by token): the runner skips `propose` when no row wants drafts.
    skips_idle_steps: bool = False

    def __init__(self, runner: Any, spec_config: Any):
        self.runner = runner
        self.spec_config = spec_config
        self.k: int = spec_config.num_speculative_tokens

    def draft_modules(self) -> list[torch.nn.Module]:
        """Modules holding the proposer's attention layers, bound to the KV pool like the target's."""
        return []

    def propose(self, inp: ProposalInput) -> list[Drafts | None]:
        """Up to `inp.max_drafts[i]` drafts for each drafting row i (None or an empty list: none).

        `probs` only where the drafts were sampled from them; a draft taken by argmax is
        one-hot (probs=None), and passing the softmax instead would not be lossless.
        """
        raise NotImplementedError


def draft_limit(seq: Sequence, num_new_tokens: int, k: int, max_model_len: int | None) -> int:
    """Drafts worth verifying next step for `seq` once `num_new_tokens` more are appended.

    Verifying d drafts emits up to d + 1 tokens; more than `max_tokens` or the context
    limit allow would be computed and thrown away.
    """
    num_tokens = seq.num_tokens + num_new_tokens
    left = seq.max_tokens - (num_tokens - seq.num_prompt_tokens) - 1
    if max_model_len is not None:
        left = min(left, max_model_len - num_tokens - 1)
    # A draft model chains draft i's KV at position num_tokens - 3 + i, inside the blocks the
    # request holds (lookahead blocks are taken only when free): no draft past them.
    room = len(seq.block_table) * seq.block_size - num_tokens + 2
    return max(0, min(k, left, room))


def wanted_drafts(
    seq: Sequence, num_new_tokens: int, k: int, max_model_len: int | None, busy: bool = False
) -> int:
    """`draft_limit`, capped by what the request's gate allows (0 while it has paused drafting).

    `busy` (`crowded(...)`): the step ran `disable_by_batch_size` requests or more, which stops
    greedy requests' drafts (their tokens are the same either way; a sampled request's are not).
    """
    params = seq.sampling_params
    if (busy and params.is_greedy) or params.has_penalties:  # a draft's penalties depend on the drafts before it
        return 0
    gate = seq.draft_gate
    if gate is not None:
        k = gate.drafts(k, seq.num_completion_tokens + num_new_tokens)
    return draft_limit(seq, num_new_tokens, k, max_model_len)


def crowded(spec_config: Any, batch_size: int) -> bool:
    """Whether a step of `batch_size` requests stops greedy drafting (`disable_by_batch_size`)."""
    limit = getattr(spec_config, "disable_by_batch_size", None)  # None too for a stand-in config's
    return limit is not None and batch_size >= limit


@attrs.define
class SpecStats:
    """Counts with vLLM's meanings, taken at verification and only for tokens before any stop."""

    k: int
    num_drafts: int = 0  # request-steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = attrs.field(init=False)
    num_steps: int = 0  # verification steps, for the periodic log line
    log_every: int = 100

    def __attrs_post_init__(self) -> None:
        self.accepted_per_position = [0] * self.k

    def record(self, num_drafted: int, num_accepted: int, num_committed: int) -> None:
        """One request-step: `num_drafted` drafts verified, `num_accepted` taken, `num_committed` tokens kept.

        A stop inside the accepted run cuts what counts: drafts past the stop were neither
        committed nor rejected.
        """
        if num_committed <= num_accepted:  # the stop fell on an accepted draft
            num_drafted = num_accepted = num_committed
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def end_step(self) -> None:
        self.num_steps += 1
        if self.num_steps % self.log_every == 0:
            s = self.as_dict()
            logger.info(
                "speculative decoding: %d drafts, %d draft tokens, acceptance rate %.2f, mean acceptance "
                "length %.2f, accepted per position %s",
                s["num_drafts"],
                s["num_draft_tokens"],
                s["acceptance_rate"],
                s["mean_acceptance_length"],
                s["accepted_per_position"],
            )

    def as_dict(self) -> dict[str, Any]:
        drafts, tokens = self.num_drafts, self.num_draft_tokens
        return {
            "num_drafts": drafts,
            "num_draft_tokens": tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.num_accepted_tokens / tokens if tokens else 0.0,
            "mean_acceptance_length": 1 + self.num_accepted_tokens / drafts if drafts else 1.0,
            "accepted_per_position": list(self.accepted_per_position),
        }


@attrs.define
class DraftGate:
    """How many drafts one request verifies next, from its own acceptance history only.

    Verifying a draft costs a row of compute whether or not it is accepted; how much
    depends on the batch (next to nothing at batch 1, where a step streams the weights
    anyway; about a plain token's cost at batch 8, where the GEMMs are compute-bound and
    an accepted draft only moves a row earlier), and so does what pays. Nothing here looks
    at other requests, so a seeded request generates the same tokens alone or batched.

    The gate tracks, per draft position j, an exponential average of whether position j
    was accepted when drafted, and drafts the longest run of positions whose average is at
    least `min_rate`. A new request drafts all k: the first position trusted (one miss
    leaves it open), the others on probation (at `min_rate`: one miss closes each), so
    free text, where a lookup's first drafts are usually wrong, stops paying for more than
    one after its first miss. When every draft of a step is accepted, all closed positions
    open again on probation. When even the first position falls below `min_rate`, the
    request stops drafting for `retry_after` tokens, then probes with a single draft (its
    average restarted at `min_rate`, so one more miss pauses it again); each pause that
    follows a failed probe lasts twice the one before (up to 16x), so a request whose
    drafts never pay costs a probe row rarely.
    """

    min_rate: float
    retry_after: int
    accept: list[float] = attrs.Factory(list)  # per position: average of "accepted when drafted"
    paused_until: int = 0  # completion-token count at which drafting resumes
    pause: int = 0  # the last pause's length; 0 once drafts pay again

    MAX_BACKOFF = 16

    def drafts(self, k: int, num_completion_tokens: int) -> int:
        """Drafts worth verifying next step (at most k; 0 while paused)."""
        if num_completion_tokens < self.paused_until:
            return 0
        if self.min_rate <= 0:
            return k
        if not self.accept:  # the first position trusted, the rest on probation
            self.accept = [1.0]
        if len(self.accept) < k:
            self.accept.extend([self.min_rate] * (k - len(self.accept)))
        n = 0
        while n < k and self.accept[n] >= self.min_rate:
            n += 1
        return n

    def record(self, num_drafted: int, num_accepted: int, num_completion_tokens: int) -> None:
        if num_drafted == 0 or self.min_rate <= 0:
            return
        if len(self.accept) < num_drafted:
            self.accept.extend([self.min_rate] * (num_drafted - len(self.accept)))
        for j in range(num_drafted):
            self.accept[j] = 0.5 * self.accept[j] + 0.5 * (j < num_accepted)
        if self.accept[0] < self.min_rate:
            self.pause = self.retry_after if self.pause == 0 else min(2 * self.pause, self.MAX_BACKOFF * self.retry_after)
            self.paused_until = num_completion_tokens + self.pause
            # probation: one draft, and one more miss pauses again
            self.accept = [self.min_rate] + [0.0] * (len(self.accept) - 1)
            return
        self.pause = 0
        if num_accepted == num_drafted < len(self.accept):  # every draft taken: open the rest on probation
            for j in range(num_drafted, len(self.accept)):
                self.accept[j] = max(self.accept[j], self.min_rate)
