"""Paged attention in plain torch: exact, without padding requests to the batch's longest, and replaceable.

A layer's cache is `[kv_heads, num_blocks, block_size, head_dim]`: gathering a run of
blocks for one head gives one contiguous `[tokens, head_dim]` matrix, so decode runs a
few large matrix products instead of one per block. A faster kernel (a C++ extension,
aiter on ROCm) plugs in by subclassing the builder and setting `impl_cls`; models and
the runner never see the difference.
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
        self.write_kv(layer, k, v, meta)
        if "chunk_req" in meta.extra:
            return self.decode(layer, q, meta)
        return self.varlen(layer, q, k, v, meta)

    @staticmethod
    def write_kv(layer, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Every token's KV is written before any request reads: two prompts of one
        prefill batch may share a block the first one fills."""
        x = meta.extra
        if x["fresh_blocks"].numel():
            # Unwritten slots may hold anything, NaN included, and 0 * NaN would leak
            # through decode's block-wide products: clear a block when its first token arrives.
            layer.v_cache.index_fill_(1, x["fresh_blocks"], 0.0)
        blk, off = x["slot_block"], x["slot_offset"]
        layer.k_cache[:, blk, off] = k.transpose(0, 1)
        layer.v_cache[:, blk, off] = v.transpose(0, 1)

    def varlen(self, layer, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        """Any number of new tokens per request, attending to their cached prefix and to each other."""
        out = torch.empty_like(q)
        cu, ctx = meta.query_start_loc_cpu, meta.context_lens_cpu
        bs = layer.k_cache.shape[2]
        for i in range(meta.num_reqs):
            s, e, L = int(cu[i]), int(cu[i + 1]), int(ctx[i])
            n = e - s
            # 4-D inputs: torch's fused CPU kernel takes those (3-D ones fall back to the slow math path).
            qi = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
            if L == n:  # nothing cached: attend within the new tokens
                ki, vi = k[s:e].transpose(0, 1).unsqueeze(0), v[s:e].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=layer.scale, enable_gqa=True)
            else:
                table = meta.block_tables[i, : (L + bs - 1) // bs]
                ki = layer.k_cache.index_select(1, table).flatten(1, 2)[None, :, :L]  # [1, kv_heads, L, dim]
                vi = layer.v_cache.index_select(1, table).flatten(1, 2)[None, :, :L]
                if n == 1:  # one query sees every key: plain products beat the fused kernel's setup
                    out[s] = _single_query(q[s], ki[0], vi[0], layer.scale)
                    continue
                # Causal, aligned to the end: new token j sees keys up to position L - n + j.
                mask = torch.arange(L, device=q.device)[None, :] <= torch.arange(L - n, L, device=q.device)[:, None]
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=layer.scale, enable_gqa=True)
            out[s:e] = o[0].transpose(0, 1)
        return out

    def decode(self, layer, q, meta: AttentionMetadata) -> torch.Tensor:
        """One query per request, over chunks of a request's blocks, merged with a segmented softmax."""
        x = meta.extra
        req, blocks, mask = x["chunk_req"], x["chunk_blocks"], x["chunk_mask"]  # [C], [C * c], [C, c * bs]
        num_reqs, heads, dim = q.shape
        kv_heads = layer.num_kv_heads
        group = heads // kv_heads
        chunks = req.shape[0]
        kb = layer.k_cache.index_select(1, blocks).view(kv_heads, chunks, -1, dim)  # [kv_heads, C, c * bs, dim]
        vb = layer.v_cache.index_select(1, blocks).view(kv_heads, chunks, -1, dim)
        qc = q.index_select(0, req).view(chunks, kv_heads, group, dim).transpose(0, 1)  # [kv_heads, C, group, dim]
        scores = torch.matmul(qc, kb.transpose(-1, -2)).float().mul_(layer.scale)  # [kv_heads, C, group, c * bs]
        scores.masked_fill_(mask[None, :, None, :], float("-inf"))
        chunk_max = scores.amax(-1)  # [kv_heads, C, group]
        req_max = torch.full((kv_heads, num_reqs, group), float("-inf"), device=q.device)
        req_max.scatter_reduce_(1, req[None, :, None].expand_as(chunk_max), chunk_max, "amax")
        p = scores.sub_(req_max.index_select(1, req).unsqueeze(-1)).exp_()
        denom = torch.zeros((kv_heads, num_reqs, group), device=q.device).index_add_(1, req, p.sum(-1))
        pv = torch.matmul(p.to(vb.dtype), vb).float()  # [kv_heads, C, group, dim]
        out = torch.zeros((kv_heads, num_reqs, group, dim), device=q.device).index_add_(1, req, pv)
        out = out.div_(denom.unsqueeze(-1)).transpose(0, 1)  # [num_reqs, kv_heads, group, dim]
        return out.reshape(num_reqs, heads, dim).to(q.dtype)


def _single_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [heads, dim]; k, v: [kv_heads, L, dim]. The query heads of a group share their K/V head."""
    kv_heads, _, dim = k.shape
    qg = q.view(kv_heads, -1, dim)  # [kv_heads, group, dim]
    w = torch.matmul(qg, k.transpose(1, 2)).float().mul_(scale).softmax(dim=-1)
    return torch.matmul(w.to(v.dtype), v).view(-1, dim)
