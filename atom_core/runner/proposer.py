"""The speculative-decoding contract on the runner's side: what a proposer is made from,
what it is told each step, and what it returns.

The core knows no proposer by name. `SpeculativeConfig.method` picks a class from the
"proposers" registry (the `atom_spec` plugin's, or a third party's); the runner makes it from
a `ProposerContext` (the target model, the builders, a weight loader; never the runner), and
every step, after verifying the drafts it scheduled, hands it a `ProposalInput` and gets back
up to k `Drafts` per request. A draft model's attention layers take their KV from the same
builders and pool, under the same block tables (`Proposer.draft_modules`). The scheduler's
side (how many drafts a request gets, the acceptance counters) is `atom_core.sched.speculative`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np
import torch

from atom_core.config import Config
from atom_core.runner.attention_builder import AttentionMetadataBuilder
from atom_core.sched.batch import ScheduledBatch
from atom_core.sequence import Sequence


@attrs.frozen
class ProposerContext:
    """What a proposer is made from.

    `model`: the target model (a proposer shares its embedding or reads its layer ids);
    `instantiate(make)`: `make()` with parameters in the target's dtype, on its device;
    `load_weights(module, folder)`: a module's checkpoint loaded and its kernels picked, as the
    target's were; `attn_builders`: attention type -> builder, filled once the KV pool is
    planned (after `draft_modules`), for building a draft step's metadata.
    """

    config: Config
    hf_config: Any
    model: torch.nn.Module
    instantiate: Callable[[Callable[[], torch.nn.Module]], torch.nn.Module]
    load_weights: Callable[[torch.nn.Module, str], torch.nn.Module]
    attn_builders: Mapping[str, AttentionMetadataBuilder]


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
    # True for a proposer that runs no model of its own (n-gram lookup): only rank 0 proposes, so
    # it runs unchanged under tensor parallel. A draft model would need the other ranks too.
    supports_tensor_parallel: bool = False

    def __init__(self, context: ProposerContext, spec_config: Any):
        self.context = context
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
