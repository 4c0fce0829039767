"""Draft models that run beside the target: what MTP and EAGLE-3 share.

A draft model here is a module with attention layers of its own (ids after the target's,
so the builders give each a KV layer in the same pool, under the same block tables) and
this protocol, which the model plugins implement:

- `forward(input_ids, positions, hidden) -> (hidden for the logits, hidden for the next step)`:
  position p reads the token at p + 1 and a hidden state at p;
- `compute_logits(hidden)`: logits over the draft's vocabulary, and `draft_id_to_target`
  (None, or a function mapping draft token ids to the target's);
- `map_checkpoint_name` / `packed_modules_mapping`, for `load_model_weights`.

Each step, after verification, `DraftModelProposer.propose`:

1. runs the draft over every token the target kept this step, middle prompt chunks
   included, each position with the token after it (the next scheduled token, or at a
   row's last verified token the next prompt token or the token just emitted). This
   writes the draft's KV for those positions and, at each drafting row's last verified
   token, gives the first draft. Rejected draft positions are skipped; their KV is
   overwritten next step.
2. chains k - 1 single-token steps at positions last + 1, ... on the previous step's
   draft token and hidden state, writing KV into the lookahead slots the block manager
   allocated past the step's end.

Drafts are argmax (greedy drafting), so `Drafts.probs` stays None: a one-hot q, which
is what keeps rejection sampling lossless for them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import attrs
import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from atom_core.layers.embedding import LookupEmbedding
from atom_core.plugin_api import (
    SKIP,
    Context,
    Drafts,
    ProposalInput,
    Proposer,
    ProposerContext,
    reset_forward_context,
    safetensors_files,
    set_forward_context,
)


@attrs.define(kw_only=True)
class DraftBatch:
    """The fields of a `ScheduledBatch` an attention builder's `build` reads, for one draft pass."""

    num_scheduled_tokens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    num_cached_tokens: list[int]
    num_computed_tokens: list[int]
    pad_block: int | None = None
    left_pad_blocks: list[int] | None = None
    tkvs: list[int] | None = None
    per_req_cache_groups: list[int] = attrs.field(factory=list)
    state_loads: dict = attrs.field(factory=dict)
    state_saves: dict = attrs.field(factory=dict)
    scheduled_spec_decode_tokens: dict = attrs.field(factory=dict)


def build_draft_module(context: ProposerContext, make: Callable[[], nn.Module], folder: str | Path) -> nn.Module:
    """`make()` in the target's dtype and device, its weights loaded from `folder`, kernels picked."""
    module = context.instantiate(make)
    mapper = getattr(module, "map_checkpoint_name", None)
    if mapper is not None and all(mapper(n) == SKIP for n in checkpoint_names(folder)):
        prefix = getattr(module, "checkpoint_prefix", None)
        raise ValueError(
            f"the checkpoint in {folder} holds no tensors of the draft model {type(module).__name__}"
            + (f" (none named {prefix}*)" if prefix else "")
        )
    return context.load_weights(module, str(folder))


def checkpoint_names(folder: str | Path) -> list[str]:
    """Every tensor name in a safetensors checkpoint (single or sharded)."""
    names: list[str] = []
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return names


def target_embedding(model: nn.Module) -> nn.Module:
    """The target's token embedding, for a draft that shares it (a tied one may read its
    rows from the LM head's kernel: a `LookupEmbedding`)."""
    get = getattr(model, "get_input_embeddings", None)
    found = get() if callable(get) else getattr(getattr(model, "model", None), "embed_tokens", None)
    if not isinstance(found, (nn.Embedding, LookupEmbedding)):
        raise ValueError(
            f"{type(model).__name__} exposes no token embedding (model.embed_tokens) for the draft to share"
        )
    return found


def next_layer_id(model: nn.Module) -> int:
    """The first attention layer id after the target's: where a draft's layers are numbered from."""
    ids = [getattr(m, "layer_id", -1) for m in model.modules() if getattr(m, "attn_type", None)]
    return max(ids, default=-1) + 1


