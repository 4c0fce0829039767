"""Plain-torch (device-agnostic) kernels for Gated DeltaNet linear attention.

Gated DeltaNet (Qwen3-Next / Qwen3.5 "linear_attention" layers) keeps, per request and
per value head, a recurrent state ``S`` of shape ``[head_k_dim, head_v_dim]`` instead of
a KV cache. Per token ``t`` (all math in float32)::

    S   = S * exp(g_t)                         # g_t <= 0: log-space decay
    d   = beta_t * (v_t - k_t^T S)             # delta rule: write only the correction
    S   = S + k_t d^T
    o_t = (scale * q_t)^T S                    # scale = head_k_dim ** -0.5

with ``q``/``k`` L2-normalised first (``use_qk_l2norm``, as the model does). These
functions mirror transformers' torch fallback (``modeling_qwen3_next``) numerically, but
work on ONE request's tokens (no padding batch) with the state carried explicitly, so a
prompt can be cut into arbitrary chunked-prefill pieces, and decode updates a pool of
per-slot states in place.

Layouts (one request, tokens first, as the engine's flat token batches are):
    q, k:  [T, Hk, Dk]     v: [T, Hv, Dv]     g, beta: [T, Hv]
    state: [Hv, Dk, Dv] (float32)             out: [T, Hv, Dv]

GQA-style grouping: ``Hv`` must be a multiple of ``Hk``; key head ``i`` serves the
CONSECUTIVE value heads ``i*G .. i*G+G-1`` (``G = Hv // Hk``), i.e.
``repeat_interleave`` along the head dim, like the reference. All functions here accept
``Hk`` query/key heads and do that expansion themselves (``expand_qk_heads``).

The short causal depthwise conv that precedes the recurrence (``causal_conv1d``) and
the output norm (``gated_rms_norm``) are here too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "l2norm",
    "expand_qk_heads",
    "chunk_gated_delta_rule",
    "recurrent_gated_delta_rule",
    "recurrent_gated_delta_rule_step",
    "causal_conv1d",
    "causal_conv1d_update",
    "gated_rms_norm",
]


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` -- the exact form transformers/FLA use, so results match."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def expand_qk_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """Map ``Hk`` query/key heads (dim -2) onto ``num_v_heads`` value heads.

    Key head ``i`` serves consecutive value heads ``i*G .. i*G+G-1`` (repeat_interleave,
    not tile), matching the reference and the checkpoint's head ordering.
    """
    hk = x.shape[-2]
    if hk == num_v_heads:
        return x
    if num_v_heads % hk:
        raise ValueError(f"num_v_heads={num_v_heads} is not a multiple of num_k_heads={hk}")
    return x.repeat_interleave(num_v_heads // hk, dim=-2)


def prep_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32, head-expanded, (optionally) L2-normalised q/k, with q pre-scaled."""
    q = expand_qk_heads(q, num_v_heads).float()
    k = expand_qk_heads(k, num_v_heads).float()
    if use_qk_l2norm:
        q = l2norm(q)
        k = l2norm(k)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return q * scale, k


