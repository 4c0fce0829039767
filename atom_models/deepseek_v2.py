"""DeepSeek-V2 and -V3: multi-head latent attention, shared + routed experts, dense first layers.

Attention caches one latent row per token (`MLAAttention`, the "mla" builder). q and the
latent come out of one fused GEMM (`qkv_a_proj` = q_proj or q_a_proj, plus
kv_a_proj_with_mqa). V3 differs in routing only (sigmoid scores with a correction bias,
`noaux_tc`); the checkpoint's multi-token-prediction layer (index `num_hidden_layers`)
is read past by the target and loaded as a draft model by `make_mtp_module` (the "mtp"
proposer asks for it).
"""

from __future__ import annotations

import re
from typing import Any

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from gguf import MODEL_TENSOR as T
from gguf import Keys
from torch import nn

from atom_core.layers import (
    ColumnParallelLinear,
    Linear,
    MergedColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    all_reduce,
    apply_rotary,
    apply_rotary_interleaved,
    divide,
    get_tp_group,
    shard_rows,
)
from atom_core.layers.mla import MLAAttention
from atom_core.layers.moe import QWEN_EXPERT_NAMES, FusedMoE, select_experts
from atom_core.layers.rotary import rope_parameters, yarn_get_mscale
from atom_core.plugin_api import (
    SKIP,
    GGUFArchitecture,
    GGUFFile,
    Joined,
    moe_tensors,
    packed_target,
)
from atom_models.llama import (
    LLAMA_GGUF_TENSORS,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)


def softmax_scale(cfg: Any) -> float:
    """qk_head_dim ** -0.5, times mscale**2 under a scaled rope with `mscale_all_dim` (as transformers)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    p = rope_parameters(cfg)
    if p["rope_type"] != "default" and p.get("mscale_all_dim"):
        factor = p.get("factor") or cfg.max_position_embeddings / p["original_max_position_embeddings"]
        scale *= yarn_get_mscale(factor, p["mscale_all_dim"]) ** 2
    return scale


class DeepseekV2Attention(nn.Module):
    def __init__(self, cfg: Any, layer_id: int):
        super().__init__()
        if getattr(cfg, "attention_bias", False):
            raise ValueError("DeepSeek attention with attention_bias=True is not supported")
        heads = cfg.num_attention_heads
        # Tensor parallel splits the heads; the latent (and its cache) is whole on every rank.
        self.num_heads = h = divide(heads, get_tp_group().world_size, "attention heads")
        self.nope, self.rope_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.q_lora_rank = getattr(cfg, "q_lora_rank", None)
        qk = self.nope + self.rope_dim
        q_out = self.q_lora_rank or heads * qk
        self.qkv_a_proj = MergedColumnParallelLinear(
            cfg.hidden_size, {"q": q_out, "kv_a": cfg.kv_lora_rank + self.rope_dim},
            replicated=("q", "kv_a") if self.q_lora_rank else ("kv_a",),
        )  # fmt: skip
        if self.q_lora_rank:
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)  # transformers' default eps for both
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        # Plain nn.Linear: MLA reads W_UK / W_UV as views of this weight, never repacked.
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (self.nope + cfg.v_head_dim), bias=False)
        shard_rows(self.kv_b_proj.weight)
        self.o_proj = RowParallelLinear(heads * cfg.v_head_dim, cfg.hidden_size, bias=False)
        self.interleaved = bool(getattr(cfg, "rope_interleave", True))
        self.attn = MLAAttention(
            h, self.nope, self.rope_dim, cfg.v_head_dim, cfg.kv_lora_rank, softmax_scale(cfg), self.kv_b_proj, layer_id
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, kv_a = self.qkv_a_proj.split(self.qkv_a_proj(x))
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(n, self.num_heads, self.nope + self.rope_dim)
        c_kv = self.kv_a_layernorm(kv_a[:, : self.kv_lora_rank].contiguous())
        rotate = apply_rotary_interleaved if self.interleaved else apply_rotary
        q_pe = rotate(q[..., self.nope :].contiguous(), cos, sin)
        k_pe = rotate(kv_a[:, None, self.kv_lora_rank :].contiguous(), cos, sin)[:, 0]
        return self.o_proj(self.attn(q[..., : self.nope], q_pe, c_kv, k_pe))


class DeepseekGate(nn.Module):
    """Router weights (and V3's selection bias), scored in float32 as transformers does."""

    def __init__(self, cfg: Any, correction_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size), requires_grad=False)
        if correction_bias:
            # float32 whatever the model's dtype (checkpoints store it so): it decides near ties
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(cfg.n_routed_experts, dtype=torch.float32), requires_grad=False
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class DeepseekV2MoE(nn.Module):
    """Routed experts (the shared `FusedMoE`) plus always-on shared experts."""

    correction_bias = False

    def __init__(self, cfg: Any):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.method = self.routing_method(cfg)
        self.renormalize = bool(getattr(cfg, "norm_topk_prob", False))
        self.n_group, self.topk_group = getattr(cfg, "n_group", None), getattr(cfg, "topk_group", None)
        self.scaling = float(getattr(cfg, "routed_scaling_factor", 1.0))
        self.gate = DeepseekGate(cfg, self.correction_bias)
        shared = getattr(cfg, "n_shared_experts", None)
        # the routed and shared experts' tensor-parallel parts summed in one all-reduce (`forward`)
        self.experts = FusedMoE(
            cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, reduce_results=not shared
        )
        self.shared_experts = (
            LlamaMLP(cfg.hidden_size, cfg.moe_intermediate_size * shared, reduce_results=False) if shared else None
        )

    @staticmethod
    def routing_method(cfg: Any) -> str:
        return getattr(cfg, "topk_method", None) or "greedy"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(
            self.gate(x),
            self.top_k,
            self.method,
            renormalize=self.renormalize,
            num_expert_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.scaling,
            correction_bias=getattr(self.gate, "e_score_correction_bias", None),
        )
        out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else all_reduce(out + self.shared_experts(x))


