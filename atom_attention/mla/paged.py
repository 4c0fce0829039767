"""MLA kernels over the latent pool: absorbed for decode, expanded (or absorbed) for prompt chunks.

Absorbed: W_UK folds into the query (`q_lat = q_nope W_UK`, one `kv_lora_rank` vector a
head), every head attends to the shared latent rows `[c_kv | k_pe]` with the values being
`c_kv` itself, and W_UV maps the result to `v_head_dim`. It reads 576 values a cached token
(DeepSeek-V3) instead of 128 heads x 320. Expanded: a prompt chunk's keys and values are
rebuilt from the latents through `kv_b_proj` and attended as ordinary MHA; with many
queries per key that costs fewer flops than the absorbed path's 576-wide scores, and
`benchmarks/mla_paths.py` measures expanded prefill the faster at every size tried
(figures in docs/architecture.md). Both follow
transformers' numerics: scores `q_nope . k_nope + q_pe . k_pe` times the layer's scale,
float32 softmax.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from atom_attention import cpu_kernels
from atom_attention.mha.torch_paged import (
    PER_REQUEST_DECODE_MAX,
    as_cached,
    decode_chunks,
    rectangular_masks,
)
from atom_core.layers.graph_capture import launch
from atom_core.plugin_api import AttentionMetadata

# Up to this many new tokens per request, the C++ kernel serves the row, absorbed.
KERNEL_MAX_QUERY_LEN = 8


def absorb_query(layer, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, qk_nope] and [tokens, heads, qk_rope] -> [tokens, heads, kv_lora_rank + qk_rope]."""
    q_lat = torch.bmm(q_nope.transpose(0, 1), layer.w_uk).transpose(0, 1)  # [tokens, heads, kv_lora_rank]
    return torch.cat((q_lat, q_pe), dim=-1)


