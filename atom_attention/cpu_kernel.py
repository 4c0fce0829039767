"""A compiled CPU decode kernel behind the same interface as the torch one.

Built on first use with torch's C++ extension tooling (gcc, cached under
~/.cache/torch_extensions); where it cannot be built, the torch kernel serves and a
warning says why. Set ATOM_CPU_KERNEL=0 to keep the torch kernel.
"""

from __future__ import annotations

import os
import warnings
from functools import cache
from pathlib import Path

import torch

from atom_attention.torch_paged import TorchPagedAttention
from atom_core.attention import AttentionMetadata

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"


@cache
def load_extension():
    """The compiled module, or None (with a warning) where it cannot be built."""
    if os.environ.get("ATOM_CPU_KERNEL", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="atom_paged_decode",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no headers, no ninja: the torch kernel still works
        warnings.warn(f"atom: the compiled CPU attention kernel is unavailable ({e}); using the torch kernel")
        return None


class CpuPagedAttention(TorchPagedAttention):
    """Decode reads K/V in place through the compiled kernel; prefill stays on the torch path."""

    def __init__(self):
        self.ext = load_extension()
        self.uses_decode_chunks = self.ext is None

    def forward(self, layer, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        if self.ext is None or meta.max_seqlen_q != 1 or q.device.type != "cpu":
            return super().forward(layer, q, k, v, meta)
        self.write_kv(layer, k, v, meta)
        return self.ext.paged_decode(
            q.contiguous(), layer.k_cache, layer.v_cache, meta.block_tables, meta.context_lens, layer.scale
        )
