"""Paged attention in plain torch: exact, without padding requests to the batch's longest, and replaceable.

A layer's cache is `[kv_heads, num_blocks, block_size, head_dim]`: gathering a run of
blocks for one head gives one contiguous `[tokens, head_dim]` matrix, so decode runs a
few large matrix products instead of one per block. This is the portable path (any
device torch runs on); `cpu_paged.py` replaces its decode with a C++ kernel, and other
kernels (aiter on ROCm) plug in the same way, through the builder's `impl_cls`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from atom_core.plugin_api import AttentionMetadata

# Decode chunks hold at most this many blocks; the size is picked per step.
MAX_CHUNK_BLOCKS = 16
# What one more chunk costs, in gathered blocks: small matrix products are inefficient.
CHUNK_OVERHEAD_BLOCKS = 2
# Up to this many requests, decode runs one fused attention call per request instead.
PER_REQUEST_DECODE_MAX = 4


def chunk_size(nblocks: np.ndarray) -> int:
    """The chunk size (in blocks) that gathers least, counting padding and per-chunk overhead."""
    sizes = np.arange(1, min(MAX_CHUNK_BLOCKS, int(nblocks.max())) + 1)
    nchunks = -(-nblocks[None, :] // sizes[:, None])  # [sizes, requests]
    cost = (nchunks * (sizes[:, None] + CHUNK_OVERHEAD_BLOCKS)).sum(axis=1)
    return int(sizes[np.argmin(cost)])


class TorchPagedAttention:
    def prepare(self, meta: AttentionMetadata, block_size: int, null_block: int) -> None:
        """Add this kernel's per-step fields to `meta.extra` (once per step, for every layer)."""
        self.prepare_common(meta, block_size)
        bs, dev = block_size, meta.slot_mapping.device
        slots = meta.slot_mapping
        meta.extra["slot_block"] = slots // bs
        meta.extra["slot_offset"] = slots % bs
        fresh = meta.slot_mapping_cpu[meta.positions_cpu % bs == 0] // bs  # blocks getting their first token
        meta.extra["fresh_blocks"] = torch.from_numpy(fresh).to(dev)
        # Decode rows lead the batch; with enough of them, they run chunked (the rest varlen).
        q_lens = np.diff(meta.query_start_loc_cpu)
        longer = np.flatnonzero(q_lens > 1)
        num_decodes = int(longer[0]) if len(longer) else meta.num_reqs
        if meta.padded_block_tables is None and num_decodes > PER_REQUEST_DECODE_MAX:
            meta.extra.update(decode_chunks(meta, bs, null_block, num_decodes))
            meta.extra["decode_reqs"] = num_decodes

    def prepare_common(self, meta: AttentionMetadata, block_size: int) -> None:
        """Fields every kernel of this family needs: the rectangular layout's masks, when a policy pads."""
        if meta.padded_block_tables is not None:
            meta.extra.update(rectangular_masks(meta, block_size))

    def forward(
        self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim] -> [tokens, heads, dim]."""
        self.write_kv(layer, k, v, meta)
        if meta.padded_block_tables is not None:
            return self.rectangular(layer, q, meta)
        if not layer.plain:  # no chunked decode
            return self.with_options(layer, q, meta)
        nd = meta.extra.get("decode_reqs", 0)
        if nd == 0:
            return self.varlen(layer, q, k, v, meta)
        if nd == meta.num_reqs:
            return self.decode(layer, q, meta)
        out = torch.empty_like(q)
        out[:nd] = self.decode(layer, q[:nd], meta)
        return self.varlen(layer, q, k, v, meta, first_req=nd, out=out)

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
        layer.k_cache[:, blk, off] = k.transpose(0, 1).to(layer.k_cache.dtype)
        layer.v_cache[:, blk, off] = v.transpose(0, 1).to(layer.v_cache.dtype)

    def varlen(self, layer, q, k, v, meta: AttentionMetadata, first_req: int = 0, out=None) -> torch.Tensor:
        """Any number of new tokens per request, attending to their cached prefix and to each other.

        Rows from `first_req` on; `out` holds the earlier rows' results when given. A layer with
        options (window, sinks, soft-capping) takes the eager path that has them.
        """
        if not layer.plain:
            return self.with_options(layer, q, meta, first_req, out)
        if out is None:
            out = torch.empty_like(q)
        cu, ctx = meta.query_start_loc_cpu, meta.context_lens_cpu
        bs = layer.k_cache.shape[2]
        for i in range(first_req, meta.num_reqs):
            s, e, L = int(cu[i]), int(cu[i + 1]), int(ctx[i])
            n = e - s
            # 4-D inputs: torch's fused CPU kernel takes those (3-D ones fall back to the slow math path).
            qi = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, heads, n, dim]
            if L == n:  # nothing cached: attend within the new tokens (as the cache holds them)
                ki, vi = (
                    as_cached(t[s:e], c).transpose(0, 1).unsqueeze(0)
                    for t, c in ((k, layer.k_cache), (v, layer.v_cache))
                )
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=layer.scale, enable_gqa=True)
            else:
                table = meta.block_tables[i, : (L + bs - 1) // bs]
                ki = read_cache(layer.k_cache, table, q)[None, :, :L]  # [1, kv_heads, L, dim]
                vi = read_cache(layer.v_cache, table, q)[None, :, :L]
                if n == 1:  # one query sees every key: plain products beat the fused kernel's setup
                    out[s] = _single_query(q[s], ki[0], vi[0], layer.scale)
                    continue
                # Causal, aligned to the end: new token j sees keys up to position L - n + j.
                mask = torch.arange(L, device=q.device)[None, :] <= torch.arange(L - n, L, device=q.device)[:, None]
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=layer.scale, enable_gqa=True)
            out[s:e] = o[0].transpose(0, 1)
        return out

    def with_options(self, layer, q, meta: AttentionMetadata, first_req: int = 0, out=None) -> torch.Tensor:
        """A layer with a sliding window, sinks or soft-capping: each request's scores in float32,
        masked, capped and softmaxed with the sinks (`attend`). Rows from `first_req` on."""
        if meta.padded_block_tables is not None:
            raise NotImplementedError(
                "a padding scheduling policy (spyre's rectangular layout) with sliding windows, sinks or "
                "soft-capping is not supported; use scheduling_policy='mixed'"
            )
        if out is None:
            out = torch.empty_like(q)
        cu, ctx = meta.query_start_loc_cpu, meta.context_lens_cpu
        bs = layer.k_cache.shape[2]
        window = layer.sliding_window
        for i in range(first_req, meta.num_reqs):
            s, e, L = int(cu[i]), int(cu[i + 1]), int(ctx[i])
            lo = 0 if window is None else max(0, L - (e - s) - window + 1)  # no query sees a key before lo
            first_block = lo // bs
            table = meta.block_tables[i, first_block : (L + bs - 1) // bs]
            keys = L - first_block * bs
            ki = read_cache(layer.k_cache, table, q)[:, :keys]  # [kv_heads, keys, dim]
            vi = read_cache(layer.v_cache, table, q)[:, :keys]
            out[s:e] = attend(q[s:e], ki, vi, L - (e - s) - first_block * bs, layer.scale, window,
                              layer.logit_softcap, layer.sinks)  # fmt: skip
        return out

    def rectangular(self, layer, q, meta: AttentionMetadata) -> torch.Tensor:
        """sendnn-inference's padded layout, run as the hardware runs it.

        Every row gathers the same `[width]` blocks (left padding blocks, then its own), its
        queries are padded to the step's longest, and a mask hides the padding blocks, the
        slots past each request's tkv and the future (causal). Padding slots are zeroed
        after the gather: whatever they hold never reaches the output. (A layer with options
        refuses it, `with_options`.)
        """
        if not layer.plain:
            return self.with_options(layer, q, meta)
        x = meta.extra
        table = meta.padded_block_tables  # [R, W]
        num_reqs, width = table.shape
        kv_heads, _, bs, dim = layer.k_cache.shape
        heads = q.shape[1]

        def gather(cache: torch.Tensor) -> torch.Tensor:
            rows = read_cache(cache, table.reshape(-1), q).view(kv_heads, num_reqs, width * bs, dim)
            return rows.transpose(0, 1).masked_fill_(x["rect_kv_pad"], 0.0)  # [R, kv_heads, W * bs, dim]

        kr, vr = gather(layer.k_cache), gather(layer.v_cache)
        tok_req, tok_idx = x["rect_tok_req"], x["rect_tok_idx"]
        qp = q.new_zeros((num_reqs, meta.max_seqlen_q, heads, dim))
        qp[tok_req, tok_idx] = q
        o = F.scaled_dot_product_attention(
            qp.transpose(1, 2), kr, vr, attn_mask=x["rect_mask"], scale=layer.scale, enable_gqa=True
        )  # [R, heads, Qmax, dim]
        return o.transpose(1, 2)[tok_req, tok_idx]

    def decode(self, layer, q, meta: AttentionMetadata) -> torch.Tensor:
        """One query per request, over chunks of a request's blocks, merged with a segmented softmax."""
        x = meta.extra
        req, blocks, mask = x["chunk_req"], x["chunk_blocks"], x["chunk_mask"]  # [C], [C * c], [C, c * bs]
        num_reqs, heads, dim = q.shape
        kv_heads = layer.num_kv_heads
        group = heads // kv_heads
        chunks = req.shape[0]
        kb = read_cache(layer.k_cache, blocks, q).view(kv_heads, chunks, -1, dim)  # [kv_heads, C, c * bs, dim]
        vb = read_cache(layer.v_cache, blocks, q).view(kv_heads, chunks, -1, dim)
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