class DeepseekV3MoE(DeepseekV2MoE):
    correction_bias = True

    @staticmethod
    def routing_method(cfg: Any) -> str:
        return "noaux_tc"


def is_moe_layer(cfg: Any, layer_id: int) -> bool:
    return (
        bool(getattr(cfg, "n_routed_experts", None))
        and layer_id >= (getattr(cfg, "first_k_dense_replace", 0) or 0)
        and layer_id % (getattr(cfg, "moe_layer_freq", 1) or 1) == 0
    )


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    attention_cls = DeepseekV2Attention
    moe_cls = DeepseekV2MoE

    def make_mlp(self, cfg: Any, layer_id: int) -> nn.Module:
        if is_moe_layer(cfg, layer_id):
            return self.moe_cls(cfg)
        return LlamaMLP(cfg.hidden_size, cfg.intermediate_size)


class DeepseekV2Model(LlamaModel):
    layer_cls = DeepseekV2DecoderLayer

    @staticmethod
    def rope_dim(cfg: Any) -> int:
        return cfg.qk_rope_head_dim  # only the decoupled rope part of each head rotates


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    model_cls = DeepseekV2Model
    packed_modules_mapping = {
        "q_a_proj": ("qkv_a_proj", "q"),
        "q_proj": ("qkv_a_proj", "q"),
        "kv_a_proj_with_mqa": ("qkv_a_proj", "kv_a"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, hf_config: Any, atom_config: Any = None):
        super().__init__(hf_config, atom_config)
        self._extra_layer = re.compile(r"^model\.layers\.(\d+)\.")
        self._experts = None
        if any(is_moe_layer(hf_config, i) for i in range(hf_config.num_hidden_layers)):
            self._experts = FusedMoE.checkpoint_mapping()

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        """Per-expert hub tensors -> stacked experts; layers past `num_hidden_layers` (MTP) are skipped."""
        m = self._extra_layer.match(name)
        if m is not None and int(m.group(1)) >= self.config.num_hidden_layers:
            return SKIP
        return self._experts(name) if self._experts is not None else None

    def make_mtp_module(self) -> DeepseekMTP:
        """The checkpoint's multi-token-prediction layer as a draft model (the "mtp" proposer's).

        Built in the caller's default dtype and device; load it with
        `load_model_weights(module, folder)` from the target's own checkpoint.
        """
        return DeepseekMTP.of(self)


class DeepseekMTP(nn.Module):
    """DeepSeek-V3's next-token-prediction layer (checkpoint index `num_hidden_layers`) as a draft model.

    At position p, from the target's final hidden state h_p and the token t_{p+1}:
    h' = eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)]) -> decoder layer -> shared_head.norm,
    and the logits of t_{p+2} are shared_head.head of that. The normed output is also the
    hidden state the next chained step reads. The embedding and rope are the target's; the
    decoder layer's attention is one more KV layer (layer id `num_hidden_layers`) in the pool.

    Draft-model protocol (atom_spec/draft.py): `forward(input_ids, positions, hidden) ->
    (hidden for the logits, hidden for the next step)`, `compute_logits`, `draft_id_to_target`.
    """

    packed_modules_mapping = DeepseekV2ForCausalLM.packed_modules_mapping
    draft_id_to_target = None  # drafts are target token ids

    @classmethod
    def of(cls, target: nn.Module) -> DeepseekMTP:
        """The MTP layer of `target` (DeepSeek-V3, GLM-4-MoE: the same shape), named as its layers are."""
        n = getattr(target.config, "num_nextn_predict_layers", 0) or 0
        if n < 1:
            raise ValueError(
                f"{type(target).__name__}: this checkpoint has no multi-token-prediction layer "
                f"(num_nextn_predict_layers={n} in config.json); speculative method 'mtp' needs one"
            )
        mtp = cls(target.config, target.model.layer_cls, target.model.embed_tokens, target.model.rotary_emb)
        mtp.packed_modules_mapping = target.packed_modules_mapping
        return mtp

    def __init__(self, cfg: Any, layer_cls: type, embed_tokens: nn.Embedding, rotary_emb: nn.Module):
        super().__init__()
        self.layer_index = n = cfg.num_hidden_layers
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.layer = layer_cls(cfg, n)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, eps)
        self.shared_head.head = Linear(h, cfg.vocab_size, bias=False)
        self._target = (embed_tokens, rotary_emb)  # the target's: a tuple, not registered twice
        self.checkpoint_prefix = f"model.layers.{n}."
        self._experts = FusedMoE.checkpoint_mapping() if is_moe_layer(cfg, n) else None

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        """`model.layers.{N}.*` -> this module's parameters; everything else (the target) is skipped."""
        if not name.startswith(self.checkpoint_prefix):
            return SKIP
        rest = name[len(self.checkpoint_prefix) :]
        if rest.startswith("embed_tokens."):  # a copy of the target's, which this module shares
            return SKIP
        if not rest.startswith(("enorm.", "hnorm.", "eh_proj.", "shared_head.")):
            rest = "layer." + rest
        found = self._experts(rest) if self._experts is not None else None
        return found if found is not None else packed_target(rest, self.packed_modules_mapping)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embed, rotary = self._target
        x = self.eh_proj(torch.cat([self.enorm(embed(input_ids)), self.hnorm(hidden)], dim=-1))
        cos, sin = rotary(positions, x.dtype)
        x, _ = self.shared_head.norm(*self.layer(x, None, cos, sin))  # the layer's last add, fused
        return x, x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(hidden)


