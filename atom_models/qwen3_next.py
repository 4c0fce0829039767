"""Qwen3-Next: Gated DeltaNet ("linear_attention") layers interleaved with gated full attention.

`config.layer_types` says which token mixer each layer has (transformers derives it from
`full_attention_interval` when absent). Gated DeltaNet layers keep per-request state (a
short conv window and a recurrent matrix per value head) instead of a KV cache: their
module names the "gdn" attention builder, which sizes and binds that state and supplies
the kernel (`impl`). Full-attention layers use the paged "mha" pool. Every RMSNorm but the
GDN output norm is zero-centred (`x * (1 + w)`); MoE layers add a sigmoid-gated shared expert.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from atom_core.layers import (
    Attention,
    ColumnParallelLinear,
    FusedMoE,
    Linear,
    QKVParallelLinear,
    RowParallelLinear,
    all_reduce,
    divide,
    get_tp_group,
    shard_rows,
)
from atom_core.plugin_api import SKIP, get_forward_context, packed_target
from atom_models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel, partial_rope_dim, partial_rotary
from atom_models.qwen3_moe import is_sparse_layer
from atom_models.sparse_moe import SparseMoeBlock


def layer_types_of(cfg: Any) -> list[str]:
    types = getattr(cfg, "layer_types", None)
    if types:
        return list(types)
    interval = getattr(cfg, "full_attention_interval", 4) or 4
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(cfg.num_hidden_layers)]


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3-Next's RMSNorm: weight stored around 0, applied as `(1 + w)`, all in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual, (norm(x + residual), x + residual): `RMSNorm`'s contract,
        so the decoder layers carry the residual stream as Llama's do (no fused kernel here)."""
        if residual is not None:
            x = residual = residual + x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (h * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)