def _init_state(
    initial_state: torch.Tensor | None, h: int, dk: int, dv: int, dtype: torch.dtype, device
) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros(h, dk, dv, dtype=dtype, device=device)
    if initial_state.shape != (h, dk, dv):
        raise ValueError(f"initial_state shape {tuple(initial_state.shape)} != {(h, dk, dv)}")
    return initial_state.to(dtype=dtype, copy=True)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    *,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    state_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over one request's ``T`` tokens, chunked (WY / UT-transform form).

    Why chunked: within a chunk of ``C`` tokens the ``C`` sequential rank-1 updates collapse
    into a unit-lower-triangular solve plus a few matmuls, so prefill costs ``T/C``
    sequential steps instead of ``T``. The state is carried in and out, and chunks are
    counted from the start of THIS call, so any split of a prompt gives the same result
    (up to float rounding) as one call or the token-by-token recurrence.

    Args: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g (log decay, <= 0), beta (in (0, 1)) [T, Hv];
        initial_state [Hv, Dk, Dv] or None (zeros, a new request). Not modified.
    Returns: (out [T, Hv, Dv] in ``v.dtype``, final_state [Hv, Dk, Dv] in ``state_dtype``).
    """
    T, h, dv = v.shape
    dk = k.shape[-1]
    out_dtype = v.dtype
    state = _init_state(initial_state, h, dk, dv, torch.float32, v.device)
    if T == 0:
        return v.new_zeros(0, h, dv), state.to(state_dtype)

    q, k = prep_qk(q, k, h, use_qk_l2norm, scale)
    v = v.float()
    g = g.float()
    beta = beta.float()

    # Short pieces (e.g. a few chunked-prefill tokens) don't need a 64-wide padded chunk.
    C = min(chunk_size, T)
    pad = (-T) % C
    if pad:
        # Padded tokens have k = 0 and g = 0: they leave the state exactly unchanged.
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (T + pad) // C

    # -> chunk-major, head-major, contiguous [N, H, C, D]: per-chunk slices are contiguous
    # (strided slices made every matmul in the scan copy its operands).
    q, k, v = (x.view(n, C, h, x.shape[-1]).transpose(1, 2).contiguous() for x in (q, k, v))
    g = g.view(n, C, h).transpose(1, 2).contiguous()  # [N, H, C]
    beta = beta.view(n, C, h).transpose(1, 2).unsqueeze(-1)  # [N, H, C, 1]

    cum = g.cumsum(-1)  # log decay from chunk start to (and incl.) position t
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    pair = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill_(upper, float("-inf")).exp_()

    k_beta = k * beta
    # UT system A = I + tril(diag(beta) K K^T * decay, -1); solve for both right-hand sides at once.
    ut = (k_beta @ k.transpose(-1, -2)).mul_(pair)
    cum_exp = cum.exp().unsqueeze(-1)
    rhs = torch.cat((v * beta, k_beta * cum_exp), dim=-1)
    sol = torch.linalg.solve_triangular(ut, rhs, upper=False, unitriangular=True)
    u = sol[..., :dv].contiguous()  # pseudo-values
    w = sol[..., dv:].contiguous()  # decayed keys that read the old state

    attn = (q @ k.transpose(-1, -2)).mul_(pair)  # intra-chunk, causal incl. diagonal
    q_dec = q.mul_(cum_exp)
    k_dec = (k.mul_((cum[..., -1:] - cum).exp().unsqueeze(-1))).transpose(-1, -2)  # [N, H, Dk, C]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [N, H, 1, 1]

    out = torch.empty(n, h, C, dv, dtype=torch.float32, device=q.device)
    for i in range(n):
        # all in place on buffers this call owns (state is a private copy), so no temporaries
        v_new = u[i].baddbmm_(w[i], state, alpha=-1)
        torch.bmm(q_dec[i], state, out=out[i]).baddbmm_(attn[i], v_new)
        state.mul_(chunk_decay[i]).baddbmm_(k_dec[i], v_new)

    out = out.transpose(1, 2).reshape(n * C, h, dv)[:T]
    return out.to(out_dtype).contiguous(), state.to(state_dtype)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    state_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token reference of :func:`chunk_gated_delta_rule` (same args/returns).

    Slow (T sequential steps); exists as the ground truth for tests.
    """
    T, h, dv = v.shape
    dk = k.shape[-1]
    state = _init_state(initial_state, h, dk, dv, torch.float32, v.device)
    q, k = prep_qk(q, k, h, use_qk_l2norm, scale)
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.empty(T, h, dv, dtype=torch.float32, device=v.device)
    for t in range(T):
        state = state * gf[t].exp()[:, None, None]
        kv_mem = (state * k[t].unsqueeze(-1)).sum(-2)
        delta = (vf[t] - kv_mem) * bf[t].unsqueeze(-1)
        state = state + k[t].unsqueeze(-1) * delta.unsqueeze(-2)
        out[t] = (state * q[t].unsqueeze(-1)).sum(-2)
    return out.to(v.dtype), state.to(state_dtype)


def recurrent_gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    *,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """One decode token for each of ``B`` requests; updates the state pool in place.

    Why this shape: decode is memory-bound on the states (``Hv*Dk*Dv`` floats per request).
    Both reads of the old state (``k^T S`` and ``q^T S``) are one matmul, using
    ``q^T S_new = exp(g) q^T S_old + (q.k) delta``, and the update is one fused rank-1
    ``baddbmm_``. On CPU each request's pool row is updated directly through a view (no
    gather/scatter copies of the states, which are slower than the arithmetic they feed
    and whose big temporaries page-fault); on other devices the rows are
    gathered once and written back once with ``index_copy_`` (no host sync on ``slots``).

    Args: q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv];
        states [num_slots, Hv, Dk, Dv] pool (float32 usually); rows ``slots`` (LongTensor
        [B], distinct) are updated in place, no other row is touched.
    Returns: out [B, Hv, Dv] in ``v.dtype``.
    """
    if states.device.type == "cpu":
        return _step_rows(q, k, v, g, beta, states, slots, use_qk_l2norm, scale)
    return _step_gathered(q, k, v, g, beta, states, slots, use_qk_l2norm, scale)


