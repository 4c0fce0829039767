"""Per-step metadata that attention layers read without it being threaded through every call.

Set by the model runner before each forward and reset after, as in AMD ATOM: models keep the
plain `forward(input_ids, positions)` signature, and attention backends find the step's
slot mapping and block tables here.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.define
class Context:
    positions: Any = None
    is_prefill: bool = False
    batch_size: int = 0
    graph_bs: int = 0
    is_draft: bool = False


@attrs.define
class ForwardContext:
    # The primary builder's metadata; `attn_metadata_by_type` holds every builder's.
    attn_metadata: Any = None
    attn_metadata_by_type: dict[str, Any] = attrs.field(factory=dict)
    context: Context = attrs.field(factory=Context)
    spec_decode_metadata: Any = None
    kv_cache_data: dict[str, Any] = attrs.field(factory=dict)
    # AMD ATOM's data-parallel metadata; Atom runs one process, so it stays None.
    dp_metadata: Any = None
    # Only the argmax of this step's logits is read (every sampling row greedy, no log
    # probabilities): an LM head may leave entries that cannot be the maximum at -inf
    # (`layers/argmax_screen.py`). Set only where a screened head exists (`ModelRunner.screens_lm_head`).
    argmax_only: bool = False


# The step under way's context; between steps an empty one, so that nothing here keeps an
# engine's KV pool alive once the engine is gone.
_forward_context = ForwardContext()


def set_forward_context(
    attn_metadata: Any = None,
    atom_config: Any = None,
    context: Context | None = None,
    spec_decode_metadata: Any = None,
    attn_metadata_by_type: dict[str, Any] | None = None,
    argmax_only: bool = False,
    kv_cache_data: dict[str, Any] | None = None,
) -> None:
    global _forward_context
    by_type = dict(attn_metadata_by_type or {})
    if attn_metadata is None and by_type:
        attn_metadata = next(iter(by_type.values()))
    _forward_context = ForwardContext(
        attn_metadata=attn_metadata,
        attn_metadata_by_type=by_type,
        context=context or Context(),
        spec_decode_metadata=spec_decode_metadata,
        kv_cache_data=kv_cache_data or {},
        argmax_only=argmax_only,
    )


def get_forward_context() -> ForwardContext:
    return _forward_context


def reset_forward_context() -> None:
    global _forward_context
    _forward_context = ForwardContext()