class GatedRMSNorm(nn.Module):
    """RMSNorm (plain weight) then `* silu(z)`: the GDN output norm, norm before gate."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(z.float())).to(dtype)


class Qwen3NextSparseMoeBlock(SparseMoeBlock):
    """Softmax-routed experts plus a shared expert scaled by `sigmoid(shared_expert_gate(h))`."""

    def __init__(self, cfg: Any):
        super().__init__(
            cfg.hidden_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            renormalize=bool(getattr(cfg, "norm_topk_prob", True)),
            reduce_results=False,  # with the shared expert's, in one all-reduce
        )
        self.shared_expert = LlamaMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, reduce_results=False)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)
        self.shared_expert_gate.quantizable = False  # one output: nothing to gain

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return all_reduce(super().forward(h) + shared)


class Qwen3NextGatedDeltaNet(nn.Module):
    """One Gated DeltaNet token mixer; its conv and recurrent state live in the "gdn" builder's pools.

    The model owns the projections and the output norm; the bound `impl` owns what touches
    per-request state (causal conv, decay/beta, delta rule), so Qwen3.5's differently
    packed projections can reuse it. Bound by the builder: `impl`, `conv_state`
    [slots, conv_dim, K-1], `ssm_state` [slots, num_v_heads, head_k_dim, head_v_dim].
    """

    attn_type = "gdn"

    def __init__(self, cfg: Any, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        if hv % hk:
            raise ValueError(f"linear_num_value_heads={hv} must be a multiple of linear_num_key_heads={hk}")
        # Tensor parallel: each rank holds whole key-head groups (a key head and its value heads).
        ranks = get_tp_group().world_size
        self.num_k_heads = divide(hk, ranks, "linear-attention key heads")
        self.num_v_heads = hv // ranks
        self.head_k_dim = cfg.linear_key_head_dim
        self.head_v_dim = cfg.linear_value_head_dim
        # the whole layer's q, k and v widths, as the checkpoint stores them
        self.qkv_sections = [hk * self.head_k_dim, hk * self.head_k_dim, hv * self.head_v_dim]
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported by Qwen3-Next's GDN conv; only 'silu'")
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = cfg.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            self.conv_kernel_size,
            groups=self.conv_dim,
            bias=False,
            padding=self.conv_kernel_size - 1,
        )
        shard_rows(self.conv1d.weight, self.qkv_sections)
        # grouped per key head on disk, so an even split of the rows is a split by key-head groups
        self.in_proj_qkvz = ColumnParallelLinear(cfg.hidden_size, ranks * (2 * self.key_dim + 2 * self.value_dim))
        self.in_proj_ba = ColumnParallelLinear(cfg.hidden_size, 2 * hv)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        shard_rows(self.dt_bias)
        shard_rows(self.A_log)
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = RowParallelLinear(ranks * self.value_dim, cfg.hidden_size, bias=False)
        self.impl = None
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`h` [n, hidden] -> mixed_qkv [n, conv_dim] (all q, then k, then v), z [n, value_dim],
        b and a [n, num_v_heads]; Qwen3.5 overrides this for its flat projections."""
        n = h.shape[0]
        hk, g = self.num_k_heads, self.num_v_heads // self.num_k_heads
        dk, dv = self.head_k_dim, self.head_v_dim
        # Projections are grouped per key head: [q | k | v (g heads) | z (g heads)], [b (g) | a (g)].
        qkvz = self.in_proj_qkvz(h).view(n, hk, 2 * dk + 2 * g * dv)
        q, k, v, z = qkvz.split([dk, dk, g * dv, g * dv], dim=-1)
        ba = self.in_proj_ba(h).view(n, hk, 2 * g)
        b, a = ba.split([g, g], dim=-1)
        mixed_qkv = torch.cat((q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)), dim=-1)
        return mixed_qkv, z.reshape(n, -1), b.reshape(n, -1), a.reshape(n, -1)

    @property
    def out_features(self) -> int:
        """Width of what `forward` returns per token (the compiled path's contract)."""
        return self.out_proj.out_features

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.impl is None:
            raise RuntimeError(f"GDN layer {self.layer_id} has no state bound; run it through a ModelRunner")
        n, dv = h.shape[0], self.head_v_dim
        mixed_qkv, z, b, a = self.project(h)
        meta = get_forward_context().attn_metadata_by_type[self.attn_type]
        core = self.impl.forward(self, mixed_qkv, b, a, meta)  # [n, Hv, Dv]
        out = self.norm(core.reshape(-1, dv), z.reshape(-1, dv)).reshape(n, self.value_dim)
        return self.out_proj(out)

    def extra_repr(self) -> str:
        return (
            f"type={self.attn_type}, k_heads={self.num_k_heads}, v_heads={self.num_v_heads}, "
            f"head_k_dim={self.head_k_dim}, head_v_dim={self.head_v_dim}, layer={self.layer_id}"
        )


class Qwen3NextAttention(nn.Module):
    """Full attention: q_proj gives [query | gate] per head; zero-centred q/k norms; partial rope;
    the output is scaled by sigmoid(gate) before o_proj."""

    def __init__(self, cfg: Any, layer_id: int):
        super().__init__()
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        self.head_dim = d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.rope_dim = partial_rope_dim(cfg)
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, heads, kv_heads, bias, q_size_per_head=2 * d)
        self.num_heads, self.num_kv_heads = nq, nkv = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(heads * d, cfg.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps)
        self.attn = Attention(nq, d, d**-0.5, nkv, layer_id, attn_type="mha")

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, d, nq, nkv = h.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        qg, k, v = self.qkv_proj.split(self.qkv_proj(h))
        qg = qg.view(n, nq, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(n, nq * d)
        q = partial_rotary(self.q_norm(q), cos, sin, self.rope_dim)
        k = partial_rotary(self.k_norm(k.reshape(n, nkv, d)), cos, sin, self.rope_dim)
        out = self.attn(q.reshape(n, nq * d), k.reshape(n, nkv * d), v.contiguous())
        return self.o_proj(out * torch.sigmoid(gate))


class Qwen3NextDecoderLayer(nn.Module):
    gdn_cls = Qwen3NextGatedDeltaNet

    def __init__(self, cfg: Any, layer_id: int):
        super().__init__()
        self.layer_type = layer_types_of(cfg)[layer_id]
        if self.layer_type == "linear_attention":
            self.linear_attn = self.gdn_cls(cfg, layer_id)
        elif self.layer_type == "full_attention":
            self.self_attn = Qwen3NextAttention(cfg, layer_id)
        else:
            raise ValueError(f"layer {layer_id}: layer type {self.layer_type!r} is not supported")
        self.mlp = self.make_mlp(cfg, layer_id)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_mlp(self, cfg: Any, layer_id: int) -> nn.Module:
        if is_sparse_layer(cfg, layer_id):
            return Qwen3NextSparseMoeBlock(cfg)
        return LlamaMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`LlamaDecoderLayer.forward`'s contract: the stream is h + residual; returns (MLP output, residual)."""
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h)
        else:
            h = self.self_attn(h, cos, sin)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Qwen3NextModel(LlamaModel):
    layer_cls = Qwen3NextDecoderLayer
    norm_cls = ZeroCenteredRMSNorm
    rope_dim = staticmethod(partial_rope_dim)


