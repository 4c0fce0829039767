"""Llama (and the Llama-shaped families that reuse it, e.g. Qwen3 with q/k norms)."""

from __future__ import annotations

from typing import Any

import torch
from gguf import MODEL_TENSOR as T
from gguf import Keys
from torch import nn

from atom_core.layers import (
    Attention,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    act_and_mul,
    apply_rotary,
    apply_rotary_interleaved,
    compute_logits,
    get_rope,
    lm_head,
    vocab_embedding,
)
from atom_core.layers.ops import GATED_ACTIVATIONS
from atom_core.layers.rotary import rope_layer_types, rope_parameters
from atom_core.plugin_api import GGUFArchitecture, GGUFFile


def head_dim_of(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def partial_rope_dim(cfg: Any) -> int:
    """Rope rotates the first `partial_rotary_factor` of each attention head (all of it by default)."""
    types = rope_layer_types(cfg)  # keyed by layer type: the rotary share is common to all
    factor = rope_parameters(cfg, types[0] if types else None).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(cfg, "partial_rotary_factor", None)
    return int(head_dim_of(cfg) * (factor or 1.0))


def partial_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int, interleaved: bool = False
) -> torch.Tensor:
    """x [tokens, heads, head_dim] with the first `rope_dim` values of each head rotated.

    `interleaved`: the pairs are (x0, x1), (x2, x3), ... (GPT-J's and GLM's style) rather than
    the two halves (GPT-NeoX's); the rotated part comes out de-interleaved, the same
    permutation for q and k, so every dot product is as the model computes it.
    """
    rotate = apply_rotary_interleaved if interleaved else apply_rotary
    if rope_dim == x.shape[-1]:
        return rotate(x.contiguous(), cos, sin)
    return torch.cat((rotate(x[..., :rope_dim].contiguous(), cos, sin), x[..., rope_dim:]), dim=-1)


class LlamaAttention(nn.Module):
    qk_norm = False  # an RMSNorm over each head's q and k before rope (Qwen3, Gemma 3)
    norm_cls: type = RMSNorm
    rope_interleaved = False  # rope rotates interleaved pairs (GLM), not the two halves

    def __init__(self, cfg: Any, layer_id: int):
        super().__init__()
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        self.head_dim = d = head_dim_of(cfg)
        self.qk_norm = self.uses_qk_norm(cfg)
        qkv_bias, o_bias = self.biases(cfg)
        # this rank's heads (all of them at one rank)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, heads, kv_heads, qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(heads * d, cfg.hidden_size, bias=o_bias)
        self.attn = Attention(
            self.num_heads, d, self.softmax_scale(cfg), self.num_kv_heads, layer_id, attn_type="mha",
            **self.attention_options(cfg, layer_id),
        )  # fmt: skip
        if self.qk_norm:
            self.q_norm = self.norm_cls(d, cfg.rms_norm_eps)
            self.k_norm = self.norm_cls(d, cfg.rms_norm_eps)
        self.rope_dim = partial_rope_dim(cfg)
        # NoPE layers (`no_rope_layers`: 1 where a layer ropes, 0 where it does not; SmolLM3, Llama 4)
        no_rope = getattr(cfg, "no_rope_layers", None)
        self.use_rope = bool(no_rope[layer_id]) if no_rope else True

    @staticmethod
    def softmax_scale(cfg: Any) -> float:
        return head_dim_of(cfg) ** -0.5

    @staticmethod
    def attention_options(cfg: Any, layer_id: int) -> dict[str, Any]:
        """The `Attention` options of layer `layer_id`: its sliding window here; a family adds
        soft-capping or sinks."""
        return {"sliding_window": sliding_window_of(cfg, layer_id)}

    @classmethod
    def uses_qk_norm(cls, cfg: Any) -> bool:
        """Whether each head's q and k are normalised before rope (the class's `qk_norm`; GLM-4-MoE
        asks its config)."""
        return cls.qk_norm

    @staticmethod
    def biases(cfg: Any) -> tuple[bool, bool]:
        """(q/k/v bias, output bias): both `attention_bias` here (Qwen2 has the first only)."""
        bias = bool(getattr(cfg, "attention_bias", False))
        return bias, bias

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, d = h.shape[0], self.head_dim
        qkv = self.qkv_proj(h)
        nq, nkv = self.num_heads, self.num_kv_heads
        v = qkv[:, (nq + nkv) * d :]
        if self.use_rope and self.rope_dim == d and not (self.qk_norm or self.rope_interleaved):
            # q and k sit side by side in the fused output: rotate both at once
            qk = apply_rotary(qkv[:, : (nq + nkv) * d].view(n, nq + nkv, d), cos, sin)
            q, k = qk[:, :nq], qk[:, nq:]
        else:
            q, k = qkv[:, : nq * d].view(n, nq, d), qkv[:, nq * d : (nq + nkv) * d].view(n, nkv, d)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.use_rope:  # (a NoPE layer's positions reach it only through the causal mask)
                q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        return self.o_proj(self.attn(q, k, v))

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return partial_rotary(x, cos, sin, self.rope_dim, self.rope_interleaved)