def absorb_output(layer, o_lat: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, kv_lora_rank] -> [tokens, heads, v_head_dim] through W_UV."""
    return torch.bmm(o_lat.transpose(0, 1), layer.w_uv.transpose(1, 2)).transpose(0, 1)


class TorchMLAAttention:
    """The portable path (any device torch runs on). `prefill` picks how prompt chunks run:
    "expand" (default, faster for chunks of many tokens here) or "absorb"."""

    prefill: str = "expand"

    def prepare(self, meta: AttentionMetadata, block_size: int, null_block: int) -> None:
        if meta.padded_block_tables is not None:
            meta.extra.update(rectangular_masks(meta, block_size))
        slots = meta.slot_mapping
        fresh = meta.slot_mapping_cpu[meta.positions_cpu % block_size == 0] // block_size
        meta.extra["fresh_blocks"] = torch.from_numpy(fresh).to(slots.device)
        q_lens = np.diff(meta.query_start_loc_cpu)
        longer = np.flatnonzero(q_lens > 1)
        num_decodes = int(longer[0]) if len(longer) else meta.num_reqs
        meta.extra["decode_reqs"] = 0
        if meta.padded_block_tables is None and num_decodes > PER_REQUEST_DECODE_MAX:
            meta.extra.update(decode_chunks(meta, block_size, null_block, num_decodes))
            meta.extra["decode_reqs"] = num_decodes

    def forward(self, layer, q_nope, q_pe, c_kv, k_pe, meta: AttentionMetadata) -> torch.Tensor:
        """-> [tokens, heads, v_head_dim]"""
        self.write_latent(layer, c_kv, k_pe, meta)
        if meta.padded_block_tables is not None:
            return absorb_output(layer, self.rectangular(layer, absorb_query(layer, q_nope, q_pe), meta))
        out = q_nope.new_empty((q_nope.shape[0], layer.num_heads, layer.v_head_dim))
        nd = meta.extra["decode_reqs"]
        if nd:
            t = int(meta.query_start_loc_cpu[nd])
            out[:t] = absorb_output(layer, self.decode(layer, absorb_query(layer, q_nope[:t], q_pe[:t]), meta))
        return self.per_request(layer, q_nope, q_pe, c_kv, k_pe, meta, nd, out)

    @staticmethod
    def write_latent(layer, c_kv: torch.Tensor, k_pe: torch.Tensor, meta: AttentionMetadata) -> None:
        fresh = meta.extra.get("fresh_blocks")
        if fresh is not None and fresh.numel():
            # Unwritten slots may hold NaN, and 0 * NaN leaks through decode's block-wide
            # products: clear a block when its first token arrives.
            layer.kv_cache.index_fill_(0, fresh, 0.0)
        # Every token's row lands before any request reads (prompts of one batch may share a block).
        rows = torch.cat((c_kv, k_pe), dim=-1).to(layer.kv_cache.dtype)
        layer.kv_cache.view(-1, layer.latent_dim).index_copy_(0, meta.slot_mapping, rows)

    def per_request(self, layer, q_nope, q_pe, c_kv, k_pe, meta, first_req: int, out: torch.Tensor) -> torch.Tensor:
        """Rows from `first_req` on, one at a time: new tokens over their cached prefix and each other."""
        cu, ctx = meta.query_start_loc_cpu, meta.context_lens_cpu
        bs = layer.kv_cache.shape[1]
        for i in range(first_req, meta.num_reqs):
            s, e, L = int(cu[i]), int(cu[i + 1]), int(ctx[i])
            n = e - s
            if L == n:  # nothing cached: the new latents are the whole context (as the cache holds them)
                lat = as_cached(torch.cat((c_kv[s:e], k_pe[s:e]), dim=-1), layer.kv_cache)
            else:
                table = meta.block_tables[i, : (L + bs - 1) // bs]
                lat = layer.kv_cache.index_select(0, table).flatten(0, 1)[:L].to(q_nope.dtype)  # [L, latent]
            # Causal, aligned to the end: new token j sees keys up to position L - n + j.
            mask = None
            if n > 1:
                mask = torch.arange(L, device=lat.device)[None, :] <= torch.arange(L - n, L, device=lat.device)[:, None]
            if self.prefill == "absorb" or n == 1:
                q = absorb_query(layer, q_nope[s:e], q_pe[s:e])
                out[s:e] = absorb_output(layer, attend_latent(q, lat, layer.kv_lora_rank, mask, layer.scale))
            else:
                out[s:e] = attend_expanded(layer, q_nope[s:e], q_pe[s:e], lat, mask)
        return out

    def decode(self, layer, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One absorbed query per request over chunks of its blocks, merged with a segmented softmax.

        q: [reqs, heads, latent] -> [reqs, heads, kv_lora_rank]."""
        x = meta.extra
        req, blocks, mask = x["chunk_req"], x["chunk_blocks"], x["chunk_mask"]  # [C], [C * c], [C, c * bs]
        num_reqs, heads, dim = q.shape
        chunks = req.shape[0]
        kb = layer.kv_cache.index_select(0, blocks).view(chunks, -1, dim).to(q.dtype)  # [C, c * bs, latent]
        qc = q.index_select(0, req)  # [C, heads, latent]
        scores = torch.matmul(qc, kb.transpose(-1, -2)).float().mul_(layer.scale)  # [C, heads, c * bs]
        scores.masked_fill_(mask[:, None, :], float("-inf"))
        chunk_max = scores.amax(-1)  # [C, heads]
        req_max = torch.full((num_reqs, heads), float("-inf"), device=q.device)
        req_max.scatter_reduce_(0, req[:, None].expand_as(chunk_max), chunk_max, "amax")
        p = scores.sub_(req_max.index_select(0, req).unsqueeze(-1)).exp_()
        denom = torch.zeros((num_reqs, heads), device=q.device).index_add_(0, req, p.sum(-1))
        pv = torch.matmul(p.to(kb.dtype), kb[..., : layer.kv_lora_rank]).float()  # [C, heads, rank]
        out = torch.zeros((num_reqs, heads, layer.kv_lora_rank), device=q.device).index_add_(0, req, pv)
        return out.div_(denom.unsqueeze(-1)).to(q.dtype)

    def rectangular(self, layer, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The padding policy's layout, absorbed: every row gathers its `[width]` padded blocks,
        a mask hides padding, slots past tkv and the future. q: [tokens, heads, latent] -> [tokens, heads, rank]."""
        x = meta.extra
        table = meta.padded_block_tables  # [R, W]
        num_reqs, width = table.shape
        _, bs, dim = layer.kv_cache.shape
        rows = layer.kv_cache.index_select(0, table.reshape(-1)).view(num_reqs, 1, width * bs, dim).to(q.dtype)
        rows = rows.masked_fill_(x["rect_kv_pad"], 0.0)  # [R, 1, W * bs, latent]
        tok_req, tok_idx = x["rect_tok_req"], x["rect_tok_idx"]
        qp = q.new_zeros((num_reqs, meta.max_seqlen_q, q.shape[1], dim))
        qp[tok_req, tok_idx] = q
        o = F.scaled_dot_product_attention(
            qp.transpose(1, 2),
            rows,
            rows[..., : layer.kv_lora_rank],
            attn_mask=x["rect_mask"],
            scale=layer.scale,
            enable_gqa=True,
        )  # [R, heads, Qmax, rank]
        return o.transpose(1, 2)[tok_req, tok_idx]


def attend_latent(q: torch.Tensor, lat: torch.Tensor, rank: int, mask, scale: float) -> torch.Tensor:
    """Absorbed queries [n, heads, latent] over latent rows [L, latent] -> [n, heads, rank]."""
    if mask is None and q.shape[0] == 1:  # one query: every head against the same rows, two plain products
        w = torch.matmul(q[0], lat.t()).float().mul_(scale).softmax(dim=-1)  # [heads, L]
        return torch.matmul(w.to(lat.dtype), lat[:, :rank])[None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        lat[None, None],
        lat[None, None, :, :rank],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def attend_expanded(layer, q_nope, q_pe, lat: torch.Tensor, mask) -> torch.Tensor:
    """Per-head K and V rebuilt from the latents, then plain attention -> [n, heads, v_head_dim]."""
    L, heads, nope = lat.shape[0], layer.num_heads, layer.qk_nope_head_dim
    kv = F.linear(lat[:, : layer.kv_lora_rank], layer.kv_b_weight).view(L, heads, nope + layer.v_head_dim)
    k = torch.cat((kv[..., :nope], lat[:, None, layer.kv_lora_rank :].expand(L, heads, -1)), dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        kv[..., nope:].transpose(0, 1)[None],
        attn_mask=mask,
        scale=layer.scale,
    )
    return o[0].transpose(0, 1)


class CpuMLAAttention(TorchMLAAttention):
    """Short rows (decode) through the C++ paged kernel, absorbed, reading latents in place.

    The MHA kernel serves as is: one KV "head" whose key row is the latent `[c_kv | k_pe]`
    and whose value row is the same row, so each head's output is `[o_lat | o_pe]` and the
    first `kv_lora_rank` values are the absorbed result (the 64 extra accumulated values
    cost about 11% of the accumulation, and no second pass over the rows). The kernel has a
    vectorised case for the 576-wide row. Against the torch path (which gathers each
    request's blocks for two GEMMs) it wins at 16 heads (V2-Lite) on long and many
    contexts; at 128 heads (V3) the torch GEMMs, on the CPU's bf16 dot-product
    instructions, stay ahead (`benchmarks/mla_paths.py`).
    """

    def __init__(self):
        self.ops = cpu_kernels.load()
        if self.ops is None:
            raise RuntimeError("Atom's C++ CPU attention kernel did not build; see the warning logged above")

    def prepare(self, meta: AttentionMetadata, block_size: int, null_block: int) -> None:
        if meta.padded_block_tables is not None:
            meta.extra.update(rectangular_masks(meta, block_size))
        long_rows = np.flatnonzero(np.diff(meta.query_start_loc_cpu) > KERNEL_MAX_QUERY_LEN)
        meta.extra["kernel_reqs"] = int(long_rows[0]) if len(long_rows) else meta.num_reqs

    def forward(self, layer, q_nope, q_pe, c_kv, k_pe, meta: AttentionMetadata) -> torch.Tensor:
        self.write_latent(layer, c_kv, k_pe, meta)  # the kernel reads no slot past a request's length: no clearing
        cache = layer.kv_cache.unsqueeze(0)  # [1, blocks, block_size, latent]
        rank = layer.kv_lora_rank
        if meta.padded_block_tables is not None:
            return absorb_output(layer, self.rectangular(layer, absorb_query(layer, q_nope, q_pe), meta))
        nk = meta.extra["kernel_reqs"]
        out = q_nope.new_empty((q_nope.shape[0], layer.num_heads, layer.v_head_dim))
        if nk:
            t = int(meta.query_start_loc_cpu[nk])
            q = absorb_query(layer, q_nope[:t], q_pe[:t])
            if nk == meta.num_reqs:
                tables, lens, starts = meta.block_tables, meta.context_lens, meta.query_start_loc
            else:
                tables, lens, starts = meta.block_tables[:nk], meta.context_lens[:nk], meta.query_start_loc[: nk + 1]
            o = launch(self.ops.paged_attention, q, cache, cache, tables, lens, starts, layer.scale, 0, 0.0, None)
            out[:t] = absorb_output(layer, o[..., :rank])
        if nk == meta.num_reqs:
            return out
        return self.per_request(layer, q_nope, q_pe, c_kv, k_pe, meta, nk, out)