def _step_rows(q, k, v, g, beta, states, slots, use_qk_l2norm=True, scale=None) -> torch.Tensor:
    """Decode step updating each pool row in place through a view (CPU path)."""
    B, h, dv = v.shape
    q, k = prep_qk(q, k, h, use_qk_l2norm, scale)  # [B, H, Dk] float32
    decay = g.float().exp()[:, :, None, None]  # [B, H, 1, 1]
    qk = torch.stack((q, k), dim=-2)  # [B, H, 2, Dk]
    qk = qk.to(states.dtype)
    vf = v.float()
    bf = beta.float().unsqueeze(-1)
    qdotk = (q * k).sum(-1, keepdim=True)  # [B, H, 1]
    k_col = k.unsqueeze(-1).to(states.dtype)  # [B, H, Dk, 1]
    out = torch.empty(B, h, dv, dtype=torch.float32, device=v.device)
    for b, s in enumerate(slots.tolist()):
        S = states[s]  # a view of the pool row [H, Dk, Dv]
        read = torch.bmm(qk[b], S).float() * decay[b]  # [H, 2, Dv]
        delta = (vf[b] - read[:, 1]) * bf[b]
        torch.addcmul(read[:, 0], qdotk[b], delta, out=out[b])
        S.mul_(decay[b].to(S.dtype)).baddbmm_(k_col[b], delta.unsqueeze(-2).to(S.dtype))
    return out.to(v.dtype)


def _step_gathered(q, k, v, g, beta, states, slots, use_qk_l2norm=True, scale=None) -> torch.Tensor:
    """Decode step as one gather, batched math, one ``index_copy_`` (accelerator path)."""
    B, h, dv = v.shape
    dk = k.shape[-1]
    q, k = prep_qk(q, k, h, use_qk_l2norm, scale)  # [B, H, Dk] float32
    S = states.index_select(0, slots).float()  # [B, H, Dk, Dv] (a fresh copy)
    decay = g.float().exp()  # [B, H]
    bh = B * h
    S2 = S.view(bh, dk, dv)
    qk = torch.stack((q, k), dim=-2).view(bh, 2, dk)
    read = torch.bmm(qk, S2).view(B, h, 2, dv) * decay[..., None, None]  # exp(g) [q;k]^T S_old
    delta = (v.float() - read[:, :, 1]) * beta.float().unsqueeze(-1)  # [B, H, Dv]
    out = read[:, :, 0] + (q * k).sum(-1, keepdim=True) * delta
    S2.mul_(decay.view(bh, 1, 1)).baddbmm_(k.reshape(bh, dk, 1), delta.reshape(bh, 1, dv))
    states.index_copy_(0, slots, S.to(states.dtype))
    return out.to(v.dtype)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor | None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over one request's chunk, carrying the last ``K-1`` inputs.

    Why a carried state: chunked prefill splits a prompt; each piece's first outputs need
    the previous piece's last ``K-1`` (pre-conv) inputs, so the pieces together equal one
    left-zero-padded conv over the whole prompt.

    Args: x [T, C]; weight [C, K] (depthwise); bias [C] or None;
        conv_state [C, K-1] (zeros/None for a new request). Not modified.
    Returns: (y [T, C] in ``x.dtype``, new_conv_state [C, K-1] in weight's dtype).
    """
    T, C = x.shape
    K = weight.shape[-1]
    if conv_state is None:
        conv_state = torch.zeros(C, K - 1, dtype=weight.dtype, device=x.device)
    xt = torch.cat((conv_state.to(weight.dtype), x.t().to(weight.dtype)), dim=-1)  # [C, K-1+T]
    y = F.conv1d(xt.unsqueeze(0), weight.unsqueeze(1), bias, groups=C)[0]  # [C, T]
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unsupported activation {activation!r}")
    new_state = xt[:, xt.shape[-1] - (K - 1) :].clone()
    return y.t().to(x.dtype).contiguous(), new_state


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode token for each of ``B`` requests; shifts the conv-state pool in place.

    Args: x [B, C]; weight [C, K]; bias [C] or None; conv_states [num_slots, C, K-1] pool,
        rows ``slots`` (LongTensor [B], distinct) updated in place, others untouched.
    Returns: y [B, C] in ``x.dtype``.
    """
    st = conv_states.index_select(0, slots).to(weight.dtype)  # [B, C, K-1]
    full = torch.cat((st, x.to(weight.dtype).unsqueeze(-1)), dim=-1)  # [B, C, K]
    y = (full * weight).sum(-1)
    if bias is not None:
        y = y + bias
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unsupported activation {activation!r}")
    conv_states.index_copy_(0, slots, full[:, :, 1:].to(conv_states.dtype))
    return y.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim, then ``* silu(z)`` (Qwen3NextRMSNormGated, norm before gate).

    Computed in float32; the normalised value is rounded to ``x.dtype`` before the weight,
    exactly as the reference module does, so results match it bit for bit in practice.
    """
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    h = h * F.silu(z.float())
    return h.to(dtype)