class LlamaMLP(nn.Module):
    """The gated SiLU feed-forward every family here uses (shared experts and dense layers too)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, reduce_results: bool = True,
        activation: str = "silu",
    ):  # fmt: skip
        """`reduce_results=False`: the caller sums the tensor-parallel ranks' outputs (a MoE block's
        shared expert, in one all-reduce with the routed experts). `activation`: the gate's
        (`act_and_mul`: SiLU, or GELU for Gemma's GeGLU)."""
        super().__init__()
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"hidden_act {activation!r} is not supported; supported: {', '.join(GATED_ACTIVATIONS)}")
        self.activation = activation
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, {"gate": intermediate_size, "up": intermediate_size}, bias
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, reduce_results=reduce_results)

    @classmethod
    def from_config(cls, cfg: Any) -> LlamaMLP:
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
        return cls(cfg.hidden_size, cfg.intermediate_size, bool(getattr(cfg, "mlp_bias", False)), activation=act)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(act_and_mul(self.gate_up_proj(h), self.activation))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, cfg: Any, layer_id: int):
        super().__init__()
        self.self_attn = self.attention_cls(cfg, layer_id)
        self.mlp = self.make_mlp(cfg, layer_id)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_mlp(self, cfg: Any, layer_id: int) -> nn.Module:
        """The feed-forward block of layer `layer_id` (MoE families return a sparse block here)."""
        return LlamaMLP.from_config(cfg)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is h + residual (h alone in the first layer, residual None), as in
        vLLM: returns (the MLP's output, the stream before it), whose sum is the layer's output.
        Each add runs inside the norm after it; h and residual are the layer loop's buffers,
        which the fused add may overwrite."""
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin), residual)
        return self.mlp(h), residual


class SandwichNormDecoderLayer(nn.Module):
    """A norm before and after each of attention and the MLP (Gemma 2/3, GLM-4): each block's
    output is normed before it joins the residual stream."""

    attention_cls: type = LlamaAttention
    norm_cls: type = RMSNorm
    # the checkpoint's names for the norms before attention, after it, before the MLP, after it
    norm_names = (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    )

    def __init__(self, cfg: Any, layer_id: int):
        super().__init__()
        self.self_attn = self.attention_cls(cfg, layer_id)
        self.mlp = LlamaMLP.from_config(cfg)
        for name in self.norm_names:
            setattr(self, name, self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps))

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`LlamaDecoderLayer.forward`'s contract: the stream is h + residual (h alone in the
        first layer); returns (the MLP's normed output, the stream before it)."""
        pre_attn, post_attn, pre_mlp, post_mlp = (getattr(self, name) for name in self.norm_names)
        if residual is None:
            h, residual = pre_attn(h), h
        else:
            h, residual = pre_attn(h, residual)
        h, residual = pre_mlp(post_attn(self.self_attn(h, cos, sin)), residual)
        return post_mlp(self.mlp(h)), residual


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer
    norm_cls = RMSNorm

    def __init__(self, cfg: Any):
        super().__init__()
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = self.make_rotary(cfg)

    def make_rotary(self, cfg: Any) -> nn.Module:
        """The rotary table every layer shares (a family with rope per layer type returns several)."""
        return get_rope(cfg, self.rope_dim(cfg), cfg.max_position_embeddings)

    @staticmethod
    def rope_dim(cfg: Any) -> int:
        """How many dimensions of a head rope rotates (`partial_rotary_factor` of it)."""
        return partial_rope_dim(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, h.dtype)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin)
        h, _ = self.norm(h, residual)  # the last layer's add, fused into the final norm
        return h


def sliding_window_of(cfg: Any, layer_id: int) -> int | None:
    """Layer `layer_id`'s attention window by transformers' rules (None: full attention).

    Mistral and Phi-3 set `sliding_window` alone (every layer); Qwen2/Qwen3 also need
    `use_sliding_window`; `layer_types` says which layers slide (Qwen's `max_window_layers`,
    Gemma's and GPT-OSS's alternation), or older configs' `sliding_window_pattern` (every
    pattern-th layer full).
    """
    window = getattr(cfg, "sliding_window", None)
    if window is None or getattr(cfg, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_id] == "sliding_attention" else None
    pattern = getattr(cfg, "sliding_window_pattern", None)
    if pattern:
        return window if (layer_id + 1) % pattern else None
    return window