class DeepseekV3DecoderLayer(DeepseekV2DecoderLayer):
    moe_cls = DeepseekV3MoE


class DeepseekV3Model(DeepseekV2Model):
    layer_cls = DeepseekV3DecoderLayer


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    model_cls = DeepseekV3Model


# --- GGUF (atom_core/loading/gguf/architecture.py): llama.cpp's "deepseek2", for V2 and V3 alike ----------------

DEEPSEEK_GGUF_TENSORS = (
    {k: v for k, v in LLAMA_GGUF_TENSORS.items() if k not in (T.ATTN_K, T.ATTN_V)}
    | {
        T.ATTN_Q_A: "model.layers.{bid}.self_attn.q_a_proj",
        T.ATTN_Q_A_NORM: "model.layers.{bid}.self_attn.q_a_layernorm",
        T.ATTN_Q_B: "model.layers.{bid}.self_attn.q_b_proj",
        T.ATTN_KV_A_MQA: "model.layers.{bid}.self_attn.kv_a_proj_with_mqa",
        T.ATTN_KV_A_NORM: "model.layers.{bid}.self_attn.kv_a_layernorm",
        T.ATTN_KV_B: "model.layers.{bid}.self_attn.kv_b_proj",  # files from before the k_b / v_b split
        T.FFN_EXP_PROBS_B: {"bias": "model.layers.{bid}.mlp.gate.e_score_correction_bias"},
        T.FFN_GATE_SHEXP: "model.layers.{bid}.mlp.shared_experts.gate_proj",
        T.FFN_UP_SHEXP: "model.layers.{bid}.mlp.shared_experts.up_proj",
        T.FFN_DOWN_SHEXP: "model.layers.{bid}.mlp.shared_experts.down_proj",
    }
    | moe_tensors("mlp", QWEN_EXPERT_NAMES)
)


def _join_kv_b(config: dict, k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """kv_b_proj back from llama.cpp's split: k_b [heads, kv_lora_rank, nope] (transposed for
    absorbed attention), v_b [heads, v_head_dim, kv_lora_rank]; per head, the nope rows then the v rows."""
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, config["kv_lora_rank"]).contiguous()


