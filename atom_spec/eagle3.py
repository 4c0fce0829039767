"""EAGLE-3 ("eagle3"): a one-layer draft head over the target's low, middle and high hidden states.

`speculative_config.model` is the draft folder in the published layout; its
`architectures` name picks the draft class from the models registry (atom_models
registers `LlamaForCausalLMEagle3`). The target's hidden states at the residual-stream
boundaries the draft names (boundary i = the input of decoder layer i = the output of
layer i - 1, as vLLM counts `eagle_aux_hidden_state_layer_ids` and the default
(2, L // 2, L - 3)) reach it through the runner's `aux_hidden_layers` hooks.
"""

from __future__ import annotations

from torch import nn

from atom_core.plugin_api import get_registry
from atom_spec.draft import (
    DraftModelProposer,
    build_draft_module,
    checkpoint_names,
    next_layer_id,
    target_embedding,
)


class Eagle3Proposer(DraftModelProposer):
    def build_draft(self) -> nn.Module:
        from transformers import AutoConfig

        folder = self.spec_config.model
        if not folder:
            raise ValueError("speculative method 'eagle3' needs speculative_config.model: the EAGLE-3 draft folder")
        cfg = AutoConfig.from_pretrained(folder)
        target_cfg = self.context.hf_config
        archs = getattr(cfg, "architectures", None) or []
        if not archs:
            raise ValueError(
                f"{folder}: config.json names no 'architectures' (an EAGLE-3 head says LlamaForCausalLMEagle3)"
            )
        target_h = getattr(cfg, "target_hidden_size", None) or cfg.hidden_size
        if target_h != target_cfg.hidden_size or cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(
                f"the EAGLE-3 head in {folder} expects a target of hidden size {target_h} and vocabulary "
                f"{cfg.vocab_size}; the target has {target_cfg.hidden_size} and {target_cfg.vocab_size}"
            )
        cls = get_registry("models").get(archs[0])
        owns_embedding = any(n.removeprefix("model.") == "embed_tokens.weight" for n in checkpoint_names(folder))
        embed = None if owns_embedding else target_embedding(self.context.model)
        layer_id = next_layer_id(self.context.model)
        draft = build_draft_module(
            self.context, lambda: cls(cfg, self.context.config, layer_id=layer_id, embed_tokens=embed), folder
        )
        boundaries = draft.aux_hidden_state_layers(target_cfg.num_hidden_layers)
        bad = [b for b in boundaries if not 1 <= b <= target_cfg.num_hidden_layers]
        if len(boundaries) != 3 or bad:
            raise ValueError(
                f"the EAGLE-3 head reads the target's hidden states at boundaries {list(boundaries)}; it needs "
                f"three, each in 1..{target_cfg.num_hidden_layers} (the output of a decoder layer)"
            )
        self.aux_hidden_layers = tuple(b - 1 for b in boundaries)  # the decoder layers whose outputs they are
        return draft

    def target_hidden(self, inp, index):
        return self.draft.combine_hidden_states([h[index] for h in inp.aux_hidden_states])
