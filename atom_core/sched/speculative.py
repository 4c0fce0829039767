"""The scheduler's side of speculative decoding: how many drafts each request gets, when
drafting is worth it, and the counters of what was accepted.

The proposer contract (what a proposer is made from, told and returns) is
`atom_core.runner.proposer`; the block manager allocates k lookahead slots past each
sampling step's end for the positions a chained draft writes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:  # `import atom_core` loads no torch (the scheduler imports this module)
    from atom_core.sequence import Sequence

logger = logging.getLogger("atom")


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


def wanted_drafts(seq: Sequence, num_new_tokens: int, k: int, max_model_len: int | None, busy: bool = False) -> int:
    """`draft_limit`, capped by what the request's gate allows (0 while it has paused drafting).

    `busy` (`crowded(...)`): the step ran `disable_by_batch_size` requests or more, which stops
    greedy requests' drafts (their tokens are the same either way; a sampled request's are not).
    """
    params = seq.sampling_params
    if (busy and params.is_greedy) or params.modifies_logits:  # a draft's logits would depend on the drafts before it
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
            self.pause = (
                self.retry_after if self.pause == 0 else min(2 * self.pause, self.MAX_BACKOFF * self.retry_after)
            )
            self.paused_until = num_completion_tokens + self.pause
            # probation: one draft, and one more miss pauses again
            self.accept = [self.min_rate] + [0.0] * (len(self.accept) - 1)
            return
        self.pause = 0
        if num_accepted == num_drafted < len(self.accept):  # every draft taken: open the rest on probation
            for j in range(num_drafted, len(self.accept)):
                self.accept[j] = max(self.accept[j], self.min_rate)