def _gguf_config(file: GGUFFile, config: dict) -> dict:
    arch, n = file.architecture, file.block_count
    kv_lora_rank = int(file.get(Keys.Attention.KV_LORA_RANK, required=True))
    rope_dim = int(file.get(Keys.Rope.DIMENSION_COUNT, required=True))
    # Files since the k_b / v_b split give the attention's lengths as MQA over the latent and
    # the per-head ones under *_mla; older files give the per-head ones only.
    qk_head_dim = int(file.get(Keys.Attention.KEY_LENGTH_MLA) or file.get(Keys.Attention.KEY_LENGTH, required=True))
    v_head_dim = int(file.get(Keys.Attention.VALUE_LENGTH_MLA) or file.get(Keys.Attention.VALUE_LENGTH, required=True))
    dense = int(file.get(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0))
    moe = file.layers_with(T.FFN_GATE_INP)
    if moe and moe != list(range(dense, n)):
        raise ValueError(f"{arch!r} GGUF: experts in layers {moe}, expected every layer from {dense} on")

    # V3 routes by sigmoid scores with a selection bias (exp_probs_b); V2 by softmax. Files
    # without expert_gating_func (converted from transformers' configs, which lack
    # scoring_func) say it by the bias alone.
    gating = file.get(Keys.LLM.EXPERT_GATING_FUNC)
    biased = bool(file.layers_with(T.FFN_EXP_PROBS_B, "bias"))
    sigmoid, softmax = gguf.ExpertGatingFuncType.SIGMOID, gguf.ExpertGatingFuncType.SOFTMAX
    v3 = gating == sigmoid or (gating is None and biased)
    if gating not in (None, sigmoid, softmax) or v3 != biased:
        bias = "with" if biased else "without"
        raise ValueError(f"{arch!r} GGUF: expert gating {gating} {bias} exp_probs_b is not supported")

    groups = file.get(Keys.LLM.EXPERT_GROUP_COUNT)
    q_lora_rank = file.get(Keys.Attention.Q_LORA_RANK)
    rope = dict(config["rope_parameters"])
    if rope["rope_type"] == "yarn":
        # llama.cpp keeps 0.1 * mscale_all_dim and scales attention by it alone, as
        # transformers does when mscale == mscale_all_dim.
        log_mul = file.get(Keys.Rope.SCALING_YARN_LOG_MUL)
        if log_mul is not None:
            rope["mscale"] = rope["mscale_all_dim"] = float(str(np.float32(float(log_mul) / 0.1)))
    config = config | {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "rope_parameters": rope,
        "num_key_value_heads": config["num_attention_heads"],  # the file's 1: MLA run as MQA over the latent
        "kv_lora_rank": kv_lora_rank,
        "q_lora_rank": None if q_lora_rank is None else int(q_lora_rank),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": qk_head_dim - rope_dim,
        "v_head_dim": v_head_dim,
        "head_dim": rope_dim,
        "attention_bias": False,
        "intermediate_size": int(file.get(Keys.LLM.FEED_FORWARD_LENGTH, required=True)),
        "first_k_dense_replace": dense,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0,  # llama.cpp leaves the MTP layer out
    }
    if not moe:
        return config | {"n_routed_experts": None}
    config |= {
        "n_routed_experts": int(file.get(Keys.LLM.EXPERT_COUNT, required=True)),
        "num_experts_per_tok": int(file.get(Keys.LLM.EXPERT_USED_COUNT, required=True)),
        "moe_intermediate_size": int(file.get(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, required=True)),
        "n_shared_experts": int(file.get(Keys.LLM.EXPERT_SHARED_COUNT, 0)) or None,
        "routed_scaling_factor": float(str(np.float32(file.get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 1.0)))),
        "norm_topk_prob": bool(file.get(Keys.LLM.EXPERT_WEIGHTS_NORM, False)),
        "n_group": None if groups is None else int(groups),
        "topk_group": None if groups is None else int(file.get(Keys.LLM.EXPERT_GROUP_USED_COUNT, groups)),
    }
    if not v3:
        config["topk_method"] = "group_limited_greedy" if (groups or 1) > 1 else "greedy"
    return config


GGUF_DEEPSEEK2 = GGUFArchitecture(
    _gguf_config,
    DEEPSEEK_GGUF_TENSORS,
    joined={"model.layers.{bid}.self_attn.kv_b_proj.weight": Joined((T.ATTN_K_B, T.ATTN_V_B), _join_kv_b)},
)


def kimi_k2_config(config: dict) -> Any:
    """Kimi-K2's config.json (`model_type: kimi_k2`, which transformers does not map): DeepSeek-V3's
    shape with one expert group, read as a `DeepseekV3Config`."""
    from transformers import DeepseekV3Config

    skipped = ("model_type", "auto_map", "transformers_version")
    return DeepseekV3Config(**{k: v for k, v in config.items() if k not in skipped})