class DraftModelProposer(Proposer):
    """A proposer with a draft model (`build_draft`) fed by the target's hidden states (`target_hidden`)."""

    def __init__(self, context: ProposerContext, spec_config: Any):
        super().__init__(context, spec_config)
        self.draft = self.build_draft()
        attn = [m for m in self.draft.modules() if getattr(m, "attn_type", None)]
        self.num_draft_layers = len(attn)
        self.attn_types = sorted({m.attn_type for m in attn})

    def build_draft(self) -> nn.Module:
        raise NotImplementedError

    def target_hidden(self, inp: ProposalInput, index: torch.Tensor) -> torch.Tensor:
        """The draft's hidden input at the step's tokens `index` (rows of `inp.hidden_states`)."""
        raise NotImplementedError

    def draft_modules(self) -> list[nn.Module]:
        return [self.draft]

    def propose(self, inp: ProposalInput) -> list[Drafts | None]:
        result: list[Drafts | None] = [None] * len(inp.seqs)
        starts = np.asarray(inp.query_start_loc[:-1], dtype=np.int64)
        lens = np.asarray(inp.verified_end, dtype=np.int64) - starts
        if not len(lens):
            return result
        dev = inp.input_ids.device
        # 1. Every kept token of the step, shifted: position p with the token at p + 1.
        cu = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        index = np.arange(cu[-1], dtype=np.int64) + np.repeat(starts - cu[:-1], lens)
        last = cu[1:] - 1  # each row's last verified token, in the pass
        after = index + 1
        after[last] = 0  # its successor is not in the step's tensors; filled in below
        tokens = inp.input_ids[torch.from_numpy(after).to(dev)]
        tokens[torch.from_numpy(last).to(dev)] = torch.tensor(inp.next_token_ids, dtype=tokens.dtype, device=dev)
        first = np.asarray(inp.batch.num_computed_tokens, dtype=np.int64)
        hidden = self.target_hidden(inp, torch.from_numpy(index).to(dev))
        out, carry = self._run(tokens, hidden, lens, first, inp.batch.block_tables)

        want = [i for i, m in enumerate(inp.max_drafts) if m > 0]
        if not want:
            return result
        rows = np.asarray([inp.batch_rows[i] for i in want], dtype=np.int64)
        limits = np.asarray([inp.max_drafts[i] for i in want], dtype=np.int64)
        pick = torch.from_numpy(last[rows]).to(dev)
        token = self._pick(out[pick])
        carry = carry[pick]
        drafted = [[t] for t in token.tolist()]
        # 2. Chained steps at the positions after each row's last verified token.
        last_pos = first[rows] + lens[rows] - 1
        tables = [inp.batch.block_tables[r] for r in rows]
        active = np.arange(len(want))
        for j in range(1, int(limits.max())):
            keep = np.flatnonzero(limits[active] > j)
            if len(keep) < len(active):  # rows whose limit is reached drop out (no slots past it)
                sel = torch.from_numpy(keep).to(dev)
                token, carry, active = token[sel], carry[sel], active[keep]
            pos = last_pos[active] + j
            out, carry = self._run(token, carry, np.ones(len(active), dtype=np.int64), pos, [tables[a] for a in active])
            token = self._pick(out)
            for a, t in zip(active.tolist(), token.tolist()):
                drafted[a].append(t)
        for i, d in zip(want, drafted):
            result[i] = Drafts(d)
        return result

    def _run(
        self, tokens: torch.Tensor, hidden: torch.Tensor, lens: np.ndarray, first: np.ndarray, tables: list
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward over rows of `lens` tokens starting at positions `first`."""
        batch = DraftBatch(
            num_scheduled_tokens=lens.tolist(),
            context_lens=(first + lens).tolist(),
            block_tables=list(tables),
            num_cached_tokens=[0] * len(lens),
            num_computed_tokens=first.tolist(),
        )
        metas = {t: self.context.attn_builders[t].build(batch) for t in self.attn_types}
        positions = next(iter(metas.values())).positions
        set_forward_context(
            attn_metadata_by_type=metas,
            atom_config=self.context.config,
            context=Context(positions=positions, is_prefill=bool(lens.max() > 1), batch_size=len(lens), is_draft=True),
        )
        try:
            return self.draft(tokens, positions, hidden)
        finally:
            reset_forward_context()

    def _pick(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy drafts, as target token ids."""
        ids = self.draft.compute_logits(hidden).argmax(dim=-1)
        to_target = getattr(self.draft, "draft_id_to_target", None)
        return to_target(ids) if callable(to_target) else ids
