"""Rotary position embedding (rotate-half), with the rope variants HF configs describe.

DeepSeek rotates interleaved pairs; its models de-interleave the rope part first
(`ops.apply_rotary_interleaved`) and share these rotate-half tables.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_layer_types(hf_config: Any) -> list[str] | None:
    """The layer types `rope_parameters` is keyed by (Gemma 3: "full_attention",
    "sliding_attention"), or None where one set of parameters serves every layer."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return list(params) if params and all(isinstance(v, dict) for v in params.values()) else None


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """One dict whatever the config's age: transformers 5 `rope_parameters`, or older
    top-level `rope_theta` + `rope_scaling`. Where `rope_parameters` is keyed by layer type
    (`rope_layer_types`), `layer_type`'s."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if rope_layer_types(hf_config):
        if layer_type not in params:
            raise ValueError(
                f"rope_parameters are keyed by layer type ({', '.join(params)}); the model asked for {layer_type!r}"
            )
        params = dict(params[layer_type])
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    for k, v in scaling.items():
        params.setdefault(k, v)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    params.setdefault("rope_type", "default")
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _linear_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    return inv_freq / p["factor"]


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context extended `scale` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    """transformers' `_compute_yarn_parameters`: interpolate the low frequencies, keep the high ones."""
    dim = 2 * inv_freq.numel()
    base, factor = float(p["rope_theta"]), p["factor"]
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1
    old_len = p["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation


def _longrope_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any], factors: str = "short_factor") -> torch.Tensor:
    """Phi-3's LongRoPE: each frequency divided by its own factor (`short_factor` within the
    original context, `long_factor` past it)."""
    ext = torch.tensor(p[factors], dtype=torch.float32)
    if ext.numel() != inv_freq.numel():
        raise ValueError(f"rope {factors} holds {ext.numel()} factors; a rotary dimension takes {inv_freq.numel()}")
    return inv_freq / ext


def attention_factor(p: dict[str, Any]) -> float:
    """What a rope type multiplies cos and sin by (YaRN's mscale ratio, LongRoPE's
    sqrt(1 + ln(factor) / ln(original length)); 1 elsewhere)."""
    if p["rope_type"] == "longrope":
        if p.get("attention_factor") is not None:
            return float(p["attention_factor"])
        factor = p["factor"]
        return (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(p["original_max_position_embeddings"]))
        )
    if p["rope_type"] != "yarn":
        return 1.0
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_get_mscale(p["factor"], mscale) / yarn_get_mscale(p["factor"], mscale_all_dim)
    return yarn_get_mscale(p["factor"])


# rope_type -> how it rescales the default inverse frequencies
INV_FREQ_SCALERS = {
    "default": None, "llama3": _llama3_inv_freq, "linear": _linear_inv_freq, "yarn": _yarn_inv_freq,
    "longrope": _longrope_inv_freq,
}  # fmt: skip


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to `max_position`, looked up per token."""

    cos: torch.Tensor
    sin_signed: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        inv_freq_scaler=None,
        params=None,
        scaling: float = 1.0,
        freq_factors: list[float] | None = None,
    ):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if inv_freq_scaler is not None:
            inv_freq = inv_freq_scaler(inv_freq, params)
        if freq_factors is not None:  # a GGUF file's rope_freqs, as llama.cpp applies them
            if len(freq_factors) != inv_freq.numel():
                raise ValueError(
                    f"rope_freq_factors holds {len(freq_factors)} factors; a rotary dimension of {head_dim} takes "
                    f"{inv_freq.numel()}"
                )
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        sin = emb.sin() * scaling
        half = head_dim // 2
        self.register_buffer("sin_signed", torch.cat((-sin[:, :half], sin[:, half:]), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin for each token, shaped to broadcast over heads; once per step."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin_signed[positions].to(dtype).unsqueeze(1)


def get_rope(hf_config: Any, head_dim: int, max_position: int, layer_type: str | None = None) -> RotaryEmbedding:
    """The rotary table of `hf_config` (of its `layer_type`'s parameters where they differ by layer)."""
    p = rope_parameters(hf_config, layer_type)
    kind = p["rope_type"]
    if kind not in INV_FREQ_SCALERS:
        raise ValueError(f"rope_type {kind!r} is not supported; supported: {', '.join(INV_FREQ_SCALERS)}")
    if kind == "longrope" or (kind == "yarn" and p.get("factor") is None):
        # implied by the two lengths (DeepSeek-V3's yarn; Phi-3's LongRoPE always)
        original = p.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings
        p["original_max_position_embeddings"] = original
        p["factor"] = hf_config.max_position_embeddings / original
    rope = RotaryEmbedding(
        head_dim,
        max_position,
        float(p["rope_theta"]),
        INV_FREQ_SCALERS[kind],
        p,
        scaling=attention_factor(p),
        freq_factors=getattr(hf_config, "rope_freq_factors", None),
    )
    original = p.get("original_max_position_embeddings") or max_position
    if kind == "longrope" and max_position > original:
        # Positions past the original context take the long factors. transformers switches a
        # whole sequence to them once it grows past that length; per position, the keys
        # already cached keep the rotation they were written with.
        long = RotaryEmbedding(
            head_dim, max_position, float(p["rope_theta"]), lambda f, q: _longrope_inv_freq(f, q, "long_factor"), p,
            scaling=attention_factor(p),
        )  # fmt: skip
        rope.cos[original:] = long.cos[original:]
        rope.sin_signed[original:] = long.sin_signed[original:]
    return rope
