"""MoE routers: router logits -> (weights, expert ids) per token, one function per method.

Each follows transformers' own router for its family op for op (scores in float32,
`torch.topk` for the same tie-breaking, the same masking values), so a tiny random
model routes every token to the same experts as the oracle. Methods live in a
name -> function table: a model (or a plugin) adds a routing function with
`register_router` and names it, without touching `FusedMoE` or `select_experts`.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Router(Protocol):
    def __call__(
        self,
        router_logits: torch.Tensor,
        top_k: int,
        /,
        *,
        renormalize: bool,
        num_expert_group: int | None,
        topk_group: int | None,
        routed_scaling_factor: float,
        correction_bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


ROUTERS: dict[str, Router] = {}


def register_router(name: str, fn: Router) -> None:
    """Make `fn` selectable as `select_experts(..., method=name)`; re-registering a name replaces it."""
    ROUTERS[name] = fn


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    method: str = "softmax",
    *,
    renormalize: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights float32 [T, top_k], expert ids int64 [T, top_k]).

    Weights are renormalised to sum to one when `renormalize` is set, then multiplied by
    `routed_scaling_factor` (the order every family uses).
    """
    fn = ROUTERS.get(method)
    if fn is None:
        raise ValueError(f"routing method {method!r} is not registered; known: {sorted(ROUTERS)}")
    num_experts = router_logits.shape[-1]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({num_experts})")
    weights, ids = fn(
        router_logits,
        top_k,
        renormalize=renormalize,
        num_expert_group=num_expert_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
        correction_bias=correction_bias,
    )
    return weights.to(torch.float32), ids.to(torch.int64)


def _finish(weights: torch.Tensor, renormalize: bool, scale: float, eps: float = 0.0) -> torch.Tensor:
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    return weights * scale if scale != 1.0 else weights


def softmax_topk(
    logits: torch.Tensor, top_k: int, *, renormalize: bool, routed_scaling_factor: float, **_
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE (`norm_topk_prob`) and Mixtral (always renormalised): softmax in float32, top-k."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return _finish(weights, renormalize, routed_scaling_factor), ids


def _group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    """[T, groups] scores -> [T, E] bool: experts whose group is among the `topk_group` best."""
    n_group = group_scores.shape[-1]
    keep = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    return mask.unsqueeze(-1).expand(-1, n_group, num_experts // n_group).reshape(-1, num_experts)


def _groups(num_experts: int, num_expert_group: int | None, topk_group: int | None, method: str) -> tuple[int, int]:
    if num_expert_group is None or topk_group is None:
        raise ValueError(
            f"routing method {method!r} needs num_expert_group and topk_group "
            f"(got num_expert_group={num_expert_group}, topk_group={topk_group})"
        )
    if num_expert_group <= 0 or num_experts % num_expert_group:
        raise ValueError(f"num_expert_group={num_expert_group} must divide the number of experts ({num_experts})")
    if not 0 < topk_group <= num_expert_group:
        raise ValueError(f"topk_group={topk_group} must be between 1 and num_expert_group={num_expert_group}")
    return num_expert_group, topk_group


def greedy(
    logits: torch.Tensor, top_k: int, *, renormalize: bool, routed_scaling_factor: float, **_
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 `greedy`: softmax in float32, top-k, times `routed_scaling_factor` (no renormalisation there)."""
    scores = logits.to(torch.float32).softmax(dim=-1)
    weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return _finish(weights, renormalize, routed_scaling_factor), ids


def group_limited_greedy(
    logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    num_expert_group: int | None,
    topk_group: int | None,
    routed_scaling_factor: float,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2: a group scores its best expert; experts outside the `topk_group` best groups
    score 0 (not -inf, as transformers: with top_k above the kept experts a zero-weight one is picked)."""
    num_experts = logits.shape[-1]
    n_group, keep = _groups(num_experts, num_expert_group, topk_group, "group_limited_greedy")
    scores = logits.to(torch.float32).softmax(dim=-1)
    group_scores = scores.view(-1, n_group, num_experts // n_group).max(dim=-1).values
    scores = scores.masked_fill(~_group_mask(group_scores, keep, num_experts), 0.0)
    weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return _finish(weights, renormalize, routed_scaling_factor), ids


def noaux_tc(
    logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    num_expert_group: int | None,
    topk_group: int | None,
    routed_scaling_factor: float,
    correction_bias: torch.Tensor | None,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: sigmoid scores; the correction bias steers selection (a group scores the sum of
    its two best biased scores) but the weights are the unbiased scores, renormalised (with
    `norm_topk_prob`) and times `routed_scaling_factor`. No groups given means one group."""
    num_experts = logits.shape[-1]
    n_group, keep = (
        (1, 1) if num_expert_group is None else _groups(num_experts, num_expert_group, topk_group, "noaux_tc")
    )
    scores = logits.to(torch.float32).sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.to(torch.float32)
    group_scores = (
        choice.view(-1, n_group, num_experts // n_group).topk(min(2, num_experts // n_group), dim=-1)[0].sum(-1)
    )
    choice = choice.masked_fill(~_group_mask(group_scores, keep, num_experts), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    return _finish(weights, renormalize, routed_scaling_factor, eps=1e-20), ids


register_router("softmax", softmax_topk)
register_router("greedy", greedy)
register_router("group_limited_greedy", group_limited_greedy)
register_router("noaux_tc", noaux_tc)
