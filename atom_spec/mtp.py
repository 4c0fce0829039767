"""Multi-token prediction ("mtp"): the target checkpoint's own next-token-prediction layer drafts.

DeepSeek-V3 ships one such layer at index `num_hidden_layers`. The target model's plugin
builds it (`make_mtp_module`); this proposer knows no model class. The layer reads the
target's final hidden state at p and the token at p + 1; for k > 1 it is reused on its
own normed output.
"""

from __future__ import annotations

from torch import nn

from atom_spec.draft import DraftModelProposer, build_draft_module


class MTPProposer(DraftModelProposer):
    def build_draft(self) -> nn.Module:
        target = self.context.model
        make = getattr(target, "make_mtp_module", None)
        if make is None:
            archs = getattr(self.context.hf_config, "architectures", None) or [type(target).__name__]
            raise ValueError(
                f"speculative method 'mtp' drafts with the target's multi-token-prediction layer, and {archs[0]} "
                f"has none (its model class defines no `make_mtp_module`)"
            )
        folder = self.spec_config.model or self.context.config.model
        return build_draft_module(self.context, make, folder)

    def target_hidden(self, inp, index):
        return inp.hidden_states[index]
