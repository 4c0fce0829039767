"""Planning and allocating the KV pool: the builders' `KVLayout`s and the memory budget in,
one `KVPoolPlan` out, then each builder's tensors for it.

The budget pays first for what is reserved up front (every per-request state group, and the
state checkpoints prefix caching needs on a stateful model), then for paged blocks; a budget
that cannot hold one request of `max_model_len` tokens is an error naming the settings to change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from atom_core.config import Config
from atom_core.distributed.parallel_state import get_tp_group
from atom_core.kv.layout import KVLayout, KVPoolPlan
from atom_core.platform.memory import free_memory_bytes
from atom_core.runner.attention_builder import AttentionMetadataBuilder, KVCacheTensor

# Share of free memory the pool takes on CPU when neither `kv_cache_memory` nor
# `num_kvcache_blocks` is set (GPUs use `gpu_memory_utilization`).
CPU_KV_CACHE_FRACTION = 0.25


def plan_kv_pool(
    layouts: Mapping[str, KVLayout], config: Config, device: torch.device, reserved: int = 0
) -> KVPoolPlan:
    """The pool for attention types `layouts` under `config`'s budget; `reserved` blocks are the
    scheduling policy's and hold no request."""
    cfg, bs = config, config.kv_cache_block_size
    block_bytes = sum(layout.block_bytes for layout in layouts.values())
    stateful = {t: layout for t, layout in layouts.items() if layout.stateful}
    group_bytes = sum(layout.state_bytes * layout.state_slots_per_request for layout in stateful.values())
    groups_field = "num_per_req_cache_groups" if cfg.num_per_req_cache_groups else "max_num_seqs"
    num_groups = (cfg.num_per_req_cache_groups or cfg.max_num_seqs) if stateful else 0
    # Prefix caching resumes such a request only from a state checkpoint: one more slot
    # of each builder's state after the groups' slots, paid from the same budget.
    checkpoints = 0
    checkpoint_bytes = sum(layout.state_bytes for layout in stateful.values())
    if stateful and cfg.enable_prefix_caching:
        unable = sorted(t for t, layout in stateful.items() if not layout.state_checkpoints)
        if unable:
            raise ValueError(
                f"prefix caching needs state checkpoints from every attention type with per-request state; "
                f"{', '.join(map(repr, unable))} keeps none: set enable_prefix_caching=False"
            )
        if not cfg.gdn_checkpoint_slots:
            raise ValueError(
                "prefix caching on a model with per-request state resumes a prompt only "
                "from a state checkpoint, and gdn_checkpoint_slots=0 keeps none: set gdn_checkpoint_slots "
                "to 1 or more, or enable_prefix_caching=False"
            )
        checkpoints = cfg.gdn_checkpoint_slots
    assert cfg.max_model_len is not None  # the engine sets it from the checkpoint
    per_request = -(-cfg.max_model_len // bs)  # blocks for one full request (drafts stay inside them)
    # and for one with blocks for the k draft positions past its tokens too, which it takes only when free
    per_request_with_drafts = -(-(cfg.max_model_len + cfg.num_speculative_tokens) // bs)
    if cfg.num_kvcache_blocks is not None:
        num_blocks = cfg.num_kvcache_blocks
        source = f"num_kvcache_blocks={num_blocks}"
    else:
        if cfg.kv_cache_memory is not None:
            budget, source = cfg.kv_cache_memory, f"kv_cache_memory={cfg.kv_cache_memory}"
        elif device.type == "cpu":
            # shared by the tensor-parallel ranks on this host
            ranks_here = get_tp_group().local_world_size
            budget = int(free_memory_bytes(device) * CPU_KV_CACHE_FRACTION) // ranks_here
            source = f"{CPU_KV_CACHE_FRACTION:.0%} of free memory ({budget} bytes)"
            if ranks_here > 1:
                source = f"{CPU_KV_CACHE_FRACTION:.0%} of free memory over {ranks_here} ranks ({budget} bytes)"
        else:
            budget = int(free_memory_bytes(device) * cfg.gpu_memory_utilization)
            source = f"gpu_memory_utilization={cfg.gpu_memory_utilization} ({budget} bytes)"
        checkpoints_total = checkpoints * checkpoint_bytes
        groups_total = num_groups * group_bytes + checkpoints_total
        if group_bytes and budget - groups_total < (per_request + reserved) * block_bytes:
            fit = max(0, (budget - (per_request + reserved) * block_bytes - checkpoints_total) // group_bytes)
            also, beside, lower = "", "", groups_field
            if checkpoints:
                also = (
                    f" and {checkpoints} state checkpoints of {checkpoint_bytes} bytes "
                    f"(gdn_checkpoint_slots={checkpoints})"
                )
                beside, lower = f" beside the {checkpoints} checkpoints", f"{groups_field} or gdn_checkpoint_slots"
            raise ValueError(
                f"the KV budget from {source} cannot hold {num_groups} per-request state "
                f"groups of {group_bytes} bytes ({groups_field}={num_groups}){also} plus the "
                f"{per_request} blocks of {block_bytes} bytes one request of max_model_len={cfg.max_model_len} "
                f"tokens needs; at most {fit} groups fit{beside}: lower {lower}, or raise kv_cache_memory"
            )
        num_blocks = (budget - groups_total) // max(block_bytes, 1)
        # More than every running request at full length can never be used.
        num_blocks = min(num_blocks, cfg.max_num_seqs * per_request_with_drafts + reserved)
    if num_blocks - reserved < per_request:
        beside = f" beside the {reserved} the {cfg.scheduling_policy!r} policy reserves" if reserved else ""
        raise ValueError(
            f"the KV pool from {source} holds {num_blocks} blocks of {bs} tokens "
            f"({block_bytes} bytes each), fewer than the {per_request} blocks one request of "
            f"max_model_len={cfg.max_model_len} tokens needs{beside}; raise kv_cache_memory or "
            f"num_kvcache_blocks, or lower max_model_len"
        )
    plan = KVPoolPlan(
        num_blocks=num_blocks, block_size=bs, block_bytes=block_bytes, reserved_blocks=reserved,
        num_state_groups=num_groups, num_state_checkpoints=checkpoints,
        group_bytes=group_bytes, checkpoint_bytes=checkpoint_bytes,
    )  # fmt: skip
    # On CPU, past the memory available the pool's pages (mapped in the background) would be
    # filled in until the OS kills the process; a device allocator says so itself. Where
    # free memory cannot be read (no /proc/meminfo), an explicit size is taken as given.
    try:
        free = free_memory_bytes(device) if device.type == "cpu" else None
    except (OSError, RuntimeError):
        free = None
    if free is not None and plan.total_bytes > free:
        raise ValueError(
            f"the KV pool from {source} takes {plan.total_bytes} bytes ({num_blocks} blocks of {block_bytes} bytes"
            f"{' and per-request state' if group_bytes else ''}), more than the {free} bytes of "
            f"{device.type} memory available: lower kv_cache_memory or num_kvcache_blocks"
        )
    return plan


def allocate_kv_pool(
    builders: Mapping[str, AttentionMetadataBuilder],
    attn_layers: list[torch.nn.Module],
    plan: KVPoolPlan,
    num_kv_heads: int | None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, KVCacheTensor]]:
    """Each builder's pool tensors and per-request state for `plan`, then every attention layer
    bound to its cache by the builder that recognises it: (pool tensors, state tensors,
    `layer_{id}` -> that layer's `KVCacheTensor`)."""
    kv_cache_tensors: dict[str, torch.Tensor] = {}
    per_req_cache_tensors: dict[str, torch.Tensor] = {}
    for builder in builders.values():
        builder.bind_pool(plan)
        kv_cache_tensors.update(builder.allocate_kv_cache_tensors(num_kv_heads, 0))
    for builder in builders.values():
        layout = builder.kv_layout()
        if layout.stateful:
            per_req_cache_tensors.update(builder.allocate_per_req_cache(plan.state_slots(layout)))
    kv_cache_data: dict[str, Any] = {}
    for i, module in enumerate(attn_layers):
        layer_id = getattr(module, "layer_id", i)
        for builder in builders.values():
            kv = builder.build_kv_cache_tensor(layer_id, module)
            if kv is not None:
                kv_cache_data[f"layer_{layer_id}"] = kv
                break
        else:
            raise RuntimeError(f"no attention builder bound a cache to layer {layer_id} ({module.attn_type})")
    return kv_cache_tensors, per_req_cache_tensors, kv_cache_data
