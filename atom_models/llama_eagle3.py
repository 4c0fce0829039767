"""EAGLE-3 draft heads for Llama-shaped targets, in the published checkpoint layout.

Not a model of its own: the "eagle3" proposer (atom_spec) builds one beside the target
from the draft folder (`architectures: ["LlamaForCausalLMEagle3"]`). Checkpoint names:
`fc` [H, 3 * H_target] over the target's hidden states from three layers (low, middle,
high); one decoder layer `midlayer` (`layers.0` in some exports) whose attention reads
[input_layernorm(embedding) | hidden_norm(hidden)], so q/k/v take 2H inputs; `norm`;
`lm_head` over `draft_vocab_size` tokens with `d2t` (target id = draft id + d2t[draft id]);
`t2d` is unused; `embed_tokens` when the folder has one, else the target's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atom_core.layers import Linear, MergedLinear, RMSNorm, get_rope
from atom_core.plugin_api import SKIP, packed_target
from atom_models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    head_dim_of,
)


class Eagle3Attention(LlamaAttention):
    """Llama attention whose q, k and v read the concatenated [embedding | hidden] (2H wide)."""

    def __init__(self, cfg: Any, layer_id: int):
        super().__init__(cfg, layer_id)
        d, bias = self.head_dim, bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = MergedLinear(
            2 * cfg.hidden_size, {"q": self.num_heads * d, "k": self.num_kv_heads * d, "v": self.num_kv_heads * d}, bias
        )


class Eagle3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Eagle3Attention

    def __init__(self, cfg: Any, layer_id: int):
        super().__init__(cfg, layer_id)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The residual is the hidden state as given (the published default) or once normed.
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual), whose sum is the layer's output (`LlamaDecoderLayer`'s contract)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        attn = self.self_attn(torch.cat([self.input_layernorm(embeds), normed], dim=-1), cos, sin)
        # residual + attn with attn as the buffer the fused add may overwrite: `hidden` is the caller's
        h, residual = self.post_attention_layernorm(residual, attn)
        return self.mlp(h), residual


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high layers, as residual-stream boundaries (the input of layer i)."""
    return (2, num_target_layers // 2, num_target_layers - 3)


class LlamaForCausalLMEagle3(nn.Module):
    """One EAGLE-3 draft step: forward(token ids, positions, hidden) -> (normed, pre-norm hidden).

    `hidden` is `combine_hidden_states(aux)` (the fc over the target's three hidden states)
    for positions the target computed, or the previous step's pre-norm output in a chain.
    `layer_id` numbers the attention layer after the target's, so it gets a KV layer of its own.
    """

    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(
        self, hf_config: Any, atom_config: Any = None, *, layer_id: int = 0, embed_tokens: nn.Embedding | None = None
    ):
        super().__init__()
        cfg = self.config = hf_config
        h = cfg.hidden_size
        target_h = getattr(cfg, "target_hidden_size", None) or h
        self.vocab_size = cfg.vocab_size
        self.draft_vocab_size = getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size
        self.fc = Linear(3 * target_h, h, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg, layer_id)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = Linear(h, self.draft_vocab_size, bias=False)
        self.rotary_emb = get_rope(cfg, head_dim_of(cfg), cfg.max_position_embeddings)
        # target id = draft id + d2t[draft id]; published heads ship it whenever they set a draft vocabulary
        self.has_d2t = getattr(cfg, "draft_vocab_size", None) is not None
        if self.has_d2t:
            self.d2t = nn.Parameter(torch.zeros(self.draft_vocab_size, dtype=torch.int64), requires_grad=False)
        self.owns_embedding = embed_tokens is None
        if self.owns_embedding:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        else:
            self._target_embed = (embed_tokens,)  # the target's: a tuple, not registered twice

    def aux_hidden_state_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The target's residual-stream boundaries the fc reads (boundary i = the input of layer i):
        `eagle_aux_hidden_state_layer_ids` from the config (top level or under `eagle_config`),
        else (2, L // 2, L - 3), both as vLLM reads them."""
        ids = getattr(self.config, "eagle_aux_hidden_state_layer_ids", None)
        nested = getattr(self.config, "eagle_config", None)
        if not ids and isinstance(nested, dict):
            ids = nested.get("eagle_aux_hidden_state_layer_ids")
        return tuple(int(i) for i in ids) if ids else default_aux_layers(num_target_layers)

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        name = name.removeprefix("model.")
        if name == "t2d" or (name == "d2t" and not self.has_d2t):
            return SKIP
        if name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        if name.startswith("embed_tokens.") and not self.owns_embedding:
            return SKIP
        return packed_target(name, self.packed_modules_mapping)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) if self.owns_embedding else self._target_embed[0](input_ids)

    def combine_hidden_states(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """[T, 3 * H_target] (low, middle, high) -> [T, H]."""
        return self.fc(torch.cat(aux, dim=-1))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.embed(input_ids)
        cos, sin = self.rotary_emb(positions, embeds.dtype)
        return self.norm(*self.midlayer(embeds, hidden, cos, sin))  # (normed, pre-norm): the last add fused

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary; `draft_id_to_target` maps their argmax."""
        return self.lm_head(hidden)

    def draft_id_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids] if self.has_d2t else ids