def read_cache(cache: torch.Tensor, blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`blocks` of a layer's cache `[kv_heads, blocks, block_size, dim]` as `[kv_heads, tokens,
    dim]` in q's dtype (a cache may be narrower, `Config.kv_cache_dtype`)."""
    return cache.index_select(1, blocks).flatten(1, 2).to(q.dtype)


def as_cached(t: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """New K or V rounded as the cache holds them, in their own dtype: a prompt's own tokens
    attend to what later steps will read back."""
    return t if cache.dtype == t.dtype else t.to(cache.dtype).to(t.dtype)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, scale: float, window: int | None = None,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Eager attention with every option: q [n, heads, dim] at key positions first .. first + n - 1
    (causal), over k, v [kv_heads, keys, dim]. A query at p sees keys p - window + 1 .. p; scores
    are capped to softcap * tanh(score / softcap); a head's sink logit joins its softmax and is
    dropped. Float32 throughout, in query blocks to bound the scores' memory."""
    n, heads, dim = q.shape
    kv_heads, keys, _ = k.shape
    group = heads // kv_heads
    out = torch.empty_like(q)
    kf, vf = k.float(), v.float()
    key_pos = torch.arange(keys, device=q.device)
    for a in range(0, n, 256):
        b = min(n, a + 256)
        qb = q[a:b].float().view(b - a, kv_heads, group, dim).permute(1, 2, 0, 3)  # [kv_heads, group, m, dim]
        scores = torch.matmul(qb, kf.transpose(1, 2).unsqueeze(1)).mul_(scale)  # [kv_heads, group, m, keys]
        if softcap is not None:
            scores = scores.div_(softcap).tanh_().mul_(softcap)
        qpos = torch.arange(first + a, first + b, device=q.device)[:, None]
        hidden = key_pos[None, :] > qpos
        if window is not None:
            hidden |= key_pos[None, :] <= qpos - window
        scores.masked_fill_(hidden, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(kv_heads, group, 1, 1).expand(kv_heads, group, b - a, 1)
            scores = torch.cat([scores, sink], dim=-1)
        p = scores.softmax(dim=-1)
        if sinks is not None:
            p = p[..., :-1]
        o = torch.matmul(p, vf.unsqueeze(1))  # [kv_heads, group, m, dim]
        out[a:b] = o.permute(2, 0, 1, 3).reshape(b - a, heads, dim).to(q.dtype)
    return out


def _single_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [heads, dim]; k, v: [kv_heads, L, dim]. The query heads of a group share their K/V head."""
    kv_heads, _, dim = k.shape
    qg = q.view(kv_heads, -1, dim)  # [kv_heads, group, dim]
    w = torch.matmul(qg, k.transpose(1, 2)).float().mul_(scale).softmax(dim=-1)
    return torch.matmul(w.to(v.dtype), v).view(-1, dim)


def rectangular_masks(meta: AttentionMetadata, bs: int) -> dict[str, torch.Tensor]:
    """Masks for `rectangular`: key slot j of row r is real when left_pad * bs <= j < tkv,
    and query token t (at padded position left_pad * bs + position) sees real keys up to itself."""
    cu = meta.query_start_loc_cpu
    num_reqs, width = meta.padded_block_tables.shape
    q_lens = np.diff(cu)
    tok_req = np.repeat(np.arange(num_reqs), q_lens)
    tok_idx = np.arange(len(tok_req)) - cu[:-1][tok_req]
    start = meta.left_pad_blocks_cpu * bs  # [R] first real slot
    keys = np.arange(width * bs)
    kv_real = (keys[None, :] >= start[:, None]) & (keys[None, :] < meta.tkvs_cpu[:, None])  # [R, W * bs]
    qpos = start[tok_req] + meta.positions_cpu  # padded position of each query token
    mask = np.zeros((num_reqs, meta.max_seqlen_q, width * bs), dtype=bool)
    mask[tok_req, tok_idx] = kv_real[tok_req] & (keys[None, :] <= qpos[:, None])
    mask[:, :, 0] |= ~mask.any(-1)  # query slots no token fills: any key, output discarded
    dev = meta.slot_mapping.device
    return {
        "rect_tok_req": torch.from_numpy(tok_req).to(dev),
        "rect_tok_idx": torch.from_numpy(tok_idx).to(dev),
        "rect_kv_pad": torch.from_numpy(~kv_real)[:, None, :, None].to(dev),
        "rect_mask": torch.from_numpy(mask)[:, None].to(dev),
    }


def decode_chunks(meta: AttentionMetadata, bs: int, null_block: int, num_reqs: int) -> dict[str, torch.Tensor]:
    """Split each of the first `num_reqs` requests' blocks into chunks of c blocks; padding stays under one chunk a request."""
    ctx = meta.context_lens_cpu[:num_reqs]
    nblocks = (ctx + bs - 1) // bs
    c = chunk_size(nblocks)
    nchunks = (nblocks + c - 1) // c
    req = np.repeat(np.arange(len(ctx)), nchunks)
    first = np.zeros(len(ctx) + 1, dtype=np.int64)
    np.cumsum(nchunks, out=first[1:])
    chunk_in_req = np.arange(len(req)) - first[:-1][req]
    block_idx = chunk_in_req[:, None] * c + np.arange(c)[None, :]  # [C, c] index into the request's table
    table = meta.block_tables_cpu[:num_reqs]
    blocks = table[req[:, None], np.minimum(block_idx, table.shape[1] - 1)]
    # Past a request's last block: the null block. Those slots are masked, and zeros
    # times a zero weight stay zero.
    blocks = np.where(block_idx < nblocks[req][:, None], blocks, null_block)
    token_pos = block_idx[:, :, None] * bs + np.arange(bs)[None, None, :]  # [C, c, bs]
    mask = (token_pos >= ctx[req][:, None, None]).reshape(len(req), c * bs)
    dev = meta.slot_mapping.device
    return {
        "chunk_req": torch.from_numpy(req).to(dev),
        "chunk_blocks": torch.from_numpy(blocks.reshape(-1)).to(dev),
        "chunk_mask": torch.from_numpy(mask).to(dev),
    }
