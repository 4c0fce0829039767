"""Torch building blocks that model plugins share (they import torch; `atom_core` does not)."""

from atom_core.layers.attention import Attention
from atom_core.layers.linear import Linear, MergedLinear
from atom_core.layers.norm import RMSNorm
from atom_core.layers.ops import apply_rotary, rms_norm, silu_and_mul
from atom_core.layers.rotary import RotaryEmbedding, get_rope

__all__ = ["Attention", "Linear", "MergedLinear", "RMSNorm", "RotaryEmbedding", "apply_rotary", "get_rope", "rms_norm", "silu_and_mul"]
