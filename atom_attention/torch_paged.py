"""Paged attention in plain torch: exact, padding-free, and replaceable.

A faster kernel (a C++ extension, aiter on ROCm) plugs in by subclassing the builder
and setting `impl_cls`; models and the runner never see the difference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_core.attention import AttentionMetadata


class TorchPagedAttention:
    def forward(
        self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim] -> [tokens, heads, dim]."""
        k_cache, v_cache = layer.k_cache, layer.v_cache
        # Every token's KV is written before any request reads: two prompts of one
        # prefill batch may share a block the first one fills.
        blk, off = meta.extra["slot_block"], meta.extra["slot_offset"]
        k_cache[blk, :, off] = k
        v_cache[blk, :, off] = v
        if meta.max_seqlen_q == 1 and "unit_req" in meta.extra:
            return self.decode(layer, q, meta)
        return self.varlen(layer, q, k, v, meta)

    def varlen(self, layer, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        """Any number of new tokens per request, attending to their cached prefix and to each other."""
        out = torch.empty_like(q)
        cu = meta.query_start_loc_cpu
        ctx = meta.context_lens_cpu
        bs = k_cache_block_size(layer)
        for i in range(meta.num_reqs):
            s, e, L = int(cu[i]), int(cu[i + 1]), int(ctx[i])
            n = e - s
            qi = q[s:e].transpose(0, 1)  # [heads, n, dim]
            if L == n:  # nothing cached: attend within the new tokens
                ki, vi = k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=layer.scale, enable_gqa=True)
            else:
                nb = (L + bs - 1) // bs
                table = meta.block_tables[i, :nb]
                ki = _gather(layer.k_cache, table, L)
                vi = _gather(layer.v_cache, table, L)
                # Causal, aligned to the end: new token j sees keys up to position L - n + j.
                mask = torch.arange(L, device=q.device)[None, :] <= torch.arange(L - n, L, device=q.device)[:, None]
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=layer.scale, enable_gqa=True)
            out[s:e] = o.transpose(0, 1)
        return out

    def decode(self, layer, q, meta: AttentionMetadata) -> torch.Tensor:
        """One query per request over (request, block) units, merged with a segmented softmax."""
        x = meta.extra
        req, units, mask = x["unit_req"], x["unit_block"], x["unit_mask"]
        num_reqs, heads, dim = q.shape
        kv_heads = layer.num_kv_heads
        group = heads // kv_heads
        kb = layer.k_cache[units]  # [U, kv_heads, bs, dim]
        # Slots past a request's length hold whatever was there before (NaN included):
        # zero them, since 0 * NaN would leak into the sum.
        vb = layer.v_cache[units].masked_fill_(mask[:, None, :, None], 0)
        qu = q[req].view(-1, kv_heads, group, dim)  # [U, kv_heads, group, dim]
        scores = torch.matmul(qu, kb.transpose(-1, -2)).float() * layer.scale  # [U, kv_heads, group, bs]
        scores.masked_fill_(mask[:, None, None, :], float("-inf"))
        unit_max = scores.amax(-1)  # [U, kv_heads, group]
        req_max = torch.full((num_reqs, kv_heads, group), float("-inf"), device=q.device)
        req_max.scatter_reduce_(0, req[:, None, None].expand_as(unit_max), unit_max, "amax")
        p = torch.exp(scores - req_max[req].unsqueeze(-1))
        denom = torch.zeros((num_reqs, kv_heads, group), device=q.device).index_add_(0, req, p.sum(-1))
        pv = torch.matmul(p.to(vb.dtype), vb).float()  # [U, kv_heads, group, dim]
        out = torch.zeros((num_reqs, kv_heads, group, dim), device=q.device).index_add_(0, req, pv)
        return (out / denom.unsqueeze(-1)).view(num_reqs, heads, dim).to(q.dtype)


def k_cache_block_size(layer) -> int:
    return layer.k_cache.shape[2]


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """One request's first `length` cached tokens: [kv_heads, length, dim]."""
    blocks = cache[table]  # [nb, kv_heads, bs, dim]
    nb, h, bs, d = blocks.shape
    return blocks.transpose(0, 1).reshape(h, nb * bs, d)[:, :length]