class LlamaForCausalLM(nn.Module):
    """forward(input_ids, positions) -> hidden states; compute_logits on the rows that sample."""

    model_cls = LlamaModel
    # Built from the parallel layers (every family here that subclasses this one too).
    supports_tensor_parallel = True
    # checkpoint name -> (our fused parameter, shard): three GEMMs become one
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, hf_config: Any, atom_config: Any = None):
        super().__init__()
        self.config = hf_config
        self.model = self.model_cls(hf_config)
        self.lm_head = lm_head(hf_config.vocab_size, hf_config.hidden_size)
        if getattr(hf_config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return compute_logits(self.lm_head, hidden)


# --- GGUF: how llama.cpp's converter writes this family (atom_core/loading/gguf/architecture.py) ---------------

# GGUF tensor kind -> the hub checkpoint's name (".weight"/".bias" follow as in the file).
LLAMA_GGUF_TENSORS = {
    T.TOKEN_EMBD: "model.embed_tokens",
    T.OUTPUT_NORM: "model.norm",
    T.OUTPUT: "lm_head",
    T.ATTN_NORM: "model.layers.{bid}.input_layernorm",
    T.ATTN_Q: "model.layers.{bid}.self_attn.q_proj",
    T.ATTN_K: "model.layers.{bid}.self_attn.k_proj",
    T.ATTN_V: "model.layers.{bid}.self_attn.v_proj",
    T.ATTN_OUT: "model.layers.{bid}.self_attn.o_proj",
    T.FFN_NORM: "model.layers.{bid}.post_attention_layernorm",
    T.FFN_GATE: "model.layers.{bid}.mlp.gate_proj",
    T.FFN_UP: "model.layers.{bid}.mlp.up_proj",
    T.FFN_DOWN: "model.layers.{bid}.mlp.down_proj",
}
# llama.cpp reorders Q/K rows of llama-arch files for its rope layout (LlamaModel.permute);
# Qwen files are written without it.
LLAMA_GGUF_PERMUTED = {T.ATTN_Q: "num_attention_heads", T.ATTN_K: "num_key_value_heads"}


def gguf_attention_config(file: GGUFFile, config: dict, partial_rotary: bool = False) -> dict:
    """`config` plus the grouped-query attention of a Llama-shaped GGUF (heads, head_dim, biases).

    `partial_rotary`: the family ropes part of each head where `rope.dimension_count` says
    (GLM-4); elsewhere a rope narrower than the head is refused (llama.cpp's Q/K permutation
    assumes the whole head)."""
    arch, heads = file.architecture, config["num_attention_heads"]
    if (rope := config["rope_parameters"]["rope_type"]) not in ("default", "linear"):
        raise ValueError(f"{arch!r} GGUF with rope scaling {rope!r} is not supported")
    head_dim = int(file.get(Keys.Attention.KEY_LENGTH, config["hidden_size"] // heads))
    if int(file.get(Keys.Attention.VALUE_LENGTH, head_dim)) != head_dim:
        raise ValueError(f"{arch!r} GGUF with key_length != value_length is not supported")
    if (rope_dim := int(file.get(Keys.Rope.DIMENSION_COUNT, head_dim))) != head_dim:
        if not partial_rotary:
            raise ValueError(f"{arch!r} GGUF with partial rotary embeddings is not supported")
        config = config | {
            "rope_parameters": config["rope_parameters"] | {"partial_rotary_factor": rope_dim / head_dim}
        }
    return config | {
        "num_key_value_heads": int(file.get(Keys.Attention.HEAD_COUNT_KV, heads)),
        "head_dim": head_dim,
        "attention_bias": file.has(T.ATTN_Q, 0, "bias"),
        "mlp_bias": file.has(T.FFN_UP, 0, "bias"),
        "intermediate_size": int(file.get(Keys.LLM.FEED_FORWARD_LENGTH, required=True)),
    }


def _gguf_llama_config(file: GGUFFile, config: dict) -> dict:
    return gguf_attention_config(file, config) | {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}


def _gguf_mixtral(file: GGUFFile) -> GGUFArchitecture | None:
    """llama.cpp writes Mixtral as "llama" with experts: Mixtral's description reads those."""
    if not file.get(Keys.LLM.EXPERT_COUNT, 0):
        return None
    from atom_models.mixtral import GGUF_MIXTRAL

    return GGUF_MIXTRAL


GGUF_LLAMA = GGUFArchitecture(_gguf_llama_config, LLAMA_GGUF_TENSORS, LLAMA_GGUF_PERMUTED, select=_gguf_mixtral)