class Qwen3NextForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3NextModel  # Llama's packed_modules_mapping: the same fused q/k/v and gate/up
    _experts = FusedMoE.checkpoint_mapping()

    @classmethod
    def map_checkpoint_name(cls, name: str):
        """Hub per-expert `mlp.experts.{e}.gate_proj|up_proj|down_proj` -> stacked experts; the
        multi-token-prediction head (`mtp.*`, the "mtp" proposer's draft) is not loaded here."""
        if name.startswith("mtp."):
            return SKIP
        return cls._experts(name)

    def make_mtp_module(self) -> Qwen3NextMTP:
        """The checkpoint's multi-token-prediction layer (`mtp.*`) as a draft model (the "mtp"
        proposer's); built in the caller's dtype and device, loaded from the same checkpoint."""
        return Qwen3NextMTP(self.config, self.model.layer_cls, self)


class Qwen3NextMTP(nn.Module):
    """Qwen3-Next's (and Qwen3.5's) next-token-prediction layer as a draft model.

    At position p, from the target's final hidden state h_p and the token t_{p+1}:
    h' = fc([pre_fc_norm_embedding(embed(t_{p+1})); pre_fc_norm_hidden(h_p)]) -> one decoder
    layer of full attention (KV layer `num_hidden_layers` of the pool) -> norm; the logits of
    t_{p+2} are the target's LM head of that, which is also the next chained step's hidden
    state. The embedding, rope and LM head are the target's.

    Draft-model protocol (atom_spec/draft.py): `forward(input_ids, positions, hidden)`,
    `compute_logits`, `draft_id_to_target`.
    """

    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    draft_id_to_target = None  # drafts are target token ids
    checkpoint_prefix = "mtp."

    def __init__(self, cfg: Any, layer_cls: type, target: nn.Module):
        super().__init__()
        n, h, eps = cfg.num_hidden_layers, cfg.hidden_size, cfg.rms_norm_eps
        layer_cfg = copy.copy(cfg)  # the MTP layer attends fully, as layer n
        layer_cfg.layer_types = layer_types_of(cfg) + ["full_attention"]
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(h, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(h, eps)
        self.fc = Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([layer_cls(layer_cfg, n)])
        self.norm = ZeroCenteredRMSNorm(h, eps)
        self._target = (target,)  # a tuple: the target's modules are not registered twice

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        """`mtp.*` -> this module (experts stacked); everything else (the target) is skipped."""
        if not name.startswith(self.checkpoint_prefix):
            return SKIP
        rest = name[len(self.checkpoint_prefix) :]
        return Qwen3NextForCausalLM._experts(rest) or packed_target(rest, self.packed_modules_mapping)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        (target,) = self._target
        embed = target.model.embed_tokens(input_ids)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embed), self.pre_fc_norm_hidden(hidden)], dim=-1))
        cos, sin = target.model.rotary_emb(positions, x.dtype)
        x, _ = self.norm(*self.layers[0](x, None, cos, sin))  # the layer's last add, in the norm
        return x, x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        (target,) = self._target
        return target.compute_logits(hidden)
